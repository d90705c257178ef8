"""The fused path of the moment-based normalizers: a layer's (N, C) statistics and their gradients in closed
form, between the four full-size passes.

``statistics.normalize_by_moments`` runs a layer's (N, C) statistics (LN and BN moments, mixtures, running
statistics) as separate tensor operations and differentiates them with autograd: many small operations per
forward and backward, each a kernel launch on a GPU, which costs host time whatever it computes. Here a
layer with closed forms (``FusedStatistics``) runs as

    forward:   moments_and_residual(x) -> [mean, var] -> one step: scale, shift (and the running
               statistics) -> scale_shift(x)
    backward:  centered_dot_and_sum(grad_y, x) -> [D, S] -> one step: p, q and every parameter's
               gradient -> grad_input(grad_y, x) at the exact mean, mean + residual (``passes``)

where D = sum_HW grad_y (x - mean) and S = sum_HW grad_y per (n, c), and the closed forms are the
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

from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

from .running import replaying


class FusedStatistics(Protocol):
    """A layer's fused (N, C) kernels for one call: made by the layer's ``fused_statistics(x)``, which
    decides the call's path once. ``passes`` are the full-size passes over x on that path
    (``triton_kernels.MapPasses`` with Triton kernels, ``passes.TorchPasses`` with closed forms as tensor
    operations), for the forward and the backward alike."""

    passes: object

    def forward(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """(scale, shift) of the output (x - mean) * scale + shift from the IN moments (N, C), and the
        tensors ``backward`` needs; records the running statistics in training."""

    def backward(
        self, mean: Tensor, var: Tensor, saved: Sequence[Tensor], parameters: Sequence[Tensor], dot: Tensor,
        total: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, list[Optional[Tensor]]]:
        """From D and S: (scale, p, q, gradients of the layer's ``parameters``, in their order), with
        grad_x = grad_y * scale + (x - mean) * p + q."""


def written_in_place(*tensors: Tensor) -> None:
    """Tell autograd that a kernel wrote ``tensors`` (running statistics) in place, as an in-place ATen
    operation would: a tensor saved for a backward and changed since then is then refused, not misused."""
    torch.autograd.graph.increment_version(tensors)


def normalize(x: Tensor, kernels: FusedStatistics, parameters: Sequence[Tensor], replay) -> Tensor:
    """The layer's output through its fused kernels: one autograd node when anything needs a gradient.
    ``replay(x)`` is the layer's plain differentiable computation, for a backward with create_graph."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in parameters)):
        return _FusedNormalize.apply(x, kernels, replay, *parameters)
    with torch.no_grad():  # as in the autograd node
        over = kernels.passes
        mean, var = over.moments(x)
        scale, shift, _ = kernels.forward(mean, var)
        return over.scale_shift(x, scale, shift, mean)


class _FusedNormalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, kernels: FusedStatistics, replay, *parameters: Tensor):
        over = kernels.passes  # the passes of this call, forward and backward
        mean, var, residual = over.moments_and_residual(x)
        scale, shift, saved = kernels.forward(mean, var)
        ctx.save_for_backward(x, mean, var, residual, *saved, *parameters)
        ctx.kernels, ctx.replay, ctx.num_saved, ctx.passes = kernels, replay, len(saved), over
        return over.scale_shift(x, scale, shift, mean)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, mean, var, residual, *rest = ctx.saved_tensors
        saved, parameters = rest[: ctx.num_saved], rest[ctx.num_saved :]
        needs_x, needs_parameters = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        if torch.is_grad_enabled():  # create_graph: differentiable gradients, from the plain computation
            grad_x, grad_parameters = replayed_gradients(ctx.replay, x, parameters, grad_y, needs_x, needs_parameters)
            return (grad_x, None, None, *grad_parameters)
        dot, total = ctx.passes.centered_dot_and_sum(grad_y, x, mean)
        scale, p, q, grad_parameters = ctx.kernels.backward(mean, var, saved, parameters, dot, total)
        grad_x = ctx.passes.grad_input(grad_y, x, scale, p, q, mean, residual) if needs_x else None
        return (grad_x, None, None, *(g if needed else None for g, needed in zip(grad_parameters, needs_parameters)))


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
