"""Image-classification pretraining of the ResNet of a detection config (``tools/pretrain_backbone.py``,
whose command line is ``sn_detection.engine.pretrain_backbone``): its config keys (``config``), the data
(``data``), the network and the backbone checkpoint it leaves (``model``), the training (``train``), and
the backbone cache (``cache``, with ``top1_stop``).

``config`` depends only on ``sn_detection.layers`` and is what ``sn_detection.d2.add_sn_config`` calls,
while the others build on ``sn_detection.d2``; so the package's names below are imported from
their modules when first asked for, not when the package is (which would import ``d2`` from within it).
"""

import importlib

_MODULE_OF = {
    "BackboneClassifier": "model",
    "backbone_state": "model",
    "input_convention": "model",
    "cached_backbone": "cache",
    "cached_backbone_path": "cache",
    "pretrain": "train",
    "report": "train",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
