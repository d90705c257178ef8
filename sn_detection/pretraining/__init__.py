"""Image-classification pretraining of the ResNet of a detection config (``tools/pretrain_backbone.py``,
whose command line is ``sn_detection.engine.pretrain_backbone``): its config keys (``config``), the data
(``data``), the network and the backbone checkpoint it leaves (``model``), the training (``train``), and
the backbone cache (``cache``, with ``top1_stop``).
"""

from .cache import cached_backbone, cached_backbone_path
from .model import BackboneClassifier, backbone_state, input_convention
from .train import pretrain, report

__all__ = [
    "BackboneClassifier",
    "backbone_state",
    "cached_backbone",
    "cached_backbone_path",
    "input_convention",
    "pretrain",
    "report",
]
