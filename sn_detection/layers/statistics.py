"""Per-(n, c) statistics: computed once, derived into LN / BN statistics, applied as one scale and shift.

Switchable Normalization (Luo et al., Eq. 5) observes that every statistic it mixes can be derived from
the instance-norm moments of each (sample, channel) over H*W:

    mu_ln  = mean_c mu_in,  var_ln = mean_c (var_in + mu_in^2) - mu_ln^2
    mu_bn  = mean_n mu_in,  var_bn = mean_n (var_in + mu_in^2) - mu_bn^2

so the (N, C, H, W) tensor is only read for the moments and once more for the elementwise output, with a
per-(n, c) ``scale`` and ``shift`` folding the normalization and the affine; everything in between works
on (N, C) summaries. The same holds for DN, MN and MGN.

Numerics: fp32 as accurate as torch's BatchNorm whatever a channel's mean-to-spread ratio.

- IN moments: sum(x) and sum(x^2) in one pass each (fp32 accumulation); the (rare) maps whose mean
  exceeds ten times their spread, where E[x^2] - mean^2 and a summed mean lose digits, are computed
  again in float64 by the centred two-pass formula (``_moments``).
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

Speed: the heavy steps are small autograd Functions with closed-form backward passes (the per-(n, c)
terms of the paper's appendix, Eq. 9), where autograd's generic formulas would allocate several extra
full-size temporaries (``_NormalizeByMoments``). ``reference_normalize_by_moments`` is the same
computation in plain autograd, the oracle of the tests.

Double backward (a gradient penalty: ``create_graph=True``) is exact: the closed-form backward passes
are written for first derivatives, so with ``create_graph`` they compute the gradients again with plain
differentiable operations (``_NormalizeByMoments`` replays the plain forward, with the running
statistics left alone: ``running.replaying``).
"""

import functools
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .freezing import FreezableNorm
from .running import replaying


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


# Above this ratio mean^2 / var (a mean over three times the spread) a map's moments are recomputed in float64:
# units of its last place off, and E[x^2] - E[x]^2 loses log10(ratio) digits.
_ILL_CONDITIONED = 10.0


def _moments(xs: Tensor, ill_conditioned: float = _ILL_CONDITIONED) -> tuple[Tensor, Tensor]:
    """IN mean and biased variance (N, C) of xs, without autograd: one read for sum(x), one for sum(x^2);
    ill-conditioned maps again, exactly (module docstring)."""
    count = max(xs.shape[2] * xs.shape[3], 1)
    mean = xs.sum((2, 3)) / count
    mean_sq = torch.linalg.vector_norm(xs, dim=(2, 3)).square() / count
    var = (mean_sq - mean.square()).clamp(min=0)
    recompute = mean.square() > ill_conditioned * var  # an argument: TorchScript reads no global float
    # a traced model takes the branch always (with no map it does nothing), not as the tracing input did
    if torch.jit.is_tracing() or bool(recompute.any()):
        maps = xs.flatten(2)[recompute].double()
        exact_mean = maps.mean(1)
        # index_put, not `t[mask] = v`: the tracer records the latter with the value's shape of the moment
        mean = mean.index_put((recompute,), exact_mean.to(mean.dtype))
        var = var.index_put((recompute,), (maps - exact_mean[:, None]).square().mean(1).to(var.dtype))
    return mean, var


class _InstanceMoments(torch.autograd.Function):
    """mean and biased variance of x over H*W, shapes (N, C), by ``_moments``; closed-form backward."""

    @staticmethod
    def forward(ctx, x: Tensor):
        mean, var = _moments(x.to(stat_dtype(x)))
        ctx.save_for_backward(x, mean)
        return mean, var

    @staticmethod
    def backward(ctx, grad_mean: Tensor, grad_var: Tensor):
        x, mean = ctx.saved_tensors
        count = max(x.shape[2] * x.shape[3], 1)
        # d mean / dx = 1 / HW and d var / dx = 2 (x - mean) / HW: grad = (x - mean) * p + q
        p = 2 * grad_var / count
        q = grad_mean / count
        return _per_map_affine(x.to(p.dtype), p, q, mean).to(x.dtype)


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
        return _per_map_affine(x.to(scale.dtype), scale, shift, center).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, scale, center = ctx.saved_tensors
        xs, gy = x.to(scale.dtype), grad_y.to(scale.dtype)
        grad_x = (grad_y * scale[:, :, None, None]).to(x.dtype) if ctx.needs_input_grad[0] else None
        dot, total = _centered_dot_and_sum(gy, xs, center)
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
        xs = x.to(stat_dtype(x))
        mean_in, var_in = _moments(xs)
        scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
        return _per_map_affine(xs, scale, shift, mean_in).to(x.dtype)


class MomentNormalizer(FreezableNorm):
    """Mixin for a layer whose output is ``normalize_by_moments`` with its own
    ``scale_and_shift(mean_in, var_in, spatial_size) -> (scale, shift)`` (centred at mean_in) and
    ``num_channels``; frozen while its parameters are (``freezing``)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.num_channels:
            raise ValueError(f"expected input of shape (N, {self.num_channels}, H, W), got {list(x.shape)}")
        spatial_size = x.shape[2] * x.shape[3]
        if torch.jit.is_scripting():  # plain operations, see plain_moments
            mean, var = plain_moments(x)
            return plain_scale_shift(x, *self.scale_and_shift(mean, var, spatial_size), mean)
        self._follow_freezing()
        affine = functools.partial(self.scale_and_shift, spatial_size=spatial_size)
        return normalize_by_moments(x, affine, tuple(self.parameters()))


def reference_normalize_by_moments(x: Tensor, affine: AffineFromMoments) -> Tensor:
    """``normalize_by_moments`` by separate reductions and autograd through every op: the readable path
    the fast one is tested against."""
    xs = x.to(stat_dtype(x))
    var_in, mean_in = torch.var_mean(xs, dim=(2, 3), correction=0)
    scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
    return ((xs - mean_in[:, :, None, None]) * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype)


def plain_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """The IN mean and biased variance (N, C) of x that ``normalize_by_moments`` uses, in plain tensor
    operations. With ``plain_scale_shift`` it is what a layer computes under TorchScript, which compiles
    neither autograd Functions nor callables passed as arguments: the same values, autograd's gradients."""
    return _moments(x.to(stat_dtype(x)))


def plain_scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """(x - center) * scale + shift with scale, shift and center broadcastable to (N, C), computed in their
    dtype and returned in x's (see ``plain_moments``)."""
    size = [x.shape[0], x.shape[1]]
    scale, shift, center = scale.expand(size), shift.expand(size), center.expand(size)
    centered = x.to(scale.dtype) - center[:, :, None, None]
    return torch.addcmul(shift[:, :, None, None], centered, scale[:, :, None, None]).to(x.dtype)


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

    (g_mean, g_var: gradients of the loss with respect to the IN statistics; the paper's appendix).
    """

    @staticmethod
    def forward(ctx, x: Tensor, affine: AffineFromMoments, *parameters: Tensor):
        xs = x.to(stat_dtype(x))
        mean_in, var_in = _moments(xs)
        with torch.enable_grad():
            mean_in.requires_grad_(ctx.needs_input_grad[0])
            var_in.requires_grad_(ctx.needs_input_grad[0])
            scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
        ctx.save_for_backward(x, *parameters)
        ctx.affine = affine
        ctx.graph = (mean_in, var_in, scale, shift)
        return _per_map_affine(xs, scale.detach(), shift.detach(), mean_in.detach()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, *parameters = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable gradients, from the plain computation
            return _replayed_gradients(ctx, x, parameters, grad_y)
        mean_in, var_in, scale, shift = ctx.graph
        xs, gy = x.to(scale.dtype), grad_y.to(scale.dtype)
        center = mean_in.detach()
        dot, total = _centered_dot_and_sum(gy, xs, center)
        inputs = [t for t in (mean_in, var_in, *parameters) if t.requires_grad]
        # the small graph is kept (it is tiny) so that a backward with retain_graph=True can run again
        grads = iter(torch.autograd.grad((scale, shift), inputs, (dot, total), retain_graph=True, allow_unused=True))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_mean, grad_var = next(grads), next(grads)
            grad_mean = (torch.zeros_like(center) if grad_mean is None else grad_mean) - scale.detach() * total
            grad_x = _grad_input(xs, gy, scale.detach(), center, grad_mean, grad_var).to(x.dtype)
        grad_parameters = [next(grads) if p.requires_grad else None for p in parameters]
        return (grad_x, None, *grad_parameters)


def _replayed_gradients(ctx, x: Tensor, parameters: list, grad_y: Tensor) -> tuple:
    """The gradients of the forward with respect to x and the parameters, as a differentiable function of
    them and of grad_y: the forward run again in plain autograd (``reference_normalize_by_moments``),
    without recording its statistics twice, and differentiated with create_graph."""
    with torch.enable_grad(), replaying():
        y = reference_normalize_by_moments(x, ctx.affine)
    wanted = [t for t, needed in zip((x, *parameters), (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:])) if needed]
    grads = iter(torch.autograd.grad(y, wanted, grad_y, create_graph=True, allow_unused=True))
    grad_x = next(grads) if ctx.needs_input_grad[0] else None
    grad_parameters = [next(grads) if needed else None for needed in ctx.needs_input_grad[2:]]
    return (grad_x, None, *grad_parameters)


def _centered_dot_and_sum(gy: Tensor, xs: Tensor, center: Tensor) -> tuple[Tensor, Tensor]:
    """sum(gy * (x - center)) and sum(gy) over H*W per (n, c), in one read of gy and x.

    BatchNorm's evaluation-mode backward computes exactly these two per-channel sums in one fused pass
    (grad_weight = sum(gy * (x - mean) * invstd) with mean = center and invstd 1, grad_bias = sum(gy));
    viewing (N, C, H, W) as one sample of N * C channels makes its channels our (n, c) pairs. Under
    create_graph the plain, differentiable formula is used.
    """
    n, c = xs.shape[:2]
    if torch.is_grad_enabled() or xs.numel() == 0:
        return (gy * (xs - center[:, :, None, None])).sum((2, 3)), gy.sum((2, 3))
    ones = xs.new_ones(n * c)
    _, dot, total = torch.ops.aten.native_batch_norm_backward(
        gy.reshape(1, n * c, -1), xs.reshape(1, n * c, -1), ones, center.reshape(-1), ones, center.reshape(-1), ones,
        False, 0.0, [False, True, True],
    )
    return dot.view(n, c), total.view(n, c)


def _grad_input(xs, gy, scale, center, grad_mean, grad_var) -> Tensor:
    count = max(xs.shape[2] * xs.shape[3], 1)
    grad_var = torch.zeros_like(center) if grad_var is None else grad_var
    p = 2 * grad_var / count
    q = grad_mean / count
    # one full-size write, then an in-place update: no second full-size temporary
    grad_x = _per_map_affine(xs, p, q, center)
    return grad_x.addcmul_(gy, scale[:, :, None, None])


def _per_map_affine(xs: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """(xs - center) * scale + shift with (N, C) scale, shift and center, into a new tensor.

    BatchNorm's evaluation-mode forward with mean ``center``, variance 1 and eps 0 is exactly this (per
    channel of the (1, N * C, H * W) view); on CPU its kernel is ~15% faster than broadcasting ops,
    whose cost, like that of all full-size writes, dominates the layer. Under create_graph the plain,
    differentiable formula is used.
    """
    n, c = scale.shape
    if torch.is_grad_enabled() or xs.numel() == 0 or not xs.is_contiguous():
        return plain_scale_shift(xs, scale, shift, center)
    ones = scale.new_ones(n * c)
    with torch.autocast(xs.device.type, enabled=False):
        y = F.batch_norm(xs.view(1, n * c, -1), center.reshape(-1), ones, scale.reshape(-1), shift.reshape(-1), False, 0.0, 0.0)
    # detached: not a view in autograd's eyes, so that a custom Function returning it allows an in-place
    # op after the layer (detectron2's ReLU)
    return y.view_as(xs).detach()
