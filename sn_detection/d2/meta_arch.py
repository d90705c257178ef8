"""How our norms reach detectron2's builders with the options of the config: ``SNMetaArch``.

detectron2 turns ``MODEL.RESNETS.NORM``, ``MODEL.FPN.NORM``, ``MODEL.ROI_BOX_HEAD.NORM``,
``MODEL.ROI_MASK_HEAD.NORM`` (and the norms of RetinaNet, semantic heads, ...) into modules with
``get_norm(norm, channels)``, which takes one of its own names or a callable ``channels -> module``. It
passes no config: a name alone cannot say with which options to build our layers.

The design: the model is built with the config's options by construction, through detectron2's own
seams, and with no state outside the config.

- ``SNMetaArch`` is registered in detectron2's ``META_ARCH_REGISTRY``; a config selects it with
  ``MODEL.META_ARCHITECTURE: SNMetaArch`` (our base configs do) and names the real meta-architecture in
  ``MODEL.SN.META_ARCHITECTURE`` (default ``GeneralizedRCNN``). Every entry point that builds a model from
  a config goes through the registry -- detectron2's ``build_model``, ``DefaultPredictor``,
  ``DefaultTrainer``, our trainer and tools, export scripts -- so all build the same model.
- It validates the config (``validate_sn_config``), copies it, replaces the value of every NORM key
  naming one of our norms by ``NormFactory(name, **options from MODEL.SN)``, and calls the registered
  meta-architecture with that copy. The stock builders read the key and pass the factory to ``get_norm``
  as they would pass a string, so our layers get exactly the config's options in every part (backbone,
  FPN, box and mask heads, C4's res5 head, RetinaNet, ...), and detectron2's names build what they build
  without ``SNMetaArch``. The model is detectron2's own class with its own state-dict keys.
- The copy is private to the build. yacs refuses non-yaml values on attribute assignment, so the
  factories are set as dict items of the copy (a ``CfgNode`` is a dict); the user's config is untouched.
- Nothing global: no patched detectron2 function, no module-level option state. A model built without
  ``SNMetaArch`` cannot get our layers with other options: detectron2's ``get_norm`` does not know our
  names (``KeyError: 'SN'``), and our tools reject such a config up front, naming the key. In a
  LazyConfig, where there is no ``MODEL.SN``, the options are plain arguments of the factory:
  ``norm=L(NormFactory)(name="SN", momentum=0.05)`` (``configs/lazy``).
- Frozen stages need nothing here: our layers freeze themselves when detectron2 freezes their parameters
  (``sn_detection.layers.base``).

Why not the alternatives: patching ``get_norm`` in every detectron2 module needs the options from
somewhere, and process-global options are silently lost by every entry point that has not set them;
wrapping each backbone and head builder under new registry names takes a config line per part instead
of one for the model, and still misses the builders not wrapped.
"""

from __future__ import annotations

from detectron2.config import CfgNode
from detectron2.layers import get_norm
from detectron2.modeling import META_ARCH_REGISTRY
from torch import nn

from ..layers import NORM_NAMES, NormBuildError, NormFactory
from .config import norm_factory_from_cfg, norm_keys, option_keys, validate_sn_config


def resolved_norm(cfg: CfgNode, norm: str) -> str | NormFactory:
    """What a NORM key set to ``norm`` gives detectron2's builders in the model of ``cfg``: our norm's
    factory with the options of ``cfg.MODEL.SN``, or detectron2's name as it is."""
    return norm_factory_from_cfg(cfg, norm) if norm in NORM_NAMES else norm


def norm_layer(cfg: CfgNode, norm: str, channels: int) -> nn.Module | None:
    """The layer over ``channels`` channels that a NORM key set to ``norm`` builds in the model of ``cfg``."""
    return get_norm(resolved_norm(cfg, norm), channels)


def resolve_norms(cfg: CfgNode) -> CfgNode:
    """A frozen copy of ``cfg`` for the registered ``MODEL.SN.META_ARCHITECTURE``: its META_ARCHITECTURE
    is that one, and each NORM key naming one of our norms holds that norm's ``NormFactory`` with the
    options of ``cfg.MODEL.SN``."""
    resolved = cfg.clone()
    resolved.defrost()
    resolved.MODEL.META_ARCHITECTURE = cfg.MODEL.SN.META_ARCHITECTURE
    for _, node, norm in list(norm_keys(resolved.MODEL)):
        dict.__setitem__(node, "NORM", resolved_norm(cfg, norm))  # see the module docstring
    resolved.freeze()
    return resolved


@META_ARCH_REGISTRY.register()
def SNMetaArch(cfg: CfgNode) -> nn.Module:
    """The model of ``cfg.MODEL.SN.META_ARCHITECTURE`` with our norms built with the options of
    ``cfg.MODEL.SN`` (module docstring). A layer that refuses its options for its channels (a group count
    that does not divide them) fails with a ValueError naming the config keys they come from."""
    validate_sn_config(cfg)
    try:
        return META_ARCH_REGISTRY.get(cfg.MODEL.SN.META_ARCHITECTURE)(resolve_norms(cfg))
    except NormBuildError as error:
        keys = option_keys(error.norm)
        settings = ", ".join(f"{keys[option]}={value!r}" for option, value in error.options.items())
        raise ValueError(f"{error} (set by {settings})") from error
