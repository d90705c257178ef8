"""Learned and adaptive normalization layers as first-class detectron2 norm types.

With detectron2 installed, importing this package registers ``SNMetaArch``, the meta-architecture that
builds every norm name of ``sn_detection.layers`` with the options of the config
(``sn_detection.d2.meta_arch``); without it, the pure-PyTorch layers still import.
"""

import importlib.util

__version__ = "0.1.0"

if importlib.util.find_spec("detectron2") is not None:
    from . import d2  # noqa: F401  registers SNMetaArch
