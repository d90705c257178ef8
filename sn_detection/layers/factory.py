"""The one table from norm names to layer classes, and everything derived from it.

- ``build_norm(name, num_channels, **options)`` builds a layer; ``NormFactory(name, **options)`` is the
  same layer for any channel count: a callable ``num_channels -> module``, which is what detectron2's
  ``get_norm`` (and so every stock builder's ``norm`` argument) accepts besides its own names.
- Every layer takes the channel count first and its options as keyword-only parameters, so the options
  of a name are read off its constructor's signature (``norm_options``), and each layer class states the
  rules of their values in ``option_rules`` (see ``options``): ``check_norm_options`` applies them without
  building anything, so that a bad value fails where it is written (a config, a factory), naming the
  option and its valid values.
- ``NORM_CLASSES`` is the set of our layer types (for the optimizer's rules and the analysis); each class
  names its gating parameters in ``gate_parameters``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from torch import nn

from .dynamic import DynamicNorm2d
from .group import GroupNorm2d
from .mode import ModeGroupNorm2d, ModeNorm2d
from .options import check_options
from .positional import PositionalNorm2d
from .skewness import SkewnessReducedBatchNorm2d
from .sparse_switchable import SparseSwitchableNorm2d, SyncSparseSwitchableNorm2d
from .switchable import SwitchableNorm2d, SyncSwitchableNorm2d

_NORMS = {
    "SN": SwitchableNorm2d,
    "SyncSN": SyncSwitchableNorm2d,
    "SSN": SparseSwitchableNorm2d,
    "SyncSSN": SyncSparseSwitchableNorm2d,
    "DN": DynamicNorm2d,
    "GN": GroupNorm2d,
    "MGN": ModeGroupNorm2d,
    "MN": ModeNorm2d,
    "BNSR": SkewnessReducedBatchNorm2d,
    "PONO": PositionalNorm2d,
}

NORM_NAMES = tuple(_NORMS)
# Every layer class of the table, once.
NORM_CLASSES = tuple(dict.fromkeys(_NORMS.values()))


def norm_class(name: str) -> type:
    """The layer class called ``name``."""
    if name not in _NORMS:
        raise ValueError(f"unknown norm {name!r}; valid names are {list(NORM_NAMES)}")
    return _NORMS[name]


def norm_options(name: str) -> tuple[str, ...]:
    """The keyword options accepted by the layer called ``name``."""
    parameters = inspect.signature(norm_class(name)).parameters.values()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def check_norm_options(name: str, options: Mapping[str, object]) -> None:
    """Raise a ValueError for an option the layer ``name`` does not have, or a value its rules refuse."""
    valid = norm_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"norm {name!r} does not accept option(s) {unknown}; its options are {list(valid)}")
    cls = norm_class(name)
    check_options(cls, cls.option_rules, **options)


class NormBuildError(ValueError):
    """A layer refused its options for the channels it was asked for (a group count that does not
    divide them, say)."""

    def __init__(self, norm: str, channels: int, options: Mapping[str, object], reason: Exception):
        super().__init__(f"cannot build norm {norm!r} over {channels} channels with options {dict(options)}: {reason}")
        self.norm = norm
        self.options = dict(options)


class NormFactory:
    """The layer ``name`` with ``options``, for any channel count: ``NormFactory("SN", momentum=0.05)(256)``.

    Options are checked when the factory is made; what depends on the channels, when a layer is built
    (a ``NormBuildError``). detectron2's builders take it wherever they take a norm name (its
    ``get_norm`` calls a callable with the channel count), which is how a LazyConfig passes our layers
    with their options as plain arguments: ``norm=L(NormFactory)(name="SN", momentum=0.05)``.
    """

    def __init__(self, name: str, **options):
        check_norm_options(name, options)
        self.name = name
        self.options = dict(options)

    def __call__(self, num_channels: int) -> nn.Module:
        try:
            return norm_class(self.name)(num_channels, **self.options)
        except ValueError as error:
            raise NormBuildError(self.name, num_channels, self.options, error) from error

    def __eq__(self, other) -> bool:
        return isinstance(other, NormFactory) and (self.name, self.options) == (other.name, other.options)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.options.items()))))

    def __repr__(self) -> str:
        options = "".join(f", {key}={value!r}" for key, value in self.options.items())
        return f"NormFactory({self.name!r}{options})"


def build_norm(name: str, num_channels: int, **options) -> nn.Module:
    """A new ``name`` layer over ``num_channels`` channels, configured by keyword ``options``."""
    return NormFactory(name, **options)(num_channels)


def gate_parameter_names(module: nn.Module) -> tuple[str, ...]:
    """The names, within ``module``, of the parameters that choose statistics rather than scale and shift
    (SN's logits, DN's gates, MN's and MGN's gate); () for a module that is none of our layers."""
    return getattr(module, "gate_parameters", ()) if isinstance(module, NORM_CLASSES) else ()
