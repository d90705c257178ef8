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

from typing import NamedTuple

import torch
from torch import Tensor


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


class _InstanceMoments(torch.autograd.Function):
    """mean and biased variance of x over H*W, shapes (N, C); single pass of sum and sum of squares."""

    @staticmethod
    def forward(ctx, x: Tensor):
        xs = x.to(stat_dtype(x))
        count = x.shape[2] * x.shape[3]
        mean = xs.sum((2, 3)) / count
        # vector_norm squares and sums in one pass without a full-size temporary, unlike x.square().sum()
        mean_sq = torch.linalg.vector_norm(xs, dim=(2, 3)).square() / count
        var = (mean_sq - mean.square()).clamp(min=0)
        ctx.save_for_backward(x, mean)
        return mean, var

    @staticmethod
    def backward(ctx, grad_mean: Tensor, grad_var: Tensor):
        x, mean = ctx.saved_tensors
        count = x.shape[2] * x.shape[3]
        # d mean / dx = 1 / HW and d var / dx = 2 (x - mean) / HW, folded into grad = x * p + q
        p = 2 * grad_var / count
        q = grad_mean / count - p * mean
        grad_x = torch.addcmul(q[:, :, None, None], x.to(p.dtype), p[:, :, None, None])
        return grad_x.to(x.dtype)


def instance_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """IN statistics of an (N, C, H, W) tensor: mean and biased variance over H*W, each (N, C)."""
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
    count = mean_in.new_tensor(mean_in.shape[0] * spatial_size)
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

    @torch.no_grad()
    def _track(self, sums: MomentSums) -> None:
        sums = MomentSums(*(s.detach() for s in sums))
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
        y = torch.addcmul(shift[:, :, None, None], x.to(scale.dtype), scale[:, :, None, None])
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, scale = ctx.saved_tensors
        grad_x = grad_scale = grad_shift = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_y * scale[:, :, None, None]).to(x.dtype)
        if ctx.needs_input_grad[1]:
            # a batched dot product: no full-size temporary, unlike (grad_y * x).sum((2, 3))
            grad_scale = torch.einsum("nchw,nchw->nc", grad_y.to(scale.dtype), x.to(scale.dtype))
        if ctx.needs_input_grad[2]:
            grad_shift = grad_y.to(scale.dtype).sum((2, 3))
        return grad_x, grad_scale, grad_shift


def scale_shift(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """x * scale + shift for an (N, C, H, W) x and (N, C) scale and shift, in one pass."""
    return _ScaleShift.apply(x, scale, shift)


def normalize(x: Tensor, mean: Tensor, var: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """weight * (x - mean) / sqrt(var + eps) + bias with (N, C) statistics, as one scale and shift."""
    scale = weight * torch.rsqrt(var + eps)
    return scale_shift(x, scale, bias - mean * scale)
