"""Normalization layers in pure PyTorch (no detectron2 import); ``build_norm`` creates them by name."""

from .dynamic import DynamicNorm2d
from .factory import NORM_NAMES, build_norm, norm_options
from .freezing import FreezableNorm
from .group import GroupNorm2d
from .mode import ModeGroupNorm2d, ModeNorm2d
from .positional import PositionalNorm2d, moment_shortcut, pono
from .skewness import SkewnessReducedBatchNorm2d
from .switchable import SwitchableNorm2d, SyncSwitchableNorm2d

__all__ = [
    "NORM_NAMES",
    "DynamicNorm2d",
    "FreezableNorm",
    "GroupNorm2d",
    "ModeGroupNorm2d",
    "ModeNorm2d",
    "PositionalNorm2d",
    "SkewnessReducedBatchNorm2d",
    "SwitchableNorm2d",
    "SyncSwitchableNorm2d",
    "build_norm",
    "moment_shortcut",
    "norm_options",
    "pono",
]
