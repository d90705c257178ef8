"""``build_model(cfg)``: detectron2's ``build_model`` with our norms configured by ``cfg`` and frozen
where their stage is frozen."""

from __future__ import annotations

import detectron2.modeling
from detectron2.config import CfgNode
from torch import nn

from . import registry
from .config import norm_options_from_cfg, option_keys
from .freeze import freeze_norms
from .registry import norm_options_applied


def build_model(cfg: CfgNode) -> nn.Module:
    """The model of ``cfg``, built by detectron2's builders with ``cfg.MODEL.SN``'s options for our
    layers, and ``freeze_norms`` applied.

    A layer that refuses its options (a group count that does not suit its channels) raises a
    ValueError naming the config keys they come from."""
    with norm_options_applied(norm_options_from_cfg(cfg)):
        try:
            model = detectron2.modeling.build_model(cfg)
        except registry.NormBuildError as error:  # looked up now: the registry module may be reloaded
            keys = option_keys(error.norm)
            settings = ", ".join(f"{keys[option]}={value!r}" for option, value in error.options.items())
            raise ValueError(f"{error} (set by {settings})") from error
    freeze_norms(model)
    return model
