"""BNSR's forward and backward as Triton kernels, three launches each in training, and their host code: the
layer's plan (``SkewnessKernels``), which ``fused`` runs as one autograd node.

With per-channel mu, r = (var + eps)^(-1/2) (the batch's in training, the running ones in evaluation),
z = (x - mu) r and phi_p(z) = sign(z) |z|^p (``skewness``):

    forward    y = gamma phi_p(z) + beta
    backward   grad gamma = sum grad_y phi_p(z),   grad beta = sum grad_y,
               grad_x = a grad_y phi_p'(z) + b (x - mu) + q,   a = gamma r

where phi_p'(z) = p |z|^(p - 1) (its value at 0 as ``skewness`` defines it), and, in training, BatchNorm's
backward applied to g = grad_y gamma phi_p'(z): grad_x = r (g - mean g - z mean(g z)), so that
b = -r^2 mean(g z) and q = -r mean(g), the means over the channel's N * H * W values; in evaluation
b = q = 0. The launches:

- training forward: ``kernels.TritonPasses.moments`` (the IN moments of every (n, c)); one program per block
  of channels pools them into the batch's mean and biased variance (two-pass, so exact whatever the
  mean-to-spread ratio), moves the running statistics (unbiased variance, as BatchNorm; ``kernels``'
  running update) and writes mu, r; one elementwise pass writes y. In evaluation the elementwise pass reads
  the running statistics itself: one launch.
- backward: one pass reads (grad_y, x) for the per-(n, c) sums of grad_y phi', grad_y phi' z,
  grad_y phi and grad_y; one program per block of channels sums them over the batch into the parameters'
  gradients and a, b, q; one elementwise pass writes grad_x.

|z|^p is computed as 2^(p log2 |z|), in float32; full-size outputs are rounded once to x's dtype.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from .kernels import (
    TritonPasses,
    _output_like,
    _tile_of_program,
    _tile_offsets,
    _tile_shape,
    cdiv,
    launch,
    next_pow2,
    running_factor,
    store_running_moments,
    tl,
    triton,
    written_in_place,
)

_BLOCK_N = 32
_MAX_BLOCK_C = 64

if triton is not None:

    @triton.jit
    def _log2_magnitude(z):
        # log2 |z|, with 0 in place of -inf at z = 0 (the callers set that point's value)
        magnitude = tl.abs(z)
        return tl.log2(tl.where(magnitude > 0, magnitude, 1.0))

    @triton.jit
    def _signed_power(z, p):
        # sign(z) |z|^p, 0 at z = 0
        magnitude = tl.where(z == 0, 0.0, tl.exp2(p * _log2_magnitude(z)))
        return tl.where(z < 0, -magnitude, magnitude)

    @triton.jit
    def _signed_power_slope(z, p, SLOPE_AT_ZERO: tl.constexpr):
        return tl.where(z == 0, SLOPE_AT_ZERO, p * tl.exp2((p - 1) * _log2_magnitude(z)))

    @triton.jit
    def _channel_statistics(mu_ptr, r_ptr, c, c_mask, eps, FROM_VARIANCE: tl.constexpr):
        # mu and r of channels c: written by the batch-statistics kernel, or the running mean and variance
        mu = tl.load(mu_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + c, mask=c_mask, other=1.0).to(tl.float32)
        if FROM_VARIANCE:
            r = 1.0 / tl.sqrt(r + eps)
        return mu, r

    @triton.jit
    def _batch_statistics_kernel(
        moments_ptr,
        running_mean_ptr,
        running_var_ptr,
        tracked_ptr,
        mu_ptr,
        r_ptr,
        N,
        C,
        eps,
        momentum,
        count,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # the moments block's rows: the IN means and variances (``kernels``) of a batch of ``count`` values
        # per channel
        mean_ptr, var_ptr = moments_ptr, moments_ptr + N * C
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        mu = tl.zeros([BLOCK_C], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < N)[:, None] & col_mask[None, :]
            mu += tl.sum(tl.load(mean_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0), 0)
        mu = mu / N
        var = tl.zeros([BLOCK_C], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < N)[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            d = tl.where(mask, tl.load(mean_ptr + offsets, mask=mask, other=0.0) - mu[None, :], 0.0)
            var += tl.sum(tl.load(var_ptr + offsets, mask=mask, other=0.0) + d * d, 0)
        var = var / N
        tl.store(mu_ptr + cols, mu, mask=col_mask)
        tl.store(r_ptr + cols, 1.0 / tl.sqrt(var + eps), mask=col_mask)
        average_factor = running_factor(tracked_ptr, momentum, 1)
        store_running_moments(
            running_mean_ptr, running_var_ptr, cols, col_mask, mu, var, count, average_factor, None, True, False
        )

    @triton.jit
    def _forward_kernel(
        x_ptr,
        y_ptr,
        mu_ptr,
        r_ptr,
        weight_ptr,
        bias_ptr,
        C,
        HW,
        c_blocks,
        hw_blocks,
        eps,
        p,
        FROM_VARIANCE: tl.constexpr,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        n, c, hw = _tile_of_program(c_blocks, hw_blocks, BLOCK_C, BLOCK_HW)
        c_mask = c < C
        mask = c_mask[:, None] & (hw < HW)[None, :]
        offsets = n.to(tl.int64) * C * HW + _tile_offsets(c, hw, C, HW, CHANNELS_LAST)
        mu, r = _channel_statistics(mu_ptr, r_ptr, c, c_mask, eps, FROM_VARIANCE)
        gamma = tl.load(weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        beta = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        y = gamma[:, None] * _signed_power((x - mu[:, None]) * r[:, None], p) + beta[:, None]
        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sums_kernel(
        gy_ptr,
        x_ptr,
        mu_ptr,
        r_ptr,
        sums_ptr,
        N,
        C,
        HW,
        c_blocks,
        eps,
        p,
        FROM_VARIANCE: tl.constexpr,
        SLOPE_AT_ZERO: tl.constexpr,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        # per (n, c): sum grad_y phi', sum grad_y phi' z, sum grad_y phi, sum grad_y; sums is (4, N, C)
        pid = tl.program_id(0)
        n = pid // c_blocks
        c = (pid % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < C
        base = n.to(tl.int64) * C * HW
        mu, r = _channel_statistics(mu_ptr, r_ptr, c, c_mask, eps, FROM_VARIANCE)
        slope_sum = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        slope_z_sum = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        power_sum = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        total = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        for start in range(0, HW, BLOCK_HW):
            hw = start + tl.arange(0, BLOCK_HW)
            mask = c_mask[:, None] & (hw < HW)[None, :]
            offsets = base + _tile_offsets(c, hw, C, HW, CHANNELS_LAST)
            gy = tl.load(gy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # 0 on masked lanes
            z = (tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) - mu[:, None]) * r[:, None]
            slope = gy * _signed_power_slope(z, p, SLOPE_AT_ZERO)
            slope_sum += slope
            slope_z_sum += slope * z
            power_sum += gy * _signed_power(z, p)
            total += gy
        out = n * C + c
        tl.store(sums_ptr + out, tl.sum(slope_sum, 1), mask=c_mask)
        tl.store(sums_ptr + N * C + out, tl.sum(slope_z_sum, 1), mask=c_mask)
        tl.store(sums_ptr + 2 * N * C + out, tl.sum(power_sum, 1), mask=c_mask)
        tl.store(sums_ptr + 3 * N * C + out, tl.sum(total, 1), mask=c_mask)

    @triton.jit
    def _coefficients_kernel(
        sums_ptr,
        mu_ptr,
        r_ptr,
        weight_ptr,
        grad_weight_ptr,
        grad_bias_ptr,
        coefficients_ptr,
        N,
        C,
        count,
        eps,
        FROM_VARIANCE: tl.constexpr,
        BATCH_STATS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # per channel: the parameters' gradients and a, b, q (coefficients is (3, C))
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        sums = tl.zeros([4, BLOCK_C], dtype=tl.float32)
        k = tl.arange(0, 4)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < N)[None, :, None] & col_mask[None, None, :]
            offsets = k[:, None, None] * N * C + rows[None, :, None] * C + cols[None, None, :]
            sums += tl.sum(tl.load(sums_ptr + offsets, mask=mask, other=0.0), 1)
        slope_sum = tl.sum(tl.where(k[:, None] == 0, sums, 0.0), 0)
        slope_z_sum = tl.sum(tl.where(k[:, None] == 1, sums, 0.0), 0)
        _, r = _channel_statistics(mu_ptr, r_ptr, cols, col_mask, eps, FROM_VARIANCE)
        gamma = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(grad_weight_ptr + cols, tl.sum(tl.where(k[:, None] == 2, sums, 0.0), 0), mask=col_mask)
        tl.store(grad_bias_ptr + cols, tl.sum(tl.where(k[:, None] == 3, sums, 0.0), 0), mask=col_mask)
        a = gamma * r
        b = tl.zeros([BLOCK_C], dtype=tl.float32)
        q = tl.zeros([BLOCK_C], dtype=tl.float32)
        if BATCH_STATS:
            b = -a * r * slope_z_sum / count
            q = -a * slope_sum / count
        tl.store(coefficients_ptr + cols, a, mask=col_mask)
        tl.store(coefficients_ptr + C + cols, b, mask=col_mask)
        tl.store(coefficients_ptr + 2 * C + cols, q, mask=col_mask)

    @triton.jit
    def _grad_input_kernel(
        gy_ptr,
        x_ptr,
        gx_ptr,
        mu_ptr,
        r_ptr,
        coefficients_ptr,
        C,
        HW,
        c_blocks,
        hw_blocks,
        eps,
        p,
        FROM_VARIANCE: tl.constexpr,
        SLOPE_AT_ZERO: tl.constexpr,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        n, c, hw = _tile_of_program(c_blocks, hw_blocks, BLOCK_C, BLOCK_HW)
        c_mask = c < C
        mask = c_mask[:, None] & (hw < HW)[None, :]
        offsets = n.to(tl.int64) * C * HW + _tile_offsets(c, hw, C, HW, CHANNELS_LAST)
        mu, r = _channel_statistics(mu_ptr, r_ptr, c, c_mask, eps, FROM_VARIANCE)
        a = tl.load(coefficients_ptr + c, mask=c_mask, other=0.0)[:, None]
        b = tl.load(coefficients_ptr + C + c, mask=c_mask, other=0.0)[:, None]
        q = tl.load(coefficients_ptr + 2 * C + c, mask=c_mask, other=0.0)[:, None]
        gy = tl.load(gy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        centered = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) - mu[:, None]
        gx = a * gy * _signed_power_slope(centered * r[:, None], p, SLOPE_AT_ZERO) + b * centered + q
        tl.store(gx_ptr + offsets, gx.to(gx_ptr.dtype.element_ty), mask=mask)


def _blocks(c: int) -> int:
    return min(next_pow2(c), _MAX_BLOCK_C)


class SkewnessKernels:
    """BNSR's kernels for non-empty kernel-path inputs of one signature (module docstring; ``fused.FusedPlan``):
    each direction one method. A plan of the layer's calls (``base.NormBase.call_plan``) that holds no
    tensor."""

    def __init__(self, layer, x: Tensor):
        self.batch_stats = layer.training
        n, c, h, w = x.shape
        self.count = n * h * w
        self.slope_at_zero = 1.0 if layer.p == 1 else 0.0  # ``skewness``: the slope's limit, finite
        self.passes = TritonPasses(x)  # the moments, and its layout check: x's
        self.channels_last = self.passes.channels_last
        self.memory_format = self.passes.memory_format
        self.running = operator.itemgetter("running_mean", "running_var", "num_batches_tracked")
        block_c, block_hw = _tile_shape(c, h * w, self.channels_last)
        c_blocks, hw_blocks = cdiv(c, block_c), cdiv(h * w, block_hw)
        self.shape = (n, c, h * w, c_blocks, hw_blocks)
        self.map_grid, self.reduce_grid = (n * c_blocks * hw_blocks,), (n * c_blocks,)
        small_block_c = _blocks(c)
        self.channel_grid = (cdiv(c, small_block_c),)
        from_variance = not self.batch_stats
        self.statistics_constants = dict(BLOCK_N=_BLOCK_N, BLOCK_C=small_block_c)
        self.map_constants = dict(
            FROM_VARIANCE=from_variance, CHANNELS_LAST=self.channels_last, BLOCK_C=block_c, BLOCK_HW=block_hw
        )
        self.slope_constants = dict(SLOPE_AT_ZERO=self.slope_at_zero, **self.map_constants)
        self.coefficients_constants = dict(
            FROM_VARIANCE=from_variance, BATCH_STATS=self.batch_stats, BLOCK_N=_BLOCK_N, BLOCK_C=small_block_c
        )

    def forward(self, layer, x: Tensor, parameters, save: bool):
        """In training: moments -> the batch-statistics kernel (mu, r and the running statistics) -> the output
        kernel; in evaluation the output kernel reads the running mean and variance itself. saved: (mu, r), or
        the running mean and variance as they are now."""
        weight, bias = parameters
        n, c, hw, c_blocks, hw_blocks = self.shape
        running_mean, running_var, _ = running = self.running(layer._buffers)
        if self.batch_stats:
            moments = self.passes.moments(x)
            mu, r = moments.new_empty(c), moments.new_empty(c)
            launch(
                _batch_statistics_kernel,
                self.channel_grid,
                (moments, *running, mu, r, n, c, layer.eps, layer.momentum, float(self.count)),
                self.statistics_constants,
            )
            written_in_place(*running)
        elif save:  # the running statistics as they are now: saved, not read again later
            mu, r = running_mean.clone(), running_var.clone()
        else:
            mu, r = running_mean, running_var
        y = _output_like(x)
        launch(
            _forward_kernel,
            self.map_grid,
            (x, y, mu, r, weight, bias, c, hw, c_blocks, hw_blocks, layer.eps, float(layer.p)),
            self.map_constants,
        )
        return y, (mu, r) if save else None

    def backward(self, layer, grad_y: Tensor, x: Tensor, parameters, saved, needs_x: bool, needs_parameters):
        """The sums kernel -> the coefficients kernel (the parameters' gradients, a, b, q) -> grad_x."""
        mu, r = saved
        weight, bias = parameters
        n, c, hw, c_blocks, hw_blocks = self.shape
        eps, p = layer.eps, float(layer.p)
        grad_weight, grad_bias = torch.empty_like(weight), torch.empty_like(bias)
        grad_y = grad_y.contiguous(memory_format=self.memory_format)
        sums = x.new_empty((4, n, c), dtype=torch.float32)
        launch(
            _sums_kernel, self.reduce_grid, (grad_y, x, mu, r, sums, n, c, hw, c_blocks, eps, p), self.slope_constants
        )
        coefficients = sums.new_empty((3, c))
        launch(
            _coefficients_kernel,
            self.channel_grid,
            (sums, mu, r, weight, grad_weight, grad_bias, coefficients, n, c, float(self.count), eps),
            self.coefficients_constants,
        )
        grad_x = None
        if needs_x:
            grad_x = _output_like(x)
            launch(
                _grad_input_kernel,
                self.map_grid,
                (grad_y, x, grad_x, mu, r, coefficients, c, hw, c_blocks, hw_blocks, eps, p),
                self.slope_constants,
            )
        return grad_x, [grad_weight, grad_bias]
