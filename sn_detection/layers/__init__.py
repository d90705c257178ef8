"""Normalization layers in pure PyTorch (no detectron2 import); ``build_norm`` creates them by name,
``NormFactory`` for any channel count, ``update_batch_average`` runs the SN paper's batch average."""

from .base import IDENTITY_KEY, NormBase
from .batch_average import batch_statistics_modules, has_batch_statistics, update_batch_average
from .dynamic import DynamicNorm2d
from .factory import (
    NORM_CLASSES,
    NORM_NAMES,
    NormBuildError,
    NormFactory,
    build_norm,
    check_norm_options,
    gate_parameter_names,
    norm_class,
    norm_options,
)
from .group import GroupNorm2d
from .mode import ModeGroupNorm2d, ModeNorm2d
from .positional import PositionalNorm2d, moment_shortcut, pono
from .running import RunningMoments
from .skewness import SkewnessReducedBatchNorm2d
from .sparse_switchable import SparseSwitchableNorm2d, SyncSparseSwitchableNorm2d
from .switchable import SwitchableNorm2d, SyncSwitchableNorm2d

__all__ = [
    "NORM_CLASSES",
    "IDENTITY_KEY",
    "NORM_NAMES",
    "DynamicNorm2d",
    "GroupNorm2d",
    "ModeGroupNorm2d",
    "ModeNorm2d",
    "NormBase",
    "NormBuildError",
    "NormFactory",
    "PositionalNorm2d",
    "RunningMoments",
    "SkewnessReducedBatchNorm2d",
    "SparseSwitchableNorm2d",
    "SwitchableNorm2d",
    "SyncSparseSwitchableNorm2d",
    "SyncSwitchableNorm2d",
    "batch_statistics_modules",
    "build_norm",
    "check_norm_options",
    "gate_parameter_names",
    "has_batch_statistics",
    "moment_shortcut",
    "norm_class",
    "norm_options",
    "pono",
    "update_batch_average",
]
