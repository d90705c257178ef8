"""The fused path of the moment-based normalizers: a layer's (N, C) statistics and their gradients in closed
form, between the four full-size passes.

``statistics.normalize_by_moments`` runs a layer's (N, C) statistics (LN and BN moments, mixtures, running
statistics) as separate tensor operations and differentiates them with autograd: many small operations per
forward and backward, each a kernel launch on a GPU, which costs host time whatever it computes. Here a
layer with closed forms (``FusedPlan``) runs as

    forward:   moments_and_residual(x) -> [mean, var, residual] -> one step: [scale, shift] (and the
               running statistics) -> scale_shift(x)
    backward:  centered_dot_and_sum(grad_y, x) -> [D, S] -> one step: [p, q] and every parameter's
               gradient -> grad_input(grad_y, x) at the exact mean, mean + residual (``passes``)

where D = sum_HW grad_y (x - mean) and S = sum_HW grad_y per (n, c), each [...] one block of (N, C) rows (one
allocation on the kernel path, ``triton_kernels.MapPasses``), and the closed forms are the
derivatives of the layer's small (N, C) graph, written out by hand for each layer (its kernel module,
``switchable_kernels``, ``dynamic_kernels``, ``mode_kernels``, says how). On the kernel path
(``passes.kernel_path``) the passes and the two steps are Triton kernels, six launches in all; SN also has
its closed forms as tensor operations, which run everywhere else. The autograd path
(``statistics._NormalizeByMoments`` differentiating the layer's ``scale_and_shift``) computes the same and
stays as the tests' oracle and as the path wherever no closed form applies:

- a layer without closed forms for the input (DN, MN, MGN off the kernel path; MN, MGN beyond their
  largest mode count);
- a running batch average (its sums pool in float64 on the host side of the layer);
- SyncSN across several processes off the kernel path;
- a differentiable backward (``create_graph``): it replays the plain computation, as the autograd path does.

Nothing on the kernel path reads a value on the host: a training step can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import Tensor

from .running import replaying


class FusedPlan(Protocol):
    """A layer's fused (N, C) kernels for inputs of one signature: made by the layer's ``fused_plan(x)``,
    which decides the path once, and kept for the calls that follow (``base.NormBase.call_plan``). It
    holds no tensor: the layer and its ``parameters`` (``parameter_tuple()``, in that order) come with
    each call. ``passes`` are the full-size passes over such inputs on that path
    (``triton_kernels.MapPasses`` with Triton kernels, ``passes.TorchPasses`` with closed forms as tensor
    operations), for the forward and the backward alike; the (N, C) statistics travel between them in
    blocks of rows (``MapPasses``): moments (mean, variance, residual), affine (scale, shift), sums (D, S),
    pq (p, q)."""

    passes: object

    def forward(self, layer, parameters: Sequence[Tensor], moments) -> tuple[object, object]:
        """The affine block of the output (x - mean) * scale + shift from the moments block, and what
        ``backward`` needs besides the two; records the running statistics in training."""

    def backward(self, layer, parameters: Sequence[Tensor], moments, affine, saved, sums) -> tuple[object, list]:
        """From the sums block: the pq block, grad_x = grad_y * scale + (x - mean - residual) * p + q, and
        the gradients of the layer's ``parameters``, in their order."""


def written_in_place(*tensors: Tensor) -> None:
    """Tell autograd that a kernel wrote ``tensors`` (running statistics) in place, as an in-place ATen
    operation would: a tensor saved for a backward and changed since then is then refused, not misused."""
    torch.autograd.graph.increment_version(tensors)


def any_requires_grad(parameters: Sequence[Tensor]) -> bool:
    """Whether any of ``parameters`` requires a gradient (a layer none of whose parameters does is frozen)."""
    for parameter in parameters:
        if parameter.requires_grad:
            return True
    return False


def normalize(layer, plan: FusedPlan, x: Tensor, parameters: Sequence[Tensor], trainable: bool) -> Tensor:
    """The layer's output through its fused kernels: one autograd node when anything needs a gradient
    (``trainable``: some parameter requires one). A backward under create_graph replays the layer's plain
    differentiable computation, ``layer.replayed_forward(x)``."""
    grad_enabled = torch.is_grad_enabled()
    if grad_enabled and (trainable or x.requires_grad):
        return _FusedNormalize.apply(x, layer, plan, *parameters)
    if grad_enabled:  # nothing to differentiate (a frozen layer): the passes' no-grad forms
        with torch.no_grad():
            return _forward(layer, plan, x, parameters)
    return _forward(layer, plan, x, parameters)


def _forward(layer, plan: FusedPlan, x: Tensor, parameters: Sequence[Tensor]) -> Tensor:
    over = plan.passes
    moments = over.moments(x)
    affine, _ = plan.forward(layer, parameters, moments)
    return over.scale_shift(x, affine, moments)


class _FusedNormalize(torch.autograd.Function):
    """Saved for the backward: x and the parameters (``save_for_backward``: autograd checks that they are
    unchanged), and the node's own blocks, which nothing else sees, as attributes."""

    @staticmethod
    def forward(ctx, x: Tensor, layer, plan: FusedPlan, *parameters: Tensor):
        over = plan.passes
        moments = over.moments_and_residual(x)
        affine, saved = plan.forward(layer, parameters, moments)
        ctx.save_for_backward(x, *parameters)
        ctx.layer, ctx.plan, ctx.blocks = layer, plan, (moments, affine, saved)
        return over.scale_shift(x, affine, moments)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, *parameters = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: differentiable gradients, from the plain computation
            grad_x, grad_parameters = replayed_gradients(ctx.layer.replayed_forward, x, parameters, grad_y, needs[0], needs[3:])
            return (grad_x, None, None, *grad_parameters)
        moments, affine, saved = ctx.blocks
        plan = ctx.plan
        over = plan.passes
        sums = over.centered_dot_and_sum(grad_y, x, moments)
        pq, grad_parameters = plan.backward(ctx.layer, parameters, moments, affine, saved, sums)
        grad_x = over.grad_input(grad_y, x, affine, pq, moments, True) if needs[0] else None
        if not all(needs[3:]):
            grad_parameters = [g if needed else None for g, needed in zip(grad_parameters, needs[3:])]
        return (grad_x, None, None, *grad_parameters)


def replayed_gradients(replay, x: Tensor, parameters: Sequence[Tensor], grad_y: Tensor, needs_x: bool, needs_parameters):
    """The gradients of ``replay(x)`` (a layer's plain differentiable forward, run again without recording
    its statistics twice: ``running.replaying``) with respect to x and the ``parameters`` flagged in
    ``needs_parameters``, as differentiable functions of them and of grad_y: what a backward under
    create_graph returns. (grad_x or None, [grad or None per parameter])."""
    with torch.enable_grad(), replaying():
        y = replay(x)
    wanted = [t for t, needed in zip((x, *parameters), (needs_x, *needs_parameters)) if needed]
    grads = iter(torch.autograd.grad(y, wanted, grad_y, create_graph=True, allow_unused=True))
    grad_x = next(grads) if needs_x else None
    return grad_x, [next(grads) if needed else None for needed in needs_parameters]
