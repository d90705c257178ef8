"""The fused path of every layer with kernels: one autograd node around the layer's plan.

A layer's forward (``base.NormBase.forward``) takes its call plan for the input (``base.NormBase.call_plan``):
None for its PyTorch path, or a ``FusedPlan``, its kernels for inputs of that signature, made by its kernel
module (``switchable_kernels``, ``dynamic_kernels``, ``mode_kernels``, ``skewness_kernels``,
``positional_kernels``). ``fused_normalize`` runs the plan:

    forward:   y, saved = plan.forward(layer, x, parameters, save)
    backward:  grad_x, grads = plan.backward(layer, grad_y, x, parameters, saved, needs_x, needs_parameters)

as one autograd node (``_Fused``) when anything needs a gradient, or the plan's forward alone without one
(``save`` False: nothing kept for a backward). The plan's methods hold the whole direction, its kernels and
the host code that launches them (through ``kernels``), so that a training step reads as: the layer's forward
(``base``), this node, the layer's kernel module, the shared kernel library (``kernels``), each entered once
per direction (``tools/code_path.py``).

Double backward (a gradient penalty: ``create_graph=True``) is exact: the plans' backward kernels are written
for first derivatives, so with ``create_graph`` the node computes the gradients again with plain
differentiable operations, replaying the layer's plain forward (``replayed_forward``) with the running
statistics left alone (``replayed_gradients``, ``replaying``). The autograd path of the moment-based layers
(``moment_normalizer``) replays so too.
"""

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor


class FusedPlan(Protocol):
    """A layer's kernels for inputs of one signature: made by the layer's ``make_call_plan(x)``, which decides
    the path once, and kept for the calls that follow (``base.NormBase.call_plan``). It holds no tensor: the
    layer and its ``parameters`` (``parameter_tuple()``, in that order) come with each call."""

    def forward(self, layer, x: Tensor, parameters: Sequence[Tensor], save: bool) -> tuple[Tensor, object]:
        """The layer's output on x, and with ``save`` what ``backward`` needs (else None); records the running
        statistics in training."""

    def backward(
        self, layer, grad_y: Tensor, x: Tensor, parameters: Sequence[Tensor], saved, needs_x: bool, needs_parameters
    ) -> tuple[Tensor | None, list]:
        """grad_x (None without ``needs_x``) and the gradients of the ``parameters``, in their order, as a list
        (those ``needs_parameters`` flags False may be anything: they are dropped)."""


def fused_normalize(layer, plan: FusedPlan, x: Tensor, parameters: Sequence[Tensor], trainable: bool) -> Tensor:
    """The layer's output through its plan: one autograd node when anything needs a gradient (``trainable``:
    some parameter requires one), else the plan's forward alone."""
    if torch.is_grad_enabled():
        if trainable or x.requires_grad:
            return _Fused.apply(x, layer, plan, *parameters)
        with torch.no_grad():  # nothing to differentiate (a frozen layer): the kernels' no-grad forms
            return plan.forward(layer, x, parameters, False)[0]
    return plan.forward(layer, x, parameters, False)[0]


class _Fused(torch.autograd.Function):
    """Saved for the backward: x and the parameters (``save_for_backward``: autograd checks that they are
    unchanged), and what the plan's forward kept, which nothing else sees, as an attribute."""

    @staticmethod
    def forward(ctx, x: Tensor, layer, plan: FusedPlan, *parameters: Tensor):
        y, saved = plan.forward(layer, x, parameters, True)
        ctx.save_for_backward(x, *parameters)
        ctx.layer, ctx.plan, ctx.saved = layer, plan, saved
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, *parameters = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: differentiable gradients, from the plain computation
            grad_x, grads = replayed_gradients(ctx.layer.replayed_forward, x, parameters, grad_y, needs[0], needs[3:])
            return (grad_x, None, None, *grads)
        needs_parameters = needs[3:]
        grad_x, grads = ctx.plan.backward(ctx.layer, grad_y, x, parameters, ctx.saved, needs[0], needs_parameters)
        if not all(needs_parameters):  # a loop, not a comprehension: no call after the plan's (module docstring)
            for k, needed in enumerate(needs_parameters):
                if not needed:
                    grads[k] = None
        return (grad_x, None, None, *grads)


_replay = threading.local()


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Within the block, layers record no statistics: a forward run again (to differentiate it once more
    under create_graph) must not count its batch twice."""
    previous = getattr(_replay, "active", False)
    _replay.active = True
    try:
        yield
    finally:
        _replay.active = previous


@torch.jit.unused
def is_replaying() -> bool:
    """Whether a ``replaying`` block is running on this thread."""
    return getattr(_replay, "active", False)


def replayed_gradients(
    replay, x: Tensor, parameters: Sequence[Tensor], grad_y: Tensor, needs_x: bool, needs_parameters
):
    """The gradients of ``replay(x)`` (a layer's plain differentiable forward, run again without recording
    its statistics twice: ``replaying``) with respect to x and the ``parameters`` flagged in
    ``needs_parameters``, as differentiable functions of them and of grad_y: what a backward under
    create_graph returns. (grad_x or None, [grad or None per parameter])."""
    with torch.enable_grad(), replaying():
        y = replay(x)
    wanted = [t for t, needed in zip((x, *parameters), (needs_x, *needs_parameters)) if needed]
    grads = iter(torch.autograd.grad(y, wanted, grad_y, create_graph=True, allow_unused=True))
    grad_x = next(grads) if needs_x else None
    return grad_x, [next(grads) if needed else None for needed in needs_parameters]
