"""Per-(n, c) statistics: computed once, derived into LN / BN statistics, applied as one scale and shift.

Switchable Normalization (Luo et al., Eq. 5) observes that every statistic it mixes can be derived from
the instance-norm moments of each (sample, channel) over H*W:

    mu_ln  = mean_c mu_in,  var_ln = mean_c (var_in + mu_in^2) - mu_ln^2
    mu_bn  = mean_n mu_in,  var_bn = mean_n (var_in + mu_in^2) - mu_bn^2

so the (N, C, H, W) tensor is only read for the moments (sum and sum of squares) and once more for the
elementwise ``y = x * a + b``, with ``a, b`` of shape (N, C) folding the normalization and the affine;
everything in between works on (N, C) summaries.

Choices the paper leaves open:

- Variances are *biased* (divide by H*W): the unbiased estimate is NaN for 1x1 maps (a bug of the
  original code). Derived variances are clamped at 0 against rounding.
- The moments are computed in at least float32 whatever the input dtype (fp16 / bf16 inputs are
  upcast), from sum(x) and sum(x^2). PyTorch's reductions accumulate blockwise, so the main error is
  the cancellation in E[x^2] - mean^2, about 1e-7 * (mean^2 + var) in fp32: negligible unless a
  channel's mean is thousands of times its spread. This is the form of Eq. 5 itself, it is what lets
  sums be pooled across processes and batches, and it is ~10x faster on CPU than ``torch.var_mean``
  (Welford).
- Pooled BN statistics are carried as sums (``MomentSums``: sum of x, sum of x^2, count) rather than
  means, so batches and processes of different sizes combine exactly (law of total variance).

Both heavy steps are small autograd Functions with closed-form backward passes (the per-(n, c) terms
of the paper's appendix, Eq. 9): autograd's generic formulas for them allocate several extra
full-size temporaries.
"""

import functools
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


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
        # d mean / dx = 1 / HW and d var / dx = 2 (x - mean) / HW, folded into grad = x * p + q
        p = 2 * grad_var / count
        q = grad_mean / count - p * mean
        return _per_map_affine(x.to(p.dtype), p, q).to(x.dtype)


def instance_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """IN statistics of an (N, C, H, W) tensor: mean and biased variance over H*W, each (N, C)."""
    if torch.jit.is_scripting():
        return plain_moments(x)
    return _InstanceMoments.apply(x)


def layer_moments(mean_in: Tensor, var_in: Tensor) -> tuple[Tensor, Tensor]:
    """LN statistics from IN statistics (Eq. 5, pooled over channels): each (N, 1)."""
    mean = mean_in.mean(1, keepdim=True)
    var = (var_in + mean_in.square()).mean(1, keepdim=True) - mean.square()
    return mean, var.clamp(min=0)


class MomentSums(NamedTuple):
    """Per-channel sufficient statistics of a set of values: sum of x (C,), sum of x^2 (C,), count ()."""

    total: Tensor
    total_sq: Tensor
    count: Tensor


def batch_sums(mean_in: Tensor, var_in: Tensor, spatial_size: int) -> MomentSums:
    """Per-channel sums over N*H*W values, recovered from IN statistics over maps of ``spatial_size``.

    With ``moments_from_sums`` this gives the BN statistics of Eq. 5 (pooled over the batch).
    """
    total = mean_in.sum(0) * spatial_size
    total_sq = (var_in + mean_in.square()).sum(0) * spatial_size
    count = mean_in.new_full((), mean_in.shape[0] * spatial_size)
    return MomentSums(total, total_sq, count)


def moments_from_sums(sums: MomentSums) -> tuple[Tensor, Tensor]:
    """Mean and biased variance (C,) of pooled sums; zeros for an empty set rather than NaN."""
    count = sums.count.clamp(min=1)
    mean = sums.total / count
    var = sums.total_sq / count - mean.square()
    return mean, var.clamp(min=0)


class MomentAccumulator:
    """Exact pooling of ``MomentSums`` over many batches, for the paper's "batch average" (Sec. 2.1).

    Sums are kept detached in float64 so that thousands of batches add up without drift; the pooled
    statistics are then those of the concatenation of all batches.
    """

    def __init__(self):
        self._sums = None

    def add(self, sums: MomentSums) -> None:
        sums = MomentSums(*(s.detach().double() for s in sums))
        self._sums = sums if self._sums is None else MomentSums(*map(torch.add, self._sums, sums))

    def pooled(self) -> MomentSums:
        """The sums of every value added; raises if there were none."""
        if self._sums is None or self._sums.count.item() == 0:
            raise RuntimeError(
                "batch average has no statistics: run forwards in training mode on non-empty batches "
                "between start_batch_average() and finish_batch_average()"
            )
        return self._sums


class RunningMoments:
    """Mixin for modules with BN-like ``running_mean`` / ``running_var`` / ``num_batches_tracked``.

    ``_track(sums)`` is called by the module with each training batch's pooled sums. It updates the
    buffers with PyTorch's momentum convention, ``running = (1 - momentum) * running + momentum *
    batch``, skipping empty batches, or, between ``start_batch_average()`` and
    ``finish_batch_average()``, pools the sums so that ``finish`` can store the statistics of all
    those batches together (``num_batches_tracked`` is then left alone). The stored variance is biased
    unless the class sets ``unbiased_running_var`` (as PyTorch's BatchNorm does).
    """

    unbiased_running_var = False
    __constants__ = ("unbiased_running_var",)  # how TorchScript reads a class attribute

    def _register_running_moments(self, num_channels: int) -> None:
        self.register_buffer("running_mean", torch.zeros(num_channels))
        self.register_buffer("running_var", torch.ones(num_channels))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self._batch_average = None

    def _running_target(self, sums: MomentSums) -> tuple[Tensor, Tensor]:
        mean, var = moments_from_sums(sums)
        if self.unbiased_running_var:
            var = var * sums.count / (sums.count - 1).clamp(min=1)
        return mean.to(self.running_mean.dtype), var.to(self.running_var.dtype)

    def _track(self, sums: MomentSums) -> None:
        sums = MomentSums(sums.total.detach(), sums.total_sq.detach(), sums.count.detach())
        if self._batch_average is not None:
            self._batch_average.add(sums)
            return
        mean, var = self._running_target(sums)
        # torch.where rather than an `if`: a count pooled across processes lives on the device, and
        # reading it would stall the host at every layer
        seen = sums.count > 0
        self.running_mean.copy_(torch.where(seen, self.running_mean.lerp(mean, self.momentum), self.running_mean))
        self.running_var.copy_(torch.where(seen, self.running_var.lerp(var, self.momentum), self.running_var))
        self.num_batches_tracked.add_(seen.long())

    def start_batch_average(self) -> None:
        """From now on, training-mode forwards pool statistics instead of updating the moving average."""
        self._batch_average = MomentAccumulator()

    def finish_batch_average(self) -> None:
        """Stores the pooled statistics as running_mean / running_var and stops pooling."""
        accumulator, self._batch_average = self._batch_average, None
        if accumulator is None:
            raise RuntimeError("finish_batch_average() called without start_batch_average()")
        mean, var = self._running_target(accumulator.pooled())
        self.running_mean.copy_(mean)
        self.running_var.copy_(var)


class _ScaleShift(torch.autograd.Function):
    """y = x * a + b with per-(n, c) a and b, computed in a's dtype and returned in x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, shift: Tensor):
        ctx.save_for_backward(x, scale)
        return _per_map_affine(x.to(scale.dtype), scale, shift).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, scale = ctx.saved_tensors
        grad_x = grad_scale = grad_shift = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_y * scale[:, :, None, None]).to(x.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_scale, grad_shift = _dot_and_sum(grad_y.to(scale.dtype), x.to(scale.dtype))
        return grad_x, grad_scale, grad_shift


def scale_shift(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """x * scale + shift for an (N, C, H, W) x and (N, C) scale and shift, in one pass."""
    if torch.jit.is_scripting():
        return plain_scale_shift(x, scale, shift)
    return _ScaleShift.apply(x, scale, shift)


def affine_from_moments(weight: Tensor, bias: Tensor, mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Per-(n, c) scale and shift of weight * (x - mean) / sqrt(var + eps) + bias: y = x * scale + shift."""
    scale = weight * torch.rsqrt(var + eps)
    return scale, bias - mean * scale


# (mean_in, var_in), each (N, C) -> (scale, shift), each (N, C): what a normalizer does with IN statistics
AffineFromMoments = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def normalize_by_moments(x: Tensor, affine: AffineFromMoments, parameters: Sequence[Tensor]) -> Tensor:
    """y = x * scale + shift with (scale, shift) = affine(IN mean, IN variance of x), for any normalizer
    whose statistics derive from the IN statistics (SN, DN, MN, MGN, GN, ...).

    ``parameters`` are all the tensors ``affine`` differentiates with respect to (the module's
    parameters): they receive their gradients through this call. In training this is one autograd node
    that saves only x and the (N, C) intermediate graph; without gradients it is plain tensor code.
    ``reference_normalize_by_moments`` is the same computation in straightforward autograd.
    """
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in parameters)):
        return _NormalizeByMoments.apply(x, affine, *parameters)
    with torch.no_grad():
        xs = x.to(stat_dtype(x))
        scale, shift = _affine_in_stat_dtype(affine, *_moments(xs))
        return _per_map_affine(xs, scale, shift).to(x.dtype)


class MomentNormalizer:
    """Mixin for a layer whose output is ``normalize_by_moments`` with its own
    ``scale_and_shift(mean_in, var_in, spatial_size) -> (scale, shift)`` and ``num_channels``."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.num_channels:
            raise ValueError(f"expected input of shape (N, {self.num_channels}, H, W), got {list(x.shape)}")
        spatial_size = x.shape[2] * x.shape[3]
        if torch.jit.is_scripting():  # plain operations, see plain_moments
            mean, var = plain_moments(x)
            return plain_scale_shift(x, *self.scale_and_shift(mean, var, spatial_size))
        affine = functools.partial(self.scale_and_shift, spatial_size=spatial_size)
        return normalize_by_moments(x, affine, tuple(self.parameters()))


def reference_normalize_by_moments(x: Tensor, affine: AffineFromMoments) -> Tensor:
    """``normalize_by_moments`` by separate reductions and autograd through every op: the readable path
    the fast one is tested against."""
    xs = x.to(stat_dtype(x))
    var_in, mean_in = torch.var_mean(xs, dim=(2, 3), correction=0)
    scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
    return (xs * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype)


def plain_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """The IN mean and biased variance (N, C) of x that ``normalize_by_moments`` uses, in plain tensor
    operations. With ``plain_scale_shift`` it is what a layer computes under TorchScript, which compiles
    neither autograd Functions nor callables passed as arguments: the same values, autograd's gradients."""
    return _moments(x.to(stat_dtype(x)))


def plain_scale_shift(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """x * scale + shift with scale and shift broadcastable to (N, C), computed in their dtype and
    returned in x's (see ``plain_moments``)."""
    size = [x.shape[0], x.shape[1]]
    scale, shift = scale.expand(size), shift.expand(size)
    return torch.addcmul(shift[:, :, None, None], x.to(scale.dtype), scale[:, :, None, None]).to(x.dtype)


# Above this ratio mean^2 / var, E[x^2] - E[x]^2 in float32 keeps fewer than about four significant digits.
_CANCELLATION_LIMIT = 1e3


def _moments(xs: Tensor, cancellation_limit: float = _CANCELLATION_LIMIT) -> tuple[Tensor, Tensor]:
    """IN mean and biased variance of xs, without autograd: one read for sum(x), one for sum(x^2).

    The (rare) (n, c) maps whose mean dwarfs their spread get their variance again from the centred
    formula, so the result is accurate for any input.
    """
    count = max(xs.shape[2] * xs.shape[3], 1)
    mean = xs.sum((2, 3)) / count
    mean_sq = torch.linalg.vector_norm(xs, dim=(2, 3)).square() / count
    var = (mean_sq - mean.square()).clamp(min=0)
    ill_conditioned = mean.square() > cancellation_limit * var  # an argument: TorchScript reads no global float
    if ill_conditioned.any():
        var[ill_conditioned] = xs.flatten(2)[ill_conditioned].var(1, correction=0)
    return mean, var


def _affine_in_stat_dtype(affine: AffineFromMoments, mean_in: Tensor, var_in: Tensor) -> tuple[Tensor, Tensor]:
    # statistics stay in float32 (or float64) even under autocast, whose matmuls would run in fp16/bf16
    with torch.autocast(mean_in.device.type, enabled=False):
        scale, shift = affine(mean_in, var_in)
    return scale.expand_as(mean_in), shift.expand_as(mean_in)


class _NormalizeByMoments(torch.autograd.Function):
    """The training path of ``normalize_by_moments``.

    Autograd through the separate steps would write three full-size gradients of x (through the
    output, the mean and the variance) and add them up. Here the backward reads grad_y and x once for
    the (N, C) sums sum(grad_y * x) and sum(grad_y), differentiates the small (N, C) graph of
    ``affine`` with them, and writes grad_x once, from the closed form

        grad_x = grad_y * scale + x * p + q,   p = 2 g_var / HW,   q = g_mean / HW - p * mean_in

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
        ctx.save_for_backward(x)
        ctx.graph = (mean_in, var_in, scale, shift, parameters)
        return _per_map_affine(xs, scale.detach(), shift.detach()).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        (x,) = ctx.saved_tensors
        mean_in, var_in, scale, shift, parameters = ctx.graph
        xs, gy = x.to(scale.dtype), grad_y.to(scale.dtype)
        grad_scale, grad_shift = _dot_and_sum(gy, xs)
        inputs = [t for t in (mean_in, var_in, *parameters) if t.requires_grad]
        # the small graph is kept (it is tiny) so that a backward with retain_graph=True can run again
        grads = iter(
            torch.autograd.grad((scale, shift), inputs, (grad_scale, grad_shift), retain_graph=True, allow_unused=True)
        )
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_mean, grad_var = next(grads), next(grads)
            grad_x = _grad_input(xs, gy, scale.detach(), mean_in.detach(), grad_mean, grad_var).to(x.dtype)
        grad_parameters = [next(grads) if p.requires_grad else None for p in parameters]
        return (grad_x, None, *grad_parameters)


def _dot_and_sum(gy: Tensor, xs: Tensor) -> tuple[Tensor, Tensor]:
    """sum(gy * x) and sum(gy) over H*W per (n, c), in one read of gy and x.

    BatchNorm's evaluation-mode backward computes exactly these two per-channel sums in one fused pass
    (grad_weight = sum(gy * (x - mean) * invstd) with mean 0 and invstd 1, grad_bias = sum(gy)); viewing
    (N, C, H, W) as one sample of N * C channels makes its channels our (n, c) pairs.
    """
    n, c = xs.shape[:2]
    if xs.numel() == 0:
        return xs.new_zeros(n, c), xs.new_zeros(n, c)
    ones, zeros = xs.new_ones(n * c), xs.new_zeros(n * c)
    _, dot, total = torch.ops.aten.native_batch_norm_backward(
        gy.reshape(1, n * c, -1), xs.reshape(1, n * c, -1), ones, zeros, ones, zeros, ones, False, 0.0,
        [False, True, True],
    )
    return dot.view(n, c), total.view(n, c)


def _grad_input(xs, gy, scale, mean_in, grad_mean, grad_var) -> Tensor:
    count = max(xs.shape[2] * xs.shape[3], 1)
    grad_mean = torch.zeros_like(mean_in) if grad_mean is None else grad_mean
    grad_var = torch.zeros_like(mean_in) if grad_var is None else grad_var
    p = 2 * grad_var / count
    q = grad_mean / count - p * mean_in
    # one full-size write, then an in-place update: no second full-size temporary
    grad_x = _per_map_affine(xs, p, q)
    return grad_x.addcmul_(gy, scale[:, :, None, None])


def _per_map_affine(xs: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """xs * scale + shift with (N, C) scale and shift, into a new tensor.

    BatchNorm's evaluation-mode forward with mean 0, variance 1 and eps 0 is exactly this product and
    sum (per channel, of the (1, N * C, H * W) view); on CPU its kernel is ~15% faster than the
    broadcasting ``addcmul``, whose cost, like that of all full-size writes, dominates the layer.
    """
    n, c = scale.shape
    if xs.numel() == 0 or not xs.is_contiguous():
        return torch.addcmul(shift[:, :, None, None], xs, scale[:, :, None, None])
    ones = scale.new_ones(n * c)
    with torch.autocast(xs.device.type, enabled=False):
        y = F.batch_norm(xs.view(1, n * c, -1), ones - 1, ones, scale.reshape(-1), shift.reshape(-1), False, 0.0, 0.0)
    # detached: not a view in autograd's eyes, so that a custom Function returning it allows an in-place
    # op after the layer (detectron2's ReLU)
    return y.view_as(xs).detach()
