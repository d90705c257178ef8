"""Image-classification pretraining of the ResNet of a detection config (``tools/pretrain_backbone.py``):
the data (``data``), the network and the backbone checkpoint it leaves (``model``), the training
(``train``), and the cached backbone of the demo."""

from .model import BackboneClassifier, backbone_state, input_convention
from .train import cached_backbone, cached_backbone_path, pretrain, report

__all__ = ["BackboneClassifier", "backbone_state", "cached_backbone", "cached_backbone_path", "input_convention", "pretrain", "report"]
