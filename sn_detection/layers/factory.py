"""``build_norm(name, num_channels, **options)``: the one table from norm names to layer classes.

Every layer takes the channel count first and its options as keyword-only parameters, so the valid
options of a name are read off its constructor's signature and misspelled ones fail loudly instead of
being silently ignored.
"""

import inspect

from torch import nn

from .dynamic import DynamicNorm2d
from .group import GroupNorm2d
from .mode import ModeGroupNorm2d, ModeNorm2d
from .positional import PositionalNorm2d
from .skewness import SkewnessReducedBatchNorm2d
from .switchable import SwitchableNorm2d, SyncSwitchableNorm2d

_NORMS = {
    "SN": SwitchableNorm2d,
    "SyncSN": SyncSwitchableNorm2d,
    "DN": DynamicNorm2d,
    "GN": GroupNorm2d,
    "MGN": ModeGroupNorm2d,
    "MN": ModeNorm2d,
    "BNSR": SkewnessReducedBatchNorm2d,
    "PONO": PositionalNorm2d,
}

NORM_NAMES = tuple(_NORMS)


def norm_options(name: str) -> tuple[str, ...]:
    """The keyword options accepted by the layer called ``name``."""
    parameters = inspect.signature(_norm_class(name)).parameters.values()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def build_norm(name: str, num_channels: int, **options) -> nn.Module:
    """A new ``name`` layer over ``num_channels`` channels, configured by keyword ``options``."""
    valid = norm_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"norm {name!r} does not accept option(s) {unknown}; its options are {list(valid)}")
    return _norm_class(name)(num_channels, **options)


def _norm_class(name: str) -> type:
    if name not in _NORMS:
        raise ValueError(f"unknown norm {name!r}; valid names are {list(NORM_NAMES)}")
    return _NORMS[name]
