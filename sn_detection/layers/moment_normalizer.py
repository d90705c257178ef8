"""The forward of the layers whose statistics derive from the instance-norm moments (SN, SyncSN, DN, MN, MGN):
``MomentNormalizer`` and its two paths, the fused one (``FusedPlan``) and the autograd one
(``normalize_by_moments``), with the pieces the other layers share (``check_input``, ``instance_moments``,
``scale_shift``, ``replayed_gradients``, ``written_in_place``).

Per-(n, c) statistics: computed once, derived into LN / BN statistics, applied as one scale and shift.
Switchable Normalization (Luo et al., Eq. 5) observes that every statistic it mixes can be derived from
the instance-norm moments of each (sample, channel) over H*W:

    mu_ln  = mean_c mu_in,  var_ln = mean_c (var_in + mu_in^2) - mu_ln^2
    mu_bn  = mean_n mu_in,  var_bn = mean_n (var_in + mu_in^2) - mu_bn^2

so the (N, C, H, W) tensor is only read for the moments and once more for the elementwise output, with a
per-(n, c) ``scale`` and ``shift`` folding the normalization and the affine; everything in between works
on (N, C) summaries. The same holds for DN, MN and MGN. The full-size passes themselves, in PyTorch and
as Triton kernels, are ``map_passes``.

Numerics: fp32 as accurate as torch's BatchNorm whatever a channel's mean-to-spread ratio.

- IN moments: accurate whatever the ratio (``map_passes``).
- Derived statistics never subtract large second moments: the LN variance is Eq. 5 written as the law
  of total variance, pooled BN statistics are float64 sums (``running.MomentSums``).
- The output is centred at the IN mean: y = (x - mu_in) * scale + shift, where ``shift`` is computed
  relative to mu_in (``affine_from_moments`` takes the offset of the normalizing mean from mu_in). The
  folded y = x * scale + shift' would round x * scale, of size |mean| / spread, and lose as many digits.
  BatchNorm's evaluation kernel computes exactly (x - mean) * scale + shift, so the centring is free.

Choices the paper leaves open:

- Variances are *biased* (divide by H*W): the unbiased estimate is NaN for 1x1 maps (a bug of the
  original code).
- Statistics are computed in at least float32 whatever the input dtype (fp16 / bf16 inputs are upcast;
  the output has the input's dtype).

The path of a call is the layer's plan for inputs like x (``base.NormBase.call_plan``): its ``fused_plan``,
or None for the autograd path.

The fused path. A layer with closed forms for x (``FusedPlan``, made by its kernel module:
``switchable_kernels``, ``dynamic_kernels``, ``mode_kernels``) runs its (N, C) statistics and their
gradients in closed form, between the four full-size passes (``fused_normalize``):

    forward:   moments_and_residual(x) -> [mean, var, residual] -> one step: [scale, shift] (and the
               running statistics) -> scale_shift(x)
    backward:  centered_dot_and_sum(grad_y, x) -> [D, S] -> one step: [p, q] and every parameter's
               gradient -> grad_input(grad_y, x) at the exact mean, mean + residual

where D = sum_HW grad_y (x - mean) and S = sum_HW grad_y per (n, c), each [...] one block of (N, C) rows
(one allocation on the kernel path: ``map_passes``), and the closed forms are the derivatives of the
layer's small (N, C) graph, written out by hand for each layer (its kernel module says how). On the kernel
path (``map_passes.kernel_path``) the passes and the two steps are Triton kernels, six launches in all; SN
also has its closed forms as tensor operations, which run everywhere else. Nothing on the kernel path
reads a value on the host: a training step can be captured in a CUDA graph.

The autograd path (``normalize_by_moments``) runs a layer's (N, C) statistics (LN and BN moments,
mixtures, running statistics) as separate tensor operations on the IN moments, differentiated by autograd
through the layer's ``scale_and_shift``: many small operations per forward and backward, each a kernel
launch on a GPU, which costs host time whatever it computes. It computes what the fused path computes and
runs wherever no closed form applies:

- a layer without closed forms for the input (DN, MN, MGN off the kernel path; MN, MGN beyond their
  largest mode count);
- a running batch average (its sums pool in float64 on the host side of the layer);
- SyncSN across several processes off the kernel path.

It is one autograd node that reads the activation for the moments, differentiates the small (N, C) graph
of ``affine`` with autograd, and writes grad_x once from the closed form of the paper's appendix (Eq. 9),
where autograd's generic formulas would allocate several extra full-size temporaries
(``_NormalizeByMoments``). ``reference_normalize_by_moments`` is the same computation in plain autograd,
the oracle of the tests.

Double backward (a gradient penalty: ``create_graph=True``) is exact on both paths: the closed-form
backward passes are written for first derivatives, so with ``create_graph`` they compute the gradients
again with plain differentiable operations, replaying the plain forward with the running statistics left
alone (``replayed_gradients``, ``running.replaying``).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Optional, Protocol

import torch
from torch import Tensor

from .base import NormBase
from .map_passes import (
    TorchPasses,
    as_dtype,
    centred_moments,
    exporting,
    kernel_path,
    passes_for,
    plain_mean,
    plain_moments,
    plain_scale_shift,
    stat_dtype,
)
from .running import replaying


class _InstanceMoments(torch.autograd.Function):
    """mean and biased variance of x over H*W, shapes (N, C), by the moments pass (``map_passes``); closed-form
    backward."""

    @staticmethod
    def forward(ctx, x: Tensor):
        mean, var = passes_for(x).moments(x)
        ctx.save_for_backward(x, mean)
        return mean, var

    @staticmethod
    def backward(ctx, grad_mean: Tensor, grad_var: Tensor):
        x, mean = ctx.saved_tensors
        count = max(x.shape[2] * x.shape[3], 1)
        # d mean / dx = 1 / HW and d var / dx = 2 (x - mean) / HW: grad = (x - mean) * p + q
        over = passes_for(x)
        return over.scale_shift(x, over.block_of(2 * grad_var / count, grad_mean / count), over.block_of(mean))


def instance_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """IN statistics of an (N, C, H, W) tensor: mean and biased variance over H*W, each (N, C)."""
    if torch.jit.is_scripting() or exporting():
        return plain_moments(x)
    return _InstanceMoments.apply(x)


def per_channel(vector: Tensor, like: Tensor) -> Tensor:
    """A per-channel (C,) vector in the dtype of ``like`` and shaped to broadcast against it: per-(n, c)
    statistics (N, C) as it is, (N, C, 1, 1) statistics or (N, C, H, W) maps as (C, 1, 1)."""
    vector = as_dtype(vector, like.dtype)
    return vector if like.dim() == 2 else vector.view(-1, 1, 1)


class _ScaleShift(torch.autograd.Function):
    """y = (x - center) * scale + shift with per-(n, c) scale, shift and center, computed in scale's dtype
    and returned in x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, shift: Tensor, center: Tensor):
        ctx.save_for_backward(x, scale, center)
        over = passes_for(x)
        return over.scale_shift(x, over.block_of(scale, shift), over.block_of(center))

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, scale, center = ctx.saved_tensors
        grad_x = (grad_y * scale[:, :, None, None]).to(x.dtype) if ctx.needs_input_grad[0] else None
        over = passes_for(x)
        dot, total = over.centered_dot_and_sum(grad_y, x, over.block_of(center))
        return grad_x, dot, total, -scale * total


def scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """(x - center) * scale + shift for an (N, C, H, W) x and (N, C) scale, shift and center, in one pass."""
    if torch.jit.is_scripting() or exporting():
        return plain_scale_shift(x, scale, shift, center)
    return _ScaleShift.apply(x, scale, shift, center)


def affine_from_moments(weight: Tensor, bias: Tensor, offset: Tensor, var_eps: Tensor) -> tuple[Tensor, Tensor]:
    """The scale and shift of weight * (x - mean) / sqrt(var + eps) + bias in the centred form
    (x - mu_in) * scale + shift, given ``offset`` = mean - mu_in, the normalizing mean's offset from the
    IN mean (computed by the caller as a difference of nearby values, so that it keeps its digits), and
    ``var_eps`` = var + eps; weight and bias per channel (``per_channel``)."""
    scale = weight / torch.sqrt(var_eps)
    return scale, bias - offset * scale


# (mean_in, var_in), each (N, C) -> (scale, shift), each broadcastable to (N, C), for the output
# (x - mean_in) * scale + shift: what a normalizer does with IN statistics
AffineFromMoments = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def normalize_by_moments(
    x: Tensor, affine: AffineFromMoments, parameters: Sequence[Tensor], variance: bool = True
) -> Tensor:
    """y = (x - mean_in) * scale + shift with (scale, shift) = affine(IN mean, IN variance of x), for any
    normalizer whose statistics derive from the IN statistics (SN, DN, MN, MGN, GN, ...).

    ``parameters`` are all the tensors ``affine`` differentiates with respect to (the module's
    parameters): they receive their gradients through this call. In training this is one autograd node
    that saves only x and the (N, C) intermediate graph; without gradients it is plain tensor code, and
    with ``variance`` False (an ``affine`` that reads no variance: MN in evaluation) on the PyTorch path
    it reads x once for the means alone, and the variance it passes is 0. ``reference_normalize_by_moments``
    is the same computation in straightforward autograd.
    """
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in parameters)):
        return _NormalizeByMoments.apply(x, affine, *parameters)
    with torch.no_grad():
        over = passes_for(x)
        if variance or over is not TorchPasses:
            mean_in, var_in = over.moments(x)
        else:
            mean_in = plain_mean(x)
            var_in = torch.zeros_like(mean_in)
        scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
        return over.scale_shift(x, over.block_of(scale, shift), over.block_of(mean_in))


def check_input(x: Tensor, num_channels: int) -> None:
    """Every layer takes floating-point (N, C, H, W) input with its C channels."""
    if x.dim() != 4 or x.shape[1] != num_channels:
        raise ValueError(f"expected input of shape (N, {num_channels}, H, W), got {list(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"expected floating-point input, got {x.dtype}")


class MomentNormalizer(NormBase):
    """A norm layer whose output is ``normalize_by_moments`` with its own
    ``scale_and_shift(mean_in, var_in, spatial_size) -> (scale, shift)`` (centred at mean_in), through its
    fused kernels where it has them (``fused_plan``); a frozen one normalizes as in evaluation (``base``).
    The path of a call is its plan (``base.NormBase.call_plan``): the fused kernels' plan, or None for the
    autograd path."""

    # whether the layer's evaluation reads the IN variance (MN's does not: its statistics are the running ones,
    # and its gates read the means)
    variance_in_evaluation = True

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # plain operations, see plain_moments
            check_input(x, self.num_channels)
            spatial_size = x.shape[2] * x.shape[3]
            mean, var = plain_moments(x)
            return plain_scale_shift(x, *self.scale_and_shift(mean, var, spatial_size), mean)
        return self._normalize(x)

    @torch.jit.unused
    def _normalize(self, x: Tensor) -> Tensor:
        parameters = self.parameter_tuple()
        trainable = any_requires_grad(parameters)
        if self.training and not trainable:  # frozen (``base``)
            self.train(False)
        if exporting():
            return self.exported_forward(x)
        plan = self.call_plan(x)
        if plan is not None:
            return fused_normalize(self, plan, x, parameters, trainable)
        return normalize_by_moments(x, self._affine(x), parameters, self.training or self.variance_in_evaluation)

    @torch.jit.unused
    def make_call_plan(self, x: Tensor) -> Optional["FusedPlan"]:
        check_input(x, self.num_channels)
        if x.numel() == 0 or not (self.training or kernel_path(x)):
            # evaluation off the kernel path: ``normalize_by_moments``, whose no-grad form is the fast moments,
            # the layer's own ``scale_and_shift`` and one affine pass
            return None
        return self.fused_plan(x)

    @torch.jit.unused
    def exported_forward(self, x: Tensor) -> Tensor:
        """The layer as exporters record it (``map_passes.exporting``): in evaluation, ``centred_moments`` and
        the layer's ``scale_and_shift`` on (N, C, 1, 1) statistics, then (x - mean) * scale + shift, all plain
        operations; in training, the plain differentiable forward TorchScript runs."""
        check_input(x, self.num_channels)
        spatial_size = x.shape[2] * x.shape[3]
        if self.training:
            mean, var = plain_moments(x)
            return plain_scale_shift(x, *self.scale_and_shift(mean, var, spatial_size), mean)
        mean, centred, var = centred_moments(x)
        scale, shift = self.scale_and_shift(mean, var, spatial_size)
        return as_dtype(centred * scale + shift, x.dtype)

    @torch.jit.unused
    def fused_plan(self, x: Tensor) -> Optional["FusedPlan"]:
        """The layer's closed forms for inputs like the non-empty ``x`` (``FusedPlan``): its Triton kernels where
        x is on the kernel path (``map_passes.kernel_path``), its tensor-operation closed forms elsewhere if it
        has them; None where neither applies, and the autograd path runs."""
        return None

    @torch.jit.unused
    def replayed_forward(self, x: Tensor) -> Tensor:
        """The layer's output on x in plain differentiable operations (``reference_normalize_by_moments``):
        what a backward under create_graph differentiates."""
        return reference_normalize_by_moments(x, self._affine(x))

    @torch.jit.unused
    def _affine(self, x: Tensor) -> AffineFromMoments:
        return functools.partial(self.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])


def reference_normalize_by_moments(x: Tensor, affine: AffineFromMoments) -> Tensor:
    """``normalize_by_moments`` by separate reductions and autograd through every op: the readable path
    the fast one is tested against."""
    xs = x.to(stat_dtype(x))
    mean_in = xs.mean((2, 3))
    # two passes rather than var_mean, which warns of 0 degrees of freedom on an empty batch
    var_in = (xs - mean_in[:, :, None, None]).square().mean((2, 3))
    scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
    return ((xs - mean_in[:, :, None, None]) * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype)


def _affine_in_stat_dtype(affine: AffineFromMoments, mean_in: Tensor, var_in: Tensor) -> tuple[Tensor, Tensor]:
    # statistics stay in float32 (or float64) even under autocast, whose matmuls would run in fp16/bf16
    with torch.autocast(mean_in.device.type, enabled=False):
        scale, shift = affine(mean_in, var_in)
    return scale.expand_as(mean_in), shift.expand_as(mean_in)


class _NormalizeByMoments(torch.autograd.Function):
    """The training path of ``normalize_by_moments``.

    Autograd through the separate steps would write three full-size gradients of x (through the
    output, the mean and the variance) and add them up. Here the backward reads grad_y and x once for
    the (N, C) sums D = sum(grad_y * (x - mu_in)) and S = sum(grad_y), differentiates the small (N, C)
    graph of ``affine`` with them (plus the centring's own -scale * S towards mu_in), and writes grad_x
    once, from the closed form

        grad_x = grad_y * scale + (x - mu_in) * p + q,   p = 2 g_var / HW,   q = g_mean / HW

    (g_mean, g_var: gradients of the loss with respect to the IN statistics; the paper's appendix), with
    mu_in the exact mean, the rounded one plus its residual (``map_passes``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, affine: AffineFromMoments, *parameters: Tensor):
        over = passes_for(x)
        mean_in, var_in, residual = over.moments_and_residual(x)
        with torch.enable_grad():
            mean_in.requires_grad_(ctx.needs_input_grad[0])
            var_in.requires_grad_(ctx.needs_input_grad[0])
            scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
        ctx.save_for_backward(x, residual, *parameters)
        ctx.affine, ctx.passes = affine, over
        ctx.graph = (mean_in, var_in, scale, shift)
        return over.scale_shift(x, over.block_of(scale.detach(), shift.detach()), over.block_of(mean_in.detach()))

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, residual, *parameters = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable gradients, from the plain computation
            replay = functools.partial(reference_normalize_by_moments, affine=ctx.affine)
            grad_x, grad_parameters = replayed_gradients(
                replay, x, parameters, grad_y, ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
            )
            return (grad_x, None, *grad_parameters)
        mean_in, var_in, scale, shift = ctx.graph
        center, over = mean_in.detach(), ctx.passes
        dot, total = over.centered_dot_and_sum(grad_y, x, over.block_of(center))
        inputs = [t for t in (mean_in, var_in, *parameters) if t.requires_grad]
        # the small graph is kept (it is tiny) so that a backward with retain_graph=True can run again
        grads = iter(torch.autograd.grad((scale, shift), inputs, (dot, total), retain_graph=True, allow_unused=True))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_mean, grad_var = next(grads), next(grads)
            grad_mean = (torch.zeros_like(center) if grad_mean is None else grad_mean) - scale.detach() * total
            grad_var = torch.zeros_like(center) if grad_var is None else grad_var
            count = max(x.shape[2] * x.shape[3], 1)
            p, q = 2 * grad_var / count, grad_mean / count
            moments = over.block_of(center, center, residual)  # the grad_input pass reads rows 0 and 2
            grad_x = over.grad_input(grad_y, x, over.block_of(scale.detach()), over.block_of(p, q), moments, True)
        grad_parameters = [next(grads) if p.requires_grad else None for p in parameters]
        return (grad_x, None, *grad_parameters)


# The fused path ---------------------------------------------------------------------------------------


class FusedPlan(Protocol):
    """A layer's fused (N, C) kernels for inputs of one signature: made by the layer's ``fused_plan(x)``,
    which decides the path once, and kept for the calls that follow (``base.NormBase.call_plan``). It
    holds no tensor: the layer and its ``parameters`` (``parameter_tuple()``, in that order) come with
    each call. ``passes`` are the full-size passes over such inputs on that path
    (``map_passes.TritonPasses`` with Triton kernels, ``map_passes.TorchPasses`` with closed forms as tensor
    operations), for the forward and the backward alike; the (N, C) statistics travel between them in
    blocks of rows (``map_passes``): moments (mean, variance, residual), affine (scale, shift), sums (D, S),
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


def fused_normalize(layer, plan: FusedPlan, x: Tensor, parameters: Sequence[Tensor], trainable: bool) -> Tensor:
    """The layer's output through its fused kernels: one autograd node when anything needs a gradient
    (``trainable``: some parameter requires one). A backward under create_graph replays the layer's plain
    differentiable computation, ``layer.replayed_forward(x)``."""
    grad_enabled = torch.is_grad_enabled()
    if grad_enabled and (trainable or x.requires_grad):
        return _FusedNormalize.apply(x, layer, plan, *parameters)
    if grad_enabled:  # nothing to differentiate (a frozen layer): the passes' no-grad forms
        with torch.no_grad():
            return _fused_forward(layer, plan, x, parameters)
    return _fused_forward(layer, plan, x, parameters)


def _fused_forward(layer, plan: FusedPlan, x: Tensor, parameters: Sequence[Tensor]) -> Tensor:
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
            grad_x, grad_parameters = replayed_gradients(
                ctx.layer.replayed_forward, x, parameters, grad_y, needs[0], needs[3:]
            )
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


def replayed_gradients(
    replay, x: Tensor, parameters: Sequence[Tensor], grad_y: Tensor, needs_x: bool, needs_parameters
):
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
