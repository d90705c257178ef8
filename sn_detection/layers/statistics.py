"""Per-(n, c) statistics: computed once, derived into LN / BN statistics, applied as one scale and shift.

Switchable Normalization (Luo et al., Eq. 5) observes that every statistic it mixes can be derived from
the instance-norm moments of each (sample, channel) over H*W:

    mu_ln  = mean_c mu_in,  var_ln = mean_c (var_in + mu_in^2) - mu_ln^2
    mu_bn  = mean_n mu_in,  var_bn = mean_n (var_in + mu_in^2) - mu_bn^2

so the (N, C, H, W) tensor is only read for the moments and once more for the elementwise output, with a
per-(n, c) ``scale`` and ``shift`` folding the normalization and the affine; everything in between works
on (N, C) summaries. The same holds for DN, MN and MGN. The full-size passes themselves, in PyTorch and
as Triton kernels on GPUs, are ``passes``.

Numerics: fp32 as accurate as torch's BatchNorm whatever a channel's mean-to-spread ratio.

- IN moments: accurate whatever the ratio (``passes.moments``).
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

Speed: the layers whose (N, C) statistics have closed forms (``fused``: SN everywhere; DN, MN, MGN on the
kernel path) run them; the others, and the cases where those do not apply, run
``normalize_by_moments``: one autograd node that reads the activation for the moments, differentiates
the small (N, C) graph of ``affine`` with autograd, and writes grad_x once from the closed form of the
paper's appendix (Eq. 9), where autograd's generic formulas would allocate several extra full-size
temporaries (``_NormalizeByMoments``). ``reference_normalize_by_moments`` is the same computation in plain
autograd, the oracle of the tests.

Double backward (a gradient penalty: ``create_graph=True``) is exact: the closed-form backward passes
are written for first derivatives, so with ``create_graph`` they compute the gradients again with plain
differentiable operations (``_NormalizeByMoments`` replays the plain forward, with the running
statistics left alone: ``running.replaying``).
"""

import functools
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from . import fused, passes
from .base import NormBase
from .passes import plain_scale_shift, stat_dtype


class _InstanceMoments(torch.autograd.Function):
    """mean and biased variance of x over H*W, shapes (N, C), by ``_moments``; closed-form backward."""

    @staticmethod
    def forward(ctx, x: Tensor):
        mean, var = passes.moments(x)
        ctx.save_for_backward(x, mean)
        return mean, var

    @staticmethod
    def backward(ctx, grad_mean: Tensor, grad_var: Tensor):
        x, mean = ctx.saved_tensors
        count = max(x.shape[2] * x.shape[3], 1)
        # d mean / dx = 1 / HW and d var / dx = 2 (x - mean) / HW: grad = (x - mean) * p + q
        return passes.scale_shift(x, 2 * grad_var / count, grad_mean / count, mean)


def instance_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """IN statistics of an (N, C, H, W) tensor: mean and biased variance over H*W, each (N, C)."""
    if torch.jit.is_scripting():
        return plain_moments(x)
    return _InstanceMoments.apply(x)


def layer_moments(mean_in: Tensor, var_in: Tensor) -> tuple[Tensor, Tensor]:
    """LN statistics from IN statistics (Eq. 5, pooled over channels): each (N, 1). The variance is Eq. 5's
    mean_c(var_in + mu_in^2) - mu_ln^2 written as the law of total variance, which subtracts no large
    second moments."""
    mean = mean_in.mean(1, keepdim=True)
    return mean, var_in.mean(1, keepdim=True) + (mean_in - mean).square().mean(1, keepdim=True)


class _ScaleShift(torch.autograd.Function):
    """y = (x - center) * scale + shift with per-(n, c) scale, shift and center, computed in scale's dtype
    and returned in x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, shift: Tensor, center: Tensor):
        ctx.save_for_backward(x, scale, center)
        return passes.scale_shift(x, scale, shift, center)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, scale, center = ctx.saved_tensors
        grad_x = (grad_y * scale[:, :, None, None]).to(x.dtype) if ctx.needs_input_grad[0] else None
        dot, total = passes.centered_dot_and_sum(grad_y, x, center)
        return grad_x, dot, total, -scale * total


def scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """(x - center) * scale + shift for an (N, C, H, W) x and (N, C) scale, shift and center, in one pass."""
    if torch.jit.is_scripting():
        return plain_scale_shift(x, scale, shift, center)
    return _ScaleShift.apply(x, scale, shift, center)


def affine_from_moments(weight: Tensor, bias: Tensor, offset: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The scale and shift of weight * (x - mean) / sqrt(var + eps) + bias in the centred form
    (x - mu_in) * scale + shift, given ``offset`` = mean - mu_in: the normalizing mean's offset from the
    IN mean (computed by the caller as a difference of nearby values, so that it keeps its digits)."""
    scale = weight * torch.rsqrt(var + eps)
    return scale, bias - offset * scale


# (mean_in, var_in), each (N, C) -> (scale, shift), each broadcastable to (N, C), for the output
# (x - mean_in) * scale + shift: what a normalizer does with IN statistics
AffineFromMoments = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def normalize_by_moments(x: Tensor, affine: AffineFromMoments, parameters: Sequence[Tensor]) -> Tensor:
    """y = (x - mean_in) * scale + shift with (scale, shift) = affine(IN mean, IN variance of x), for any
    normalizer whose statistics derive from the IN statistics (SN, DN, MN, MGN, GN, ...).

    ``parameters`` are all the tensors ``affine`` differentiates with respect to (the module's
    parameters): they receive their gradients through this call. In training this is one autograd node
    that saves only x and the (N, C) intermediate graph; without gradients it is plain tensor code.
    ``reference_normalize_by_moments`` is the same computation in straightforward autograd.
    """
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in parameters)):
        return _NormalizeByMoments.apply(x, affine, *parameters)
    with torch.no_grad():
        mean_in, var_in = passes.moments(x)
        scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
        return passes.scale_shift(x, scale, shift, mean_in)


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
        trainable = fused.any_requires_grad(parameters)
        if self.training and not trainable:  # frozen (``base``)
            self.train(False)
        plan = self.call_plan(x)
        if plan is not None:
            return fused.normalize(self, plan, x, parameters, trainable)
        return normalize_by_moments(x, self._affine(x), parameters)

    @torch.jit.unused
    def make_call_plan(self, x: Tensor) -> Optional["fused.FusedPlan"]:
        check_input(x, self.num_channels)
        return self.fused_plan(x) if x.numel() > 0 else None

    @torch.jit.unused
    def fused_plan(self, x: Tensor) -> Optional["fused.FusedPlan"]:
        """The layer's closed forms for inputs like the non-empty ``x`` (``fused``): its Triton kernels where
        x is on the kernel path (``passes.kernel_path``), its tensor-operation closed forms elsewhere if it
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


def plain_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """The IN mean and biased variance (N, C) of x that ``normalize_by_moments`` uses, in plain tensor
    operations. With ``passes.plain_scale_shift`` it is what a layer computes under TorchScript, which
    compiles neither autograd Functions nor callables passed as arguments: the same values, autograd's
    gradients."""
    return passes.torch_moments(x.to(stat_dtype(x)))


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
    mu_in the exact mean, the rounded one plus its residual (``passes``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, affine: AffineFromMoments, *parameters: Tensor):
        mean_in, var_in, residual = passes.moments_and_residual(x)
        with torch.enable_grad():
            mean_in.requires_grad_(ctx.needs_input_grad[0])
            var_in.requires_grad_(ctx.needs_input_grad[0])
            scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
        ctx.save_for_backward(x, residual, *parameters)
        ctx.affine = affine
        ctx.graph = (mean_in, var_in, scale, shift)
        return passes.scale_shift(x, scale.detach(), shift.detach(), mean_in.detach())

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, residual, *parameters = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable gradients, from the plain computation
            replay = functools.partial(reference_normalize_by_moments, affine=ctx.affine)
            grad_x, grad_parameters = fused.replayed_gradients(
                replay, x, parameters, grad_y, ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
            )
            return (grad_x, None, *grad_parameters)
        mean_in, var_in, scale, shift = ctx.graph
        center = mean_in.detach()
        dot, total = passes.centered_dot_and_sum(grad_y, x, center)
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
            grad_x = passes.grad_input(grad_y, x, scale.detach(), p, q, center, residual)
        grad_parameters = [next(grads) if p.requires_grad else None for p in parameters]
        return (grad_x, None, *grad_parameters)
