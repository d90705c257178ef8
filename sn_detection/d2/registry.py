"""Make the layer factory's names resolvable wherever detectron2 resolves a norm string.

detectron2 turns ``MODEL.RESNETS.NORM``, ``MODEL.FPN.NORM``, ``MODEL.ROI_BOX_HEAD.NORM``,
``MODEL.ROI_MASK_HEAD.NORM`` (and the norms of RegNet, RetinaNet, semantic heads, ...) into modules with
``detectron2.layers.get_norm(norm, out_channels)``. It has no registry: the names are a dict literal
inside the function, and each builder module imports the function by name
(``from detectron2.layers import get_norm``), so it holds its own reference to it.

The mechanism chosen here: ``install_get_norm()`` replaces that function, in ``detectron2.layers``, in
``detectron2.layers.batch_norm`` and in every loaded ``detectron2.*`` module that holds it, by the wrapper
``get_norm`` of this module, which builds our layers for our names and hands everything else to the
original function unchanged. Why this way:

- It is the only seam the stock builders offer: they pass the config string to ``get_norm`` and use
  what it returns. Config keys are strings (yaml), so handing the builders callables is no option, and
  rewriting the function's code object in place would be opaque and lose the original.
- ``detectron2.modeling`` is imported first, so every stock builder (ResNet, FPN, box and mask heads,
  RegNet, RetinaNet, ...) is loaded and patched; modules imported later get the wrapper by name from
  ``detectron2.layers``. Modules outside ``detectron2`` are left alone: one that imported ``get_norm``
  by name before ``sn_detection`` was imported keeps the original, so import ``sn_detection`` first.
- Built-in names (``BN``, ``FrozenBN``, ``SyncBN``, ``LN``, ...), ``""``, ``None`` and callables reach the
  original function and build exactly what they built before. ``GN`` is served by our
  ``GroupNorm2d``: a ``torch.nn.GroupNorm`` subclass with detectron2's 32 groups and the same state-dict
  keys by default, whose group count comes from ``MODEL.SN.GN_GROUPS``.
- Installing is idempotent (only attributes that are the original function, or a wrapper left by an
  earlier copy of this module, are replaced), and the original stays reachable as
  ``ORIGINAL_GET_NORM`` (also ``get_norm.__wrapped__``).
- detectron2 fails on an unknown name with a bare ``KeyError``; the wrapper raises a ``ValueError``
  listing every valid name, ours and detectron2's, when the model is built.

Options. ``get_norm`` has no config argument, so the keyword options our layers are built with are
module state: ``set_norm_options(options)`` sets them for every later build, ``norm_options_applied``
sets them for the builds inside a ``with`` block; ``options`` maps a norm name to its keyword options
(``sn_detection.d2.norm_options_from_cfg(cfg)`` reads them from ``cfg.MODEL.SN``). Without either, our
layers get their constructors' defaults. ``sn_detection.d2.build_model(cfg)`` applies the options of
``cfg`` for its build; whoever calls detectron2's ``build_model`` directly calls ``set_norm_options``
first (or wraps the call in ``norm_options_applied``), and ``sn_detection.d2.freeze_norms`` after.
Invalid option values fail in the layer's constructor, i.e. at build time, with its reason wrapped in a
``NormBuildError`` (a ``ValueError``) that names the norm, the channels and the options.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import detectron2.layers.batch_norm
import detectron2.modeling  # noqa: F401  loads every stock builder, so that all are patched

from ..layers import NORM_NAMES, build_norm, norm_options

# The names of the dict inside detectron2's get_norm (it exposes no list). Only used in error messages:
# any name that is not ours goes to the original function, so names added later keep working.
DETECTRON2_NORM_NAMES = ("BN", "SyncBN", "FrozenBN", "GN", "nnSyncBN", "naiveSyncBN", "naiveSyncBN_N", "LN")

_WRAPPER_MARK = "_sn_detection_get_norm"


def _unwrapped(function):
    while getattr(function, _WRAPPER_MARK, False):
        function = function.__wrapped__
    return function


ORIGINAL_GET_NORM = _unwrapped(detectron2.layers.batch_norm.get_norm)

_options: Mapping[str, Mapping[str, object]] = MappingProxyType({})


class NormBuildError(ValueError):
    """One of our layers refused its options for the channels a builder asked for."""

    def __init__(self, norm: str, channels: int, options: Mapping[str, object], reason: Exception):
        super().__init__(f"cannot build norm {norm!r} over {channels} channels with options {options}: {reason}")
        self.norm = norm
        self.options = options


def valid_norm_names() -> tuple[str, ...]:
    """Every norm string the wrapper accepts: ours, then detectron2's other built-in names."""
    return NORM_NAMES + tuple(name for name in DETECTRON2_NORM_NAMES if name not in NORM_NAMES)


def get_norm(norm, out_channels: int):
    """detectron2's ``get_norm``, with the names of ``sn_detection.layers.build_norm`` added.

    Our names build our layers with the options set by ``set_norm_options`` / ``norm_options_applied``;
    anything else is resolved by detectron2's own ``get_norm``.
    """
    if isinstance(norm, str) and norm in NORM_NAMES:
        options = dict(_options.get(norm, {}))
        try:
            return build_norm(norm, out_channels, **options)
        except ValueError as error:
            raise NormBuildError(norm, out_channels, options, error) from error
    try:
        return ORIGINAL_GET_NORM(norm, out_channels)
    except KeyError as error:
        if isinstance(norm, str) and error.args == (norm,):
            raise ValueError(f"unknown norm {norm!r}; valid names are {list(valid_norm_names())}") from None
        raise


get_norm.__wrapped__ = ORIGINAL_GET_NORM
setattr(get_norm, _WRAPPER_MARK, True)


def install_get_norm() -> None:
    """Replace detectron2's ``get_norm`` by ``get_norm`` in every loaded ``detectron2`` module."""
    for name, module in list(sys.modules.items()):
        if name != "detectron2" and not name.startswith("detectron2."):
            continue
        current = getattr(module, "__dict__", {}).get("get_norm")
        if current is not None and current is not get_norm and _unwrapped(current) is ORIGINAL_GET_NORM:
            setattr(module, "get_norm", get_norm)


def current_norm_options() -> Mapping[str, Mapping[str, object]]:
    """The options our layers are built with now: norm name -> keyword options."""
    return _options


def set_norm_options(options: Mapping[str, Mapping[str, object]]) -> None:
    """Build our layers with ``options`` (norm name -> keyword options) from now on.

    Names and option names are checked here; values are checked by the layers when they are built.
    """
    global _options
    for name, layer_options in options.items():
        if name not in NORM_NAMES:
            raise ValueError(f"options given for unknown norm {name!r}; our norms are {list(NORM_NAMES)}")
        unknown = sorted(set(layer_options) - set(norm_options(name)))
        if unknown:
            raise ValueError(f"norm {name!r} has no option(s) {unknown}; its options are {list(norm_options(name))}")
    _options = MappingProxyType({name: MappingProxyType(dict(opts)) for name, opts in options.items()})


@contextlib.contextmanager
def norm_options_applied(options: Mapping[str, Mapping[str, object]]) -> Iterator[None]:
    """Build our layers with ``options`` inside the ``with`` block; the previous options after it."""
    previous = _options
    set_norm_options(options)
    try:
        yield
    finally:
        set_norm_options(previous)
