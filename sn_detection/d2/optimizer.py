"""The optimizer: detectron2's SGD and parameter rules, extended to our norms.

detectron2's ``get_default_optimizer_params`` gives ``SOLVER.WEIGHT_DECAY_NORM`` to the parameters of
modules that are instances of a fixed tuple of torch norm classes (BatchNorm, SyncBatchNorm, GroupNorm,
InstanceNorm, LayerNorm, LocalResponseNorm), and its ``overrides`` key on the bare parameter name, so
they cannot tell our norms' ``weight`` (or MN's ``gate.weight``) from a convolution's. Hence the rules
for our norms are applied per parameter on top of detectron2's:

- the affine ``weight`` and ``bias`` of every norm of ours get ``SOLVER.WEIGHT_DECAY_NORM``, as
  detectron2's own norms do (a ``bias`` keeps detectron2's bias rule when ``SOLVER.WEIGHT_DECAY_BIAS``
  is set, and ``SOLVER.BIAS_LR_FACTOR`` as for any bias);
- the gating parameters, SN's logits ``mean_weight`` / ``var_weight``, DN's ``channel_gates`` /
  ``batch_gate``, and MN's and MGN's ``gate.weight`` / ``gate.bias``, get ``SOLVER.GATE_WEIGHT_DECAY``
  and the learning rate ``SOLVER.BASE_LR * SOLVER.GATE_LR_FACTOR``, replacing any other rule (the
  authors' detection code gives SN's logits no weight decay, the default here).

Every other parameter keeps detectron2's rules, frozen parameters (``requires_grad=False``) stay out of the
optimizer, and the optimizer is detectron2's: SGD with ``SOLVER.MOMENTUM``, ``SOLVER.NESTEROV`` and
``SOLVER.WEIGHT_DECAY``, wrapped by ``maybe_add_gradient_clipping``. detectron2's LR schedulers scale each
group's initial learning rate, so the gate factor holds over the whole schedule.
"""

from __future__ import annotations

import torch
from detectron2.config import CfgNode
from detectron2.solver import get_default_optimizer_params
from detectron2.solver.build import maybe_add_gradient_clipping
from torch import nn

from ..layers import (
    DynamicNorm2d,
    GroupNorm2d,
    ModeGroupNorm2d,
    ModeNorm2d,
    PositionalNorm2d,
    SkewnessReducedBatchNorm2d,
    SwitchableNorm2d,
)

# Every layer class of the factory (SyncSwitchableNorm2d is a SwitchableNorm2d).
NORM_TYPES = (
    SwitchableNorm2d,
    DynamicNorm2d,
    GroupNorm2d,
    ModeNorm2d,
    ModeGroupNorm2d,
    SkewnessReducedBatchNorm2d,
    PositionalNorm2d,
)
# Names, within their norm layer, of the parameters that select statistics rather than scale and shift.
GATE_PARAMETERS = frozenset({"mean_weight", "var_weight", "channel_gates", "batch_gate", "gate.weight", "gate.bias"})


def build_optimizer(cfg: CfgNode, model: nn.Module) -> torch.optim.Optimizer:
    """detectron2's ``build_optimizer`` with the parameter rules of ``get_optimizer_params``."""
    optimizer = torch.optim.SGD(
        get_optimizer_params(cfg, model),
        lr=cfg.SOLVER.BASE_LR,
        momentum=cfg.SOLVER.MOMENTUM,
        nesterov=cfg.SOLVER.NESTEROV,
        weight_decay=cfg.SOLVER.WEIGHT_DECAY,
        foreach=True,
    )
    return maybe_add_gradient_clipping(cfg, optimizer)


def get_optimizer_params(cfg: CfgNode, model: nn.Module) -> list[dict]:
    """Parameter groups: detectron2's defaults, then our norms' rules (see the module docstring)."""
    groups = get_default_optimizer_params(
        model,
        base_lr=cfg.SOLVER.BASE_LR,
        weight_decay_norm=cfg.SOLVER.WEIGHT_DECAY_NORM,
        bias_lr_factor=cfg.SOLVER.BIAS_LR_FACTOR,
        weight_decay_bias=cfg.SOLVER.WEIGHT_DECAY_BIAS,
    )
    hyperparams = {}
    for group in groups:
        values = {key: value for key, value in group.items() if key != "params"}
        hyperparams.update((param, dict(values)) for param in group["params"])
    for param, rule in _norm_rules(cfg, model):
        hyperparams[param].update(rule)
    return _grouped(hyperparams)


def _norm_rules(cfg: CfgNode, model: nn.Module):
    """(parameter, hyperparameters to set) for each trainable parameter of our norms."""
    gate_rule = {"lr": cfg.SOLVER.BASE_LR * cfg.SOLVER.GATE_LR_FACTOR, "weight_decay": cfg.SOLVER.GATE_WEIGHT_DECAY}
    norm_rule = {"weight_decay": cfg.SOLVER.WEIGHT_DECAY_NORM}
    bias_keeps_its_rule = cfg.SOLVER.WEIGHT_DECAY_BIAS is not None
    for module in model.modules():
        if not isinstance(module, NORM_TYPES):
            continue
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            if name in GATE_PARAMETERS:
                yield param, gate_rule
            elif not (name == "bias" and bias_keeps_its_rule):
                yield param, norm_rule


def _grouped(hyperparams: dict) -> list[dict]:
    """One parameter group per distinct set of hyperparameters, in the order of first appearance."""
    groups: dict[tuple, list] = {}
    for param, values in hyperparams.items():
        groups.setdefault(tuple(sorted(values.items())), []).append(param)
    return [{"params": params, **dict(key)} for key, params in groups.items()]
