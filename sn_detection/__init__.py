"""Learned and adaptive normalization layers as first-class detectron2 norm types.

With detectron2 installed, importing this package makes every name of ``sn_detection.layers.build_norm``
usable in detectron2's norm config keys (``sn_detection.d2.registry``); without it, the pure-PyTorch
layers still import.
"""

import importlib.util

__version__ = "0.1.0"

if importlib.util.find_spec("detectron2") is not None:
    from .d2.registry import install_get_norm

    install_get_norm()
