"""The optimizer: detectron2's SGD and parameter rules, extended to our norms.

detectron2's ``get_default_optimizer_params`` gives ``weight_decay_norm`` to the parameters of modules
that are instances of a fixed tuple of torch norm classes (BatchNorm, SyncBatchNorm, GroupNorm,
InstanceNorm, LayerNorm, LocalResponseNorm), and its ``overrides`` key on the bare parameter name, so
they cannot tell our norms' ``weight`` (or MN's ``gate.weight``) from a convolution's. Hence the rules
for our norms (``sn_detection.layers.NORM_CLASSES``) are applied per parameter on top of detectron2's:

- the affine ``weight`` and ``bias`` of every norm of ours get ``weight_decay_norm``
  (``SOLVER.WEIGHT_DECAY_NORM``), as detectron2's own norms do (a ``bias`` keeps detectron2's bias rule
  when ``weight_decay_bias`` is set, and ``bias_lr_factor`` as for any bias);
- the gating parameters each layer names in ``gate_parameters`` -- SN's logits, DN's gates, MN's and
  MGN's gate -- get ``gate_weight_decay`` (``SOLVER.GATE_WEIGHT_DECAY``) and the learning rate
  ``base_lr * gate_lr_factor`` (``SOLVER.GATE_LR_FACTOR``), replacing any other rule (the authors'
  detection code gives SN's logits no weight decay, the default here).

Every other parameter keeps detectron2's rules, and frozen parameters (``requires_grad=False``) stay out.
``get_optimizer_params`` takes the rules as plain arguments, like detectron2's own function, so that a
LazyConfig sets them (``configs/lazy``); ``build_optimizer(cfg, model)`` reads them from a yaml config
and builds detectron2's SGD (``SOLVER.MOMENTUM``, ``NESTEROV``, ``WEIGHT_DECAY``, with
``maybe_add_gradient_clipping``). detectron2's LR schedulers scale each group's initial learning rate,
so the gate factor holds over the whole schedule.
"""

from __future__ import annotations

import torch
from detectron2.config import CfgNode
from detectron2.solver import get_default_optimizer_params
from detectron2.solver.build import maybe_add_gradient_clipping
from torch import nn

from ..layers import NORM_CLASSES, gate_parameter_names
from ..layers.options import NON_NEGATIVE, check_options

_GATE_RULES = {"gate_lr_factor": NON_NEGATIVE, "gate_weight_decay": NON_NEGATIVE}


def get_optimizer_params(
    model: nn.Module,
    base_lr: float,
    weight_decay_norm: float | None = None,
    bias_lr_factor: float = 1.0,
    weight_decay_bias: float | None = None,
    gate_lr_factor: float = 1.0,
    gate_weight_decay: float = 0.0,
) -> list[dict]:
    """Parameter groups: detectron2's defaults, then our norms' rules (see the module docstring)."""
    # the yaml path checks SOLVER.GATE_*; a LazyConfig passes these straight here
    check_options(get_optimizer_params, _GATE_RULES, gate_lr_factor=gate_lr_factor, gate_weight_decay=gate_weight_decay)
    groups = get_default_optimizer_params(
        model,
        base_lr=base_lr,
        weight_decay_norm=weight_decay_norm,
        bias_lr_factor=bias_lr_factor,
        weight_decay_bias=weight_decay_bias,
    )
    hyperparams = {}
    for group in groups:
        values = {key: value for key, value in group.items() if key != "params"}
        hyperparams.update((param, dict(values)) for param in group["params"])
    gate_rule = {"lr": base_lr * gate_lr_factor, "weight_decay": gate_weight_decay}
    norm_rule = {} if weight_decay_norm is None else {"weight_decay": weight_decay_norm}
    for param, is_gate, is_bias in _norm_parameters(model):
        if is_gate:
            hyperparams[param].update(gate_rule)
        elif not (is_bias and weight_decay_bias is not None):
            hyperparams[param].update(norm_rule)
    return _grouped(hyperparams)


def build_optimizer(cfg: CfgNode, model: nn.Module) -> torch.optim.Optimizer:
    """detectron2's ``build_optimizer`` with the parameter rules of ``get_optimizer_params``."""
    params = get_optimizer_params(
        model,
        base_lr=cfg.SOLVER.BASE_LR,
        weight_decay_norm=cfg.SOLVER.WEIGHT_DECAY_NORM,
        bias_lr_factor=cfg.SOLVER.BIAS_LR_FACTOR,
        weight_decay_bias=cfg.SOLVER.WEIGHT_DECAY_BIAS,
        gate_lr_factor=cfg.SOLVER.GATE_LR_FACTOR,
        gate_weight_decay=cfg.SOLVER.GATE_WEIGHT_DECAY,
    )
    optimizer = torch.optim.SGD(
        params,
        lr=cfg.SOLVER.BASE_LR,
        momentum=cfg.SOLVER.MOMENTUM,
        nesterov=cfg.SOLVER.NESTEROV,
        weight_decay=cfg.SOLVER.WEIGHT_DECAY,
        foreach=True,
    )
    return maybe_add_gradient_clipping(cfg, optimizer)


def _norm_parameters(model: nn.Module):
    """(parameter, is a gate, is the bias) of each trainable parameter of our norms."""
    for module in model.modules():
        if not isinstance(module, NORM_CLASSES):
            continue
        gates = gate_parameter_names(module)
        for name, param in module.named_parameters():
            if param.requires_grad:
                yield param, name in gates, name == "bias"


def _grouped(hyperparams: dict) -> list[dict]:
    """One parameter group per distinct set of hyperparameters, in the order of first appearance."""
    groups: dict[tuple, list] = {}
    for param, values in hyperparams.items():
        groups.setdefault(tuple(sorted(values.items())), []).append(param)
    return [{"params": params, **dict(key)} for key, params in groups.items()]
