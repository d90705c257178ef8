"""``build_model(cfg)``: detectron2's ``build_model`` with our norms configured by ``cfg`` and frozen
where their stage is frozen."""

from __future__ import annotations

import detectron2.modeling
from detectron2.config import CfgNode
from torch import nn

from .config import norm_options_from_cfg
from .freeze import freeze_norms
from .registry import norm_options_applied


def build_model(cfg: CfgNode) -> nn.Module:
    """The model of ``cfg``, built by detectron2's builders with ``cfg.MODEL.SN``'s options for our
    layers, and ``freeze_norms`` applied."""
    with norm_options_applied(norm_options_from_cfg(cfg)):
        model = detectron2.modeling.build_model(cfg)
    freeze_norms(model)
    return model
