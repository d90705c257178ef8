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
  detection code gives SN's logits no weight decay, the default here);
- SSN's logits get ``gate_weight_decay`` too, but their own learning rate ``base_lr * ssn_gate_lr_factor``
  (``SOLVER.SSN_GATE_LR_FACTOR``) and, when ``ssn_gate_clip_norm`` (``SOLVER.SSN_GATE_CLIP_NORM``) is > 0,
  gradients clipped to that total norm over all of them before each step: by default the SSN authors'
  rules, a tenth of the learning rate, no weight decay, clipping at 1 (their ImageNet trainer). Their group
  carries the norm as ``clip_norm``, which ``GateClippingSGD`` (and ``clip_gate_gradients`` for other
  steppers) applies.

Every other parameter keeps detectron2's rules, and frozen parameters (``requires_grad=False``) stay out.
``get_optimizer_params`` takes the rules as plain arguments, like detectron2's own function, so that a
LazyConfig sets them (``configs/lazy``, with ``GateClippingSGD`` as its optimizer); ``build_optimizer(cfg,
model)`` reads them from a yaml config and builds ``GateClippingSGD`` (``SOLVER.MOMENTUM``, ``NESTEROV``,
``WEIGHT_DECAY``, with detectron2's ``maybe_add_gradient_clipping``, which clips every parameter).
detectron2's LR schedulers scale each group's initial learning rate, so the gate factors hold over the
whole schedule.
"""

from __future__ import annotations

import torch
from detectron2.config import CfgNode
from detectron2.solver import get_default_optimizer_params
from detectron2.solver.build import maybe_add_gradient_clipping
from torch import nn

from ..layers import NORM_CLASSES, SparseSwitchableNorm2d, gate_parameter_names
from ..layers.options import NON_NEGATIVE, check_options

_GATE_RULES = {
    "gate_lr_factor": NON_NEGATIVE,
    "gate_weight_decay": NON_NEGATIVE,
    "ssn_gate_lr_factor": NON_NEGATIVE,
    "ssn_gate_clip_norm": NON_NEGATIVE,
}
_CLIP_EPS = 1e-6  # added to the total norm, as torch.nn.utils.clip_grad_norm_


def get_optimizer_params(
    model: nn.Module,
    base_lr: float,
    weight_decay_norm: float | None = None,
    bias_lr_factor: float = 1.0,
    weight_decay_bias: float | None = None,
    gate_lr_factor: float = 1.0,
    gate_weight_decay: float = 0.0,
    ssn_gate_lr_factor: float = 0.1,
    ssn_gate_clip_norm: float = 1.0,
) -> list[dict]:
    """Parameter groups: detectron2's defaults, then our norms' rules (see the module docstring)."""
    # the yaml path checks SOLVER.GATE_* and SOLVER.SSN_GATE_*; a LazyConfig passes these straight here
    check_options(
        get_optimizer_params,
        _GATE_RULES,
        gate_lr_factor=gate_lr_factor,
        gate_weight_decay=gate_weight_decay,
        ssn_gate_lr_factor=ssn_gate_lr_factor,
        ssn_gate_clip_norm=ssn_gate_clip_norm,
    )
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
    sparse_gate_rule = {"lr": base_lr * ssn_gate_lr_factor, "weight_decay": gate_weight_decay}
    if ssn_gate_clip_norm > 0:
        sparse_gate_rule["clip_norm"] = ssn_gate_clip_norm
    norm_rule = {} if weight_decay_norm is None else {"weight_decay": weight_decay_norm}
    for param, is_gate, is_sparse, is_bias in _norm_parameters(model):
        if is_gate:
            hyperparams[param].update(sparse_gate_rule if is_sparse else gate_rule)
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
        ssn_gate_lr_factor=cfg.SOLVER.SSN_GATE_LR_FACTOR,
        ssn_gate_clip_norm=cfg.SOLVER.SSN_GATE_CLIP_NORM,
    )
    optimizer = GateClippingSGD(
        params,
        lr=cfg.SOLVER.BASE_LR,
        momentum=cfg.SOLVER.MOMENTUM,
        nesterov=cfg.SOLVER.NESTEROV,
        weight_decay=cfg.SOLVER.WEIGHT_DECAY,
        foreach=True,
    )
    return maybe_add_gradient_clipping(cfg, optimizer)


def _norm_parameters(model: nn.Module):
    """(parameter, is a gate, is an SSN layer's gate, is the bias) of each trainable parameter of our norms."""
    for module in model.modules():
        if not isinstance(module, NORM_CLASSES):
            continue
        gates = gate_parameter_names(module)
        sparse = isinstance(module, SparseSwitchableNorm2d)
        for name, param in module.named_parameters():
            if param.requires_grad:
                yield param, name in gates, sparse and name in gates, name == "bias"


def clip_gate_gradients(optimizer: torch.optim.Optimizer, scale: torch.Tensor | None = None) -> None:
    """Scale the gradients of each parameter group with a ``clip_norm`` so that their total norm is at most that,
    as ``torch.nn.utils.clip_grad_norm_`` (on the device: nothing is read on the host). ``scale``: the factor
    the gradients are multiplied by (a GradScaler's scale, a tensor), so that the clip applies to their
    unscaled values."""
    for group in optimizer.param_groups:
        limit = group.get("clip_norm", 0)
        grads = [p.grad for p in group["params"] if p.grad is not None]
        if not limit or not grads:
            continue
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())
        bound = limit if scale is None else limit * scale
        factor = torch.clamp(bound / (total + _CLIP_EPS * (1 if scale is None else scale)), max=1.0)
        torch._foreach_mul_(grads, factor)


class GateClippingSGD(torch.optim.SGD):
    """torch's SGD whose step first clips the groups that carry a ``clip_norm`` (``clip_gate_gradients``): SSN's
    logits by default. A GradScaler unscales the gradients before this step, as for any SGD."""

    def step(self, closure=None):
        clip_gate_gradients(self)
        return super().step(closure)


def _grouped(hyperparams: dict) -> list[dict]:
    """One parameter group per distinct set of hyperparameters, in the order of first appearance."""
    groups: dict[tuple, list] = {}
    for param, values in hyperparams.items():
        groups.setdefault(tuple(sorted(values.items())), []).append(param)
    return [{"params": params, **dict(key)} for key, params in groups.items()]
