"""Switchable Normalization's (N, C) statistics and their gradients in closed form (``moment_normalizer``): as
one forward and one backward Triton kernel (``SwitchableKernels``: CUDA, Triton's interpreter) and as tensor operations
(``SwitchableClosedForms``: every other device and float64, where they replace autograd through the small
graph).

Forward, from the IN moments m, v (N, C) (``switchable``; LN and BN moments by the law of total variance):

    mu_ln[n] = mean_c m,   var_ln[n] = mean_c v + mean_c (m - mu_ln)^2      (the same over n for BN)
    offset   = a_ln (mu_ln - m) + a_bn (mu_bn - m),    var = b_in v + b_ln var_ln + b_bn var_bn
    scale    = gamma r,   r = (var + eps)^(-1/2),   shift = beta - offset * scale

with a = softmax(mean_weight), b = softmax(var_weight) for SN, or SSN's SparsestMax (``sparse_switchable``);
the output is (x - m) * scale + shift. In evaluation mu_bn, var_bn are the running statistics; in training
the kernel also moves them (and, for SSN, fixes weights that are one-hot).

Backward, from D = sum_HW grad_y (x - m) and S = sum_HW grad_y: the output's gradients with respect to scale
and shift are D and S, and the centring at m adds -scale * S to m's. With

    E = D - S * offset   (the gradient reaching scale through both terms),
    G = -E * scale * r^2 / 2   (reaching var),   H = -S * scale   (reaching offset),

the parameters' gradients are grad gamma = sum_n E r, grad beta = sum_n S, and for the logits the mapping's
backward of grad b_k = sum_{n,c} G var_k and grad a_k = sum_{n,c} H (mu_k - m) (a_in's branch has offset 0).
Pooled statistics pass their gradients back to each (n, c) by d mu_ln / dm = 1 / C and
d var_ln / dm = 2 (m - mu_ln) / C, d var_ln / dv = 1 / C (the mean's own term cancels: the deviations sum to
0), likewise over n with 1 / N in training:

    g_m = -(a_ln + a_bn) H + a_ln sum_c H / C + 2 b_ln sum_c G (m - mu_ln) / C
          + a_bn sum_n H / N + 2 b_bn sum_n G (m - mu_bn) / N - scale * S
    g_v = b_in G + b_ln sum_c G / C + b_bn sum_n G / N

and grad_x = grad_y * scale + (x - m) p + q with p = 2 g_v / HW, q = g_m / HW (``moment_normalizer``).

SyncSN across several processes pools the BN branch over all of them (``switchable``): one kernel writes
this process's float64 sums [count, sum of x, sum of x^2] per channel, the processes add them up (the
tensor and the collective of the autograd path, so that a process whose batch is empty, which runs that
path, takes part), and the forward kernel normalizes with the mean and variance of the pooled sums. In the
backward one kernel writes this process's gradient of those sums, from its sums over n of G and H, the
processes add them up, and the backward kernel passes them on to every (n, c) (d sum / dm = HW,
d sum_sq / dm = 2 m HW, d sum_sq / dv = HW), in float64, where their large parts cancel. Eight launches and
two all-reduces per training step.

The mapping from logits to weights is the kernels' constexpr MAPPING, by the layer's ``branch_mapping``:
SOFTMAX, whose backward is w * (g - sum_k w_k g_k), or SPARSESTMAX. SparsestMax's vector-Jacobian product, for
its 2 or 3 entries, by the regime of its result p (``sparse_switchable``): where p is the sparsemax w, the
sparsemax's backward, g minus its mean over the support S, on S; where p is the point u + r n on the circle
(n = (w - u) / |w - u| and p in the simplex), the circle's (r / |w - u|) (I - n n^T) g first, then the
sparsemax's; where p does not depend on the logits (the edge point, the clip, the one-hot vector from the
vertices' distance on, the fixed weights, the direction towards IN at the centre), nothing. The tensor
operations take the gradient of ``branch_weights`` by autograd (``logit_gradients``), against which the
kernels are tested.

Both versions compute the BN branch like the LN one, two-pass in the statistics dtype, and move the running
statistics in place by ``running``'s rule (``kernels``' running update in the kernels).

Programs. Each program owns BLOCK_C channels: their BN statistics, running statistics and parameter
gradients are its own; the sums over channels (LN statistics, sum_c G and sum_c H) it recomputes for every
sample from all channels, which costs a read of the (N, C) moments per program and spares a second launch.
Everything is float32, LN and BN variances two-pass, so accurate whatever a channel's mean-to-spread ratio.
The branches' sums over all (n, c) are made by every program and stored by the first.

Accuracy. What the statistics use of a pooled mean is its distance to each map's mean, mu - m, which is of
the size of the maps' spread when the maps' means are large (1e4 times their spread, say). A pooled mean
rounded to one float32 near 1e4 would lose the digits of that distance (and of var_ln, mean_c (m - mu_ln)^2
with it) to its rounding. So the batch's LN and BN means are kept as pairs mu = k + d, k the first map's
mean along the pooled axis and d the mean of the differences m - k, exact in float32 where the means are
close, and mu - m = d - (m - k) is never rounded near mu. The running statistics and the pooled sums of
SyncSN give mu as one value (k = mu, d = 0). The closed forms as tensor operations round mu to one value,
as the autograd path does: SyncSN runs that path across processes off the kernel path, and one process's
training rounds as theirs.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
from torch import Tensor

from .fused import is_replaying
from .kernels import (
    TritonPasses,
    cdiv,
    launch,
    next_pow2,
    running_factor,
    store_running_moments,
    tl,
    triton,
    written_in_place,
)
from .map_passes import TorchPasses, stat_dtype
from .running import update_running_moments

_TILE = 2048  # elements of one [BLOCK_N, BLOCK_C] tile
_MAX_BLOCK_C = 64

if triton is not None:
    # Where the BN branch's statistics come from (BN_SOURCE), and so where their gradient goes (BN_GRAD); the
    # mapping from logits to importance weights (MAPPING), by a layer's ``branch_mapping``. The kernels compare
    # with these constexpr globals; the host code passes their values.
    RUNNING, BATCH, POOLED, POOLED_SUMS = (tl.constexpr(value) for value in range(4))
    SOFTMAX, SPARSESTMAX = (tl.constexpr(value) for value in range(2))
    _MAPPINGS = {"softmax": SOFTMAX, "sparsestmax": SPARSESTMAX}

    @triton.jit
    def _softmax(logits_ptr, NUM_BRANCHES: tl.constexpr):
        # softmax of the 2 or 3 logits [IN, LN, BN], as a vector of 4 (0 past the last branch)
        k = tl.arange(0, 4)
        logits = tl.load(logits_ptr + k, mask=k < NUM_BRANCHES, other=float("-inf")).to(tl.float32)
        e = tl.exp(logits - tl.max(logits, 0))
        return e / tl.sum(e, 0)

    @triton.jit
    def _sparsestmax(logits_ptr, radius, NUM_BRANCHES: tl.constexpr):
        # SparsestMax of the 2 or 3 logits (``sparse_switchable``, the same steps as ``sparsestmax``), as a
        # vector of 4, with what its vector-Jacobian product needs: the support of the sparsemax and its size,
        # the unit direction from the centre and the distance, whether the circle's point is the result, and
        # whether the result is constant (the edge point, the clip or the vertex)
        k = tl.arange(0, 4)
        valid = k < NUM_BRANCHES
        z = tl.load(logits_ptr + k, mask=valid, other=0.0).to(tl.float32)
        z = tl.where(valid, z - tl.max(tl.where(valid, z, float("-inf")), 0), 0.0)
        # [i, j]: entry j against entry i
        at_least = (z[None, :] >= z[:, None]) & valid[None, :]
        count = tl.sum(at_least.to(tl.float32), 1)
        total = tl.sum(tl.where(at_least, z[None, :], 0.0), 1)
        support = (1 + count * z > total) & valid
        size = tl.sum(support.to(tl.float32), 0)
        tau = (tl.sum(tl.where(support, z, 0.0), 0) - 1) / size
        w = tl.where(support, tl.maximum(z - tau, 0.0), 0.0)
        ahead = (z[None, :] > z[:, None]) | ((z[None, :] == z[:, None]) & (k[None, :] < k[:, None]))
        rank = tl.sum((ahead & valid[None, :]).to(tl.int32), 1)
        if NUM_BRANCHES == 3:
            vertex = 0.816496580927726  # sqrt(2/3), the vertices' distance to the centre
        else:
            vertex = 0.7071067811865476
        centre = 1.0 / NUM_BRANCHES
        diff = tl.where(valid, w - centre, 0.0)
        squared = tl.sum(diff * diff, 0)
        at_centre = squared == 0
        distance = tl.sqrt(tl.where(at_centre, 1.0, squared))
        towards_first = tl.where(valid, tl.where(k == 0, 1.0, 0.0) - centre, 0.0) / vertex
        direction = tl.where(at_centre, towards_first, diff / distance)
        inside = tl.where(at_centre, 0.0, distance) < radius
        p = centre + radius * direction
        lowest = tl.min(tl.where(valid, p, 1.0), 0)
        left = lowest < 0
        if NUM_BRANCHES == 3:
            half_chord = tl.sqrt(tl.maximum(2 * radius * radius - 1.0 / 3.0, 0.0))
            edge = tl.where(rank == 0, (1 + half_chord) / 2, tl.where(rank == 1, (1 - half_chord) / 2, 0.0))
            p = tl.where(left, edge, p)
        weights = tl.minimum(tl.maximum(tl.where(inside, p, w), 0.0), 1.0)
        beyond = radius >= vertex
        weights = tl.where(valid, tl.where(beyond, tl.where(rank == 0, 1.0, 0.0), weights), 0.0)
        on_circle = inside & (squared != 0) & (lowest >= 0)
        constant = beyond | (inside & (at_centre | left))
        return weights, rank, support, size, direction, distance, on_circle, constant

    @triton.jit
    def _sparsestmax_vjp(logits_ptr, radius, g, NUM_BRANCHES: tl.constexpr):
        # the gradient of the logits from g, that of the weights: nothing where the result is constant; through
        # the circle's point, (r / d) (I - n n^T) g with n the unit direction; then the sparsemax's backward,
        # g minus its mean over the support, on the support
        k = tl.arange(0, 4)
        _, _, support, size, n, distance, on_circle, constant = _sparsestmax(logits_ptr, radius, NUM_BRANCHES)
        g = tl.where(k < NUM_BRANCHES, g, 0.0)
        g_w = tl.where(on_circle, radius / distance * (g - n * tl.sum(n * g, 0)), g)
        g_w = tl.where(constant, 0.0, g_w)
        return tl.where(support, g_w - tl.sum(tl.where(support, g_w, 0.0), 0) / size, 0.0)

    @triton.jit
    def _branch_weights(logits_ptr, fixed_ptr, radius_ptr, NUM_BRANCHES: tl.constexpr, MAPPING: tl.constexpr):
        # the importance weights of the 2 or 3 branches [IN, LN, BN] (MAPPING: SN's softmax, or SSN's
        # SparsestMax, the one-hot vector of the branch once fixed), as three scalars (BN's 0 without the branch)
        k = tl.arange(0, 4)
        if MAPPING == SPARSESTMAX:
            w, _, _, _, _, _, _, _ = _sparsestmax(logits_ptr, tl.load(radius_ptr).to(tl.float32), NUM_BRANCHES)
            fixed = tl.load(fixed_ptr)
            w = tl.where(fixed >= 0, tl.where(k == fixed, 1.0, 0.0), w)
        else:
            w = _softmax(logits_ptr, NUM_BRANCHES)
        return (
            tl.sum(tl.where(k == 0, w, 0.0), 0),
            tl.sum(tl.where(k == 1, w, 0.0), 0),
            tl.sum(tl.where(k == 2, w, 0.0), 0),
        )

    @triton.jit
    def _fix_one_hot(logits_ptr, fixed_ptr, fixed_at_ptr, iteration_ptr, radius_ptr, pid, NUM_BRANCHES: tl.constexpr):
        # SSN's rule of a training forward: weights that are one-hot now (largest - smallest >= 1) are fixed to
        # their branch, at the schedule's iteration; stored by the first program (a program that reads the new
        # value computes the same weights: the one-hot vector of that branch)
        k = tl.arange(0, 4)
        valid = k < NUM_BRANCHES
        w, rank, _, _, _, _, _, _ = _sparsestmax(logits_ptr, tl.load(radius_ptr).to(tl.float32), NUM_BRANCHES)
        one_hot = tl.max(tl.where(valid, w, 0.0), 0) - tl.min(tl.where(valid, w, 1.0), 0) >= 1
        newly = one_hot & (tl.load(fixed_ptr) < 0) & (pid == 0)
        choice = tl.sum(tl.where(valid & (rank == 0), k, 0), 0).to(tl.int64)
        tl.store(fixed_ptr, choice, mask=newly)
        tl.store(fixed_at_ptr, tl.load(iteration_ptr), mask=newly)

    @triton.jit
    def _logit_gradients(
        grad_ptr, logits_ptr, fixed_ptr, radius_ptr, g0, g1, g2, pid, NUM_BRANCHES: tl.constexpr, MAPPING: tl.constexpr
    ):
        # the backward of the mapping from the weights' gradients g, stored by the first program: the softmax's,
        # grad logit_j = w_j (g_j - sum_k w_k g_k); SparsestMax's vector-Jacobian product, 0 once fixed
        k = tl.arange(0, 4)
        g = tl.where(k == 0, g0, tl.where(k == 1, g1, g2))
        if MAPPING == SPARSESTMAX:
            grad = _sparsestmax_vjp(logits_ptr, tl.load(radius_ptr).to(tl.float32), g, NUM_BRANCHES)
            grad = tl.where(tl.load(fixed_ptr) >= 0, 0.0, grad)
        else:
            w = _softmax(logits_ptr, NUM_BRANCHES)
            grad = w * (g - tl.sum(w * g, 0))
        tl.store(grad_ptr + k, grad, mask=(k < NUM_BRANCHES) & (pid == 0))

    @triton.jit
    def _to_pair_mean(k, d, m):
        # mu - m for mu = k + d, the pair never rounded to one float32 (module docstring, "Accuracy")
        return d - (m - k)

    @triton.jit
    def _layer_moments(mean_ptr, var_ptr, rows, row_mask, N, C, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        # mu_ln = k + d and var_ln of the samples ``rows`` over all channels, two-pass; k is each sample's
        # channel 0
        k = tl.load(mean_ptr + rows * C, mask=row_mask, other=0.0)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < C)[None, :]
            m = tl.load(mean_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
            total += tl.sum(tl.where(mask, m - k[:, None], 0.0), 1)
        d = total / C
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < C)[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
            v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
            deviation = tl.where(mask, _to_pair_mean(k[:, None], d[:, None], m), 0.0)
            total += tl.sum(v + deviation * deviation, 1)
        return k, d, total / C

    @triton.jit
    def _pooled_sums_kernel(moments_ptr, pooled_ptr, N, C, spatial, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        # this process's float64 [count, sum of x (C), sum of x^2 (C)] of the channels, from the IN moments:
        # what the processes add up (``running.group_sums``)
        mean_ptr, var_ptr = moments_ptr, moments_ptr + N * C
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        total = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float64)
        total_sq = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float64)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < N)[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0).to(tl.float64)
            total += m
            total_sq += tl.load(var_ptr + offsets, mask=mask, other=0.0).to(tl.float64) + m * m
        tl.store(pooled_ptr + 1 + cols, tl.sum(total, 0) * spatial, mask=col_mask)
        tl.store(pooled_ptr + 1 + C + cols, tl.sum(total_sq, 0) * spatial, mask=col_mask)
        if pid == 0:
            tl.store(pooled_ptr, (N * spatial).to(tl.float64))

    @triton.jit
    def _pooled_statistics(
        pooled_ptr,
        running_mean_ptr,
        running_var_ptr,
        tracked_ptr,
        cols,
        col_mask,
        C,
        momentum,
        UPDATE_RUNNING: tl.constexpr,
    ):
        # mean and biased variance of the pooled sums (float64, as ``running.moments_from_sums``), and the
        # running statistics moved by them (``kernels``' running update)
        count = tl.load(pooled_ptr)
        safe = tl.maximum(count, 2.2250738585072014e-308)
        mean = tl.load(pooled_ptr + 1 + cols, mask=col_mask, other=0.0) / safe
        var = tl.maximum(tl.load(pooled_ptr + 1 + C + cols, mask=col_mask, other=0.0) / safe - mean * mean, 0.0)
        if UPDATE_RUNNING:
            average_factor = running_factor(tracked_ptr, momentum, (count > 0).to(tl.int64))
            store_running_moments(
                running_mean_ptr, running_var_ptr, cols, col_mask, mean, var, count, average_factor, None, False, False
            )
        return mean.to(tl.float32), var.to(tl.float32)

    @triton.jit
    def _forward_kernel(
        moments_ptr,
        weight_ptr,
        bias_ptr,
        mean_logits_ptr,
        var_logits_ptr,
        radius_ptr,
        iteration_ptr,
        mean_fixed_ptr,
        var_fixed_ptr,
        mean_fixed_at_ptr,
        var_fixed_at_ptr,
        running_mean_ptr,
        running_var_ptr,
        tracked_ptr,
        pooled_ptr,
        affine_ptr,
        N,
        C,
        eps,
        momentum,
        count,
        NUM_BRANCHES: tl.constexpr,
        MAPPING: tl.constexpr,
        FIX: tl.constexpr,
        BN_SOURCE: tl.constexpr,
        UPDATE_RUNNING: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # BN_SOURCE: BATCH (this batch, of ``count`` values per channel), RUNNING (the running statistics) or
        # POOLED (the sums of every process, float64 [count, sum of x (C), sum of x^2 (C)] at pooled_ptr).
        # MAPPING: SOFTMAX (SN), or SPARSESTMAX (SSN, whose radius, fixed branches and the iteration they were
        # fixed at are read from their buffers; with FIX, a training forward, one-hot weights are fixed). The
        # blocks (``kernels``): moments (mean, variance), affine (scale, shift, then this kernel's statistics
        # for the backward)
        mean_ptr, var_ptr = moments_ptr, moments_ptr + N * C
        scale_ptr, shift_ptr, stats_ptr = affine_ptr, affine_ptr + N * C, affine_ptr + 2 * N * C
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        a_in, a_ln, a_bn = _branch_weights(mean_logits_ptr, mean_fixed_ptr, radius_ptr, NUM_BRANCHES, MAPPING)
        b_in, b_ln, b_bn = _branch_weights(var_logits_ptr, var_fixed_ptr, radius_ptr, NUM_BRANCHES, MAPPING)
        if FIX:
            _fix_one_hot(
                mean_logits_ptr, mean_fixed_ptr, mean_fixed_at_ptr, iteration_ptr, radius_ptr, pid, NUM_BRANCHES
            )
            _fix_one_hot(var_logits_ptr, var_fixed_ptr, var_fixed_at_ptr, iteration_ptr, radius_ptr, pid, NUM_BRANCHES)
        gamma = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        beta = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)

        # the BN branch of this program's channels: batch moments (two-pass, mu_bn = k_bn + d_bn with k_bn
        # the first sample's), pooled sums or the running ones (mu_bn = k_bn)
        k_bn = tl.zeros([BLOCK_C], dtype=tl.float32)
        d_bn = tl.zeros([BLOCK_C], dtype=tl.float32)
        var_bn = tl.zeros([BLOCK_C], dtype=tl.float32)
        if NUM_BRANCHES == 3:
            if BN_SOURCE == POOLED:
                k_bn, var_bn = _pooled_statistics(
                    pooled_ptr,
                    running_mean_ptr,
                    running_var_ptr,
                    tracked_ptr,
                    cols,
                    col_mask,
                    C,
                    momentum,
                    UPDATE_RUNNING,
                )
            elif BN_SOURCE == BATCH:
                k_bn = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
                for n0 in range(0, N, BLOCK_N):
                    rows = n0 + tl.arange(0, BLOCK_N)
                    mask = (rows < N)[:, None] & col_mask[None, :]
                    m = tl.load(mean_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
                    d_bn += tl.sum(tl.where(mask, m - k_bn[None, :], 0.0), 0)
                d_bn = d_bn / N
                for n0 in range(0, N, BLOCK_N):
                    rows = n0 + tl.arange(0, BLOCK_N)
                    mask = (rows < N)[:, None] & col_mask[None, :]
                    offsets = rows[:, None] * C + cols[None, :]
                    m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
                    v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
                    deviation = tl.where(mask, _to_pair_mean(k_bn[None, :], d_bn[None, :], m), 0.0)
                    var_bn += tl.sum(v + deviation * deviation, 0)
                var_bn = var_bn / N
                if UPDATE_RUNNING:
                    average_factor = running_factor(tracked_ptr, momentum, 1)
                    store_running_moments(
                        running_mean_ptr,
                        running_var_ptr,
                        cols,
                        col_mask,
                        k_bn + d_bn,
                        var_bn,
                        count,
                        average_factor,
                        None,
                        False,
                        False,
                    )
            else:
                k_bn = tl.load(running_mean_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                var_bn = tl.load(running_var_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            tl.store(stats_ptr + 3 * N + cols, k_bn, mask=col_mask)
            tl.store(stats_ptr + 3 * N + C + cols, d_bn, mask=col_mask)
            tl.store(stats_ptr + 3 * N + 2 * C + cols, var_bn, mask=col_mask)

        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            k_ln, d_ln, var_ln = _layer_moments(mean_ptr, var_ptr, rows, row_mask, N, C, BLOCK_N, BLOCK_C)
            tl.store(stats_ptr + rows, k_ln, mask=row_mask & (pid == 0))
            tl.store(stats_ptr + N + rows, d_ln, mask=row_mask & (pid == 0))
            tl.store(stats_ptr + 2 * N + rows, var_ln, mask=row_mask & (pid == 0))
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
            v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
            to_ln = _to_pair_mean(k_ln[:, None], d_ln[:, None], m)
            offset = a_ln * to_ln + a_bn * _to_pair_mean(k_bn[None, :], d_bn[None, :], m)
            var = b_in * v + b_ln * var_ln[:, None] + b_bn * var_bn[None, :]
            scale = gamma[None, :] / tl.sqrt(var + eps)
            tl.store(scale_ptr + offsets, scale, mask=mask)
            tl.store(shift_ptr + offsets, beta[None, :] - offset * scale, mask=mask)

    @triton.jit
    def _gradient_terms(
        mean_ptr,
        var_ptr,
        dot_ptr,
        total_ptr,
        offsets,
        mask,
        k_ln,
        d_ln,
        var_ln,
        k_bn,
        d_bn,
        var_bn,
        gamma,
        eps,
        a_ln,
        a_bn,
        b_in,
        b_ln,
        b_bn,
    ):
        # per (n, c): v, S, scale, r, E, G, H of the module docstring, and mu_ln - m, mu_bn - m; the LN
        # statistics are the rows', the BN ones the columns'
        m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
        dot = tl.load(dot_ptr + offsets, mask=mask, other=0.0)
        total = tl.load(total_ptr + offsets, mask=mask, other=0.0)
        to_ln = _to_pair_mean(k_ln[:, None], d_ln[:, None], m)
        to_bn = _to_pair_mean(k_bn[None, :], d_bn[None, :], m)
        r = 1.0 / tl.sqrt(b_in * v + b_ln * var_ln[:, None] + b_bn * var_bn[None, :] + eps)
        scale = gamma[None, :] * r
        e = dot - total * (a_ln * to_ln + a_bn * to_bn)
        return v, total, scale, r, e, -0.5 * e * scale * r * r, -total * scale, to_ln, to_bn

    @triton.jit
    def _ln_statistics(stats_ptr, rows, row_mask, N):
        # (k_ln, d_ln, var_ln) of the samples ``rows``, as the forward kernel stored them
        k = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
        d = tl.load(stats_ptr + N + rows, mask=row_mask, other=0.0)
        return k, d, tl.load(stats_ptr + 2 * N + rows, mask=row_mask, other=0.0)

    @triton.jit
    def _bn_statistics(stats_ptr, cols, col_mask, N, C, NUM_BRANCHES: tl.constexpr):
        # (k_bn, d_bn, var_bn) of the channels ``cols``, as the forward kernel stored them (0 without a BN branch)
        k = tl.zeros(cols.shape, dtype=tl.float32)
        d = tl.zeros(cols.shape, dtype=tl.float32)
        var = tl.zeros(cols.shape, dtype=tl.float32)
        if NUM_BRANCHES == 3:
            k = tl.load(stats_ptr + 3 * N + cols, mask=col_mask, other=0.0)
            d = tl.load(stats_ptr + 3 * N + C + cols, mask=col_mask, other=0.0)
            var = tl.load(stats_ptr + 3 * N + 2 * C + cols, mask=col_mask, other=0.0)
        return k, d, var

    @triton.jit
    def _backward_kernel(
        moments_ptr,
        affine_ptr,
        sums_ptr,
        weight_ptr,
        mean_logits_ptr,
        var_logits_ptr,
        radius_ptr,
        mean_fixed_ptr,
        var_fixed_ptr,
        pooled_ptr,
        grad_pooled_ptr,
        pq_ptr,
        grad_weight_ptr,
        grad_bias_ptr,
        grad_mean_logits_ptr,
        grad_var_logits_ptr,
        N,
        C,
        spatial,
        eps,
        NUM_BRANCHES: tl.constexpr,
        MAPPING: tl.constexpr,
        BN_GRAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # BN_GRAD: how the BN statistics pass their gradient on: not at all (RUNNING), within this batch
        # (BATCH), or through the sums of every process: POOLED_SUMS writes this process's gradient of them
        # (float64, as pooled_ptr) and nothing else; once the processes have added those up, POOLED takes
        # them from grad_pooled_ptr. The blocks (``kernels``): moments (mean, variance), affine (its
        # statistics after row 1, as the forward kernel stored them), sums (D, S), pq (p, q)
        mean_ptr, var_ptr = moments_ptr, moments_ptr + N * C
        stats_ptr = affine_ptr + 2 * N * C
        dot_ptr, total_ptr = sums_ptr, sums_ptr + N * C
        p_ptr, q_ptr = pq_ptr, pq_ptr + N * C
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        a_in, a_ln, a_bn = _branch_weights(mean_logits_ptr, mean_fixed_ptr, radius_ptr, NUM_BRANCHES, MAPPING)
        b_in, b_ln, b_bn = _branch_weights(var_logits_ptr, var_fixed_ptr, radius_ptr, NUM_BRANCHES, MAPPING)
        gamma = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        k_bn, d_bn, var_bn = _bn_statistics(stats_ptr, cols, col_mask, N, C, NUM_BRANCHES)

        # sums over the batch for this program's channels
        grad_gamma = tl.zeros([BLOCK_C], dtype=tl.float32)
        grad_beta = tl.zeros([BLOCK_C], dtype=tl.float32)
        sum_g = tl.zeros([BLOCK_C], dtype=tl.float32)
        sum_h = tl.zeros([BLOCK_C], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            mask = row_mask[:, None] & col_mask[None, :]
            k_ln, d_ln, var_ln = _ln_statistics(stats_ptr, rows, row_mask, N)
            v, s, scale, r, e, g, h, to_ln, to_bn = _gradient_terms(
                mean_ptr,
                var_ptr,
                dot_ptr,
                total_ptr,
                rows[:, None] * C + cols[None, :],
                mask,
                k_ln,
                d_ln,
                var_ln,
                k_bn,
                d_bn,
                var_bn,
                gamma,
                eps,
                a_ln,
                a_bn,
                b_in,
                b_ln,
                b_bn,
            )
            grad_gamma += tl.sum(tl.where(mask, e * r, 0.0), 0)
            grad_beta += tl.sum(s, 0)
            sum_g += tl.sum(tl.where(mask, g, 0.0), 0)
            sum_h += tl.sum(tl.where(mask, h, 0.0), 0)
        if BN_GRAD == POOLED_SUMS:
            _pooled_sums_gradient(pooled_ptr, grad_pooled_ptr, cols, col_mask, C, a_bn * sum_h, b_bn * sum_g, pid)
        else:
            tl.store(grad_weight_ptr + cols, grad_gamma, mask=col_mask)
            tl.store(grad_bias_ptr + cols, grad_beta, mask=col_mask)
            _input_and_logit_gradients(
                mean_ptr,
                var_ptr,
                stats_ptr,
                dot_ptr,
                total_ptr,
                weight_ptr,
                mean_logits_ptr,
                var_logits_ptr,
                radius_ptr,
                mean_fixed_ptr,
                var_fixed_ptr,
                grad_pooled_ptr,
                p_ptr,
                q_ptr,
                grad_mean_logits_ptr,
                grad_var_logits_ptr,
                N,
                C,
                spatial,
                eps,
                cols,
                col_mask,
                gamma,
                k_bn,
                d_bn,
                var_bn,
                sum_g,
                sum_h,
                pid,
                a_ln,
                a_bn,
                b_in,
                b_ln,
                b_bn,
                NUM_BRANCHES,
                MAPPING,
                BN_GRAD,
                BLOCK_N,
                BLOCK_C,
            )

    @triton.jit
    def _pooled_sums_gradient(pooled_ptr, grad_pooled_ptr, cols, col_mask, C, grad_mu, grad_var, pid):
        # the gradient of (count, sum of x, sum of x^2) from those of the BN mean and variance, in float64:
        # mean = sum / count, var = sum_sq / count - mean^2 (the count has none)
        safe = tl.maximum(tl.load(pooled_ptr), 2.2250738585072014e-308)
        mean = tl.load(pooled_ptr + 1 + cols, mask=col_mask, other=0.0) / safe
        grad_mu, grad_var = grad_mu.to(tl.float64), grad_var.to(tl.float64)
        tl.store(grad_pooled_ptr + 1 + cols, (grad_mu - 2 * mean * grad_var) / safe, mask=col_mask)
        tl.store(grad_pooled_ptr + 1 + C + cols, grad_var / safe, mask=col_mask)
        if pid == 0:
            tl.store(grad_pooled_ptr, 0.0)

    @triton.jit
    def _input_and_logit_gradients(
        mean_ptr,
        var_ptr,
        stats_ptr,
        dot_ptr,
        total_ptr,
        weight_ptr,
        mean_logits_ptr,
        var_logits_ptr,
        radius_ptr,
        mean_fixed_ptr,
        var_fixed_ptr,
        grad_pooled_ptr,
        p_ptr,
        q_ptr,
        grad_mean_logits_ptr,
        grad_var_logits_ptr,
        N,
        C,
        spatial,
        eps,
        cols,
        col_mask,
        gamma,
        k_bn,
        d_bn,
        var_bn,
        sum_g,
        sum_h,
        pid,
        a_ln,
        a_bn,
        b_in,
        b_ln,
        b_bn,
        NUM_BRANCHES: tl.constexpr,
        MAPPING: tl.constexpr,
        BN_GRAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # per sample: the sums over all channels, then this program's p and q; on the way, the sums over
        # all (n, c) that the logits need
        grad_b_in = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        grad_b_ln = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        grad_b_bn = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        grad_a_ln = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        grad_a_bn = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            k_ln, d_ln, var_ln = _ln_statistics(stats_ptr, rows, row_mask, N)
            row_g = tl.zeros([BLOCK_N], dtype=tl.float32)
            row_h = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c0 in range(0, C, BLOCK_C):
                all_cols = c0 + tl.arange(0, BLOCK_C)
                all_mask = all_cols < C
                mask = row_mask[:, None] & all_mask[None, :]
                all_k_bn, all_d_bn, all_var_bn = _bn_statistics(stats_ptr, all_cols, all_mask, N, C, NUM_BRANCHES)
                all_gamma = tl.load(weight_ptr + all_cols, mask=all_mask, other=0.0).to(tl.float32)
                v, s, scale, r, e, g, h, to_ln, to_bn = _gradient_terms(
                    mean_ptr,
                    var_ptr,
                    dot_ptr,
                    total_ptr,
                    rows[:, None] * C + all_cols[None, :],
                    mask,
                    k_ln,
                    d_ln,
                    var_ln,
                    all_k_bn,
                    all_d_bn,
                    all_var_bn,
                    all_gamma,
                    eps,
                    a_ln,
                    a_bn,
                    b_in,
                    b_ln,
                    b_bn,
                )
                g = tl.where(mask, g, 0.0)
                h = tl.where(mask, h, 0.0)
                row_g += tl.sum(g, 1)
                row_h += tl.sum(h, 1)
                grad_b_in += g * v
                grad_b_ln += g * var_ln[:, None]
                grad_b_bn += g * all_var_bn[None, :]
                grad_a_ln += h * to_ln
                grad_a_bn += h * to_bn
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            v, s, scale, r, e, g, h, to_ln, to_bn = _gradient_terms(
                mean_ptr,
                var_ptr,
                dot_ptr,
                total_ptr,
                offsets,
                mask,
                k_ln,
                d_ln,
                var_ln,
                k_bn,
                d_bn,
                var_bn,
                gamma,
                eps,
                a_ln,
                a_bn,
                b_in,
                b_ln,
                b_bn,
            )
            grad_m = -(a_ln + a_bn) * h - scale * s + (a_ln * row_h[:, None] - 2 * b_ln * row_g[:, None] * to_ln) / C
            grad_v = b_in * g + b_ln * row_g[:, None] / C
            if BN_GRAD == BATCH:
                grad_m += (a_bn * sum_h[None, :] - 2 * b_bn * sum_g[None, :] * to_bn) / N
                grad_v += b_bn * sum_g[None, :] / N
            elif BN_GRAD == POOLED:
                # d sum / dm = HW, d sum_sq / dm = 2 m HW, d sum_sq / dv = HW; combined in float64, where the two
                # terms' large parts cancel
                m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
                grad_sum = tl.load(grad_pooled_ptr + 1 + cols, mask=col_mask, other=0.0)
                grad_sum_sq = tl.load(grad_pooled_ptr + 1 + C + cols, mask=col_mask, other=0.0)
                grad_m += ((grad_sum[None, :] + 2 * m.to(tl.float64) * grad_sum_sq[None, :]) * spatial).to(tl.float32)
                grad_v += (grad_sum_sq * spatial).to(tl.float32)[None, :]
            tl.store(p_ptr + offsets, 2 * grad_v / spatial, mask=mask)
            tl.store(q_ptr + offsets, grad_m / spatial, mask=mask)

        _logit_gradients(
            grad_mean_logits_ptr,
            mean_logits_ptr,
            mean_fixed_ptr,
            radius_ptr,
            0.0,
            tl.sum(tl.sum(grad_a_ln, 1), 0),
            tl.sum(tl.sum(grad_a_bn, 1), 0),
            pid,
            NUM_BRANCHES,
            MAPPING,
        )
        _logit_gradients(
            grad_var_logits_ptr,
            var_logits_ptr,
            var_fixed_ptr,
            radius_ptr,
            tl.sum(tl.sum(grad_b_in, 1), 0),
            tl.sum(tl.sum(grad_b_ln, 1), 0),
            tl.sum(tl.sum(grad_b_bn, 1), 0),
            pid,
            NUM_BRANCHES,
            MAPPING,
        )


def _blocks(n: int, c: int) -> tuple[int, int]:
    block_c = min(next_pow2(c), _MAX_BLOCK_C)
    return min(next_pow2(n), max(_TILE // block_c, 1)), block_c


class SwitchableKernels:
    """SN's (and SSN's: its ``branch_mapping``) kernels for inputs of one signature (``fused.FusedPlan``); with
    ``pooled``, SyncSN's across several processes, whose BN branch pools every process's sums. Each direction
    is one method: the full-size passes of ``kernels.TritonPasses`` around the layer's one (N, C) kernel
    (two and the all-reduces, pooled)."""

    def __init__(self, layer, x: Tensor, pooled: bool = False):
        self.passes = TritonPasses(x)
        n, c, h, w = x.shape
        self.spatial = h * w
        training = layer.training and layer.use_bn
        self.bn_source = (POOLED if pooled else BATCH) if training else RUNNING
        block_n, block_c = _blocks(n, c)
        self.grid = (cdiv(c, block_c),)
        self.stats_size = 3 * n + 3 * c  # what backward needs: k_ln, d_ln, var_ln (N each), k_bn, d_bn, var_bn (C each)
        self.count = float(n * h * w)  # values per channel of this process's batch (pooled sums hold their own)
        # the buffers the kernels read and write, from the layer's buffer dict (attribute lookups cost host time)
        self.running = (
            operator.itemgetter("running_mean", "running_var", "num_batches_tracked") if layer.use_bn else None
        )
        self.sparsity = (  # SSN's
            operator.itemgetter("radius", "iteration", "mean_fixed", "var_fixed", "mean_fixed_at", "var_fixed_at")
            if layer.branch_mapping == "sparsestmax"
            else None
        )
        constants = dict(
            NUM_BRANCHES=3 if layer.use_bn else 2,
            MAPPING=_MAPPINGS[layer.branch_mapping].value,
            BLOCK_N=block_n,
            BLOCK_C=block_c,
        )
        self.fix = self.sparsity is not None and layer.training  # SSN's training forward fixes one-hot weights
        self.forward_constants = dict(
            FIX=self.fix, BN_SOURCE=self.bn_source.value, UPDATE_RUNNING=self.bn_source is not RUNNING, **constants
        )
        self.backward_constants = dict(BN_GRAD=self.bn_source.value, **constants)
        self.pooled_gradient_constants = dict(constants, BN_GRAD=POOLED_SUMS.value)
        self.sums_constants = dict(BLOCK_N=block_n, BLOCK_C=block_c)

    def forward(self, layer, x: Tensor, parameters, save: bool):
        """moments -> the forward kernel (scale, shift, the running statistics; SyncSN's pooled sums first) ->
        scale_shift; saved: the moments block (with residuals), the affine block (with the kernel's statistics
        after its two rows) and the pooled sums."""
        passes = self.passes
        n, c = passes.vector_shape
        buffers = layer._buffers
        running = self.running(buffers) if self.running is not None else None
        sparsity = self.sparsity(buffers) if self.sparsity is not None else None
        moments = passes.moments(x, save)
        affine = passes.block(moments, 2, self.stats_size)
        pooled = moments  # read only when pooled
        if self.bn_source is POOLED:
            # every process's float64 [count, sum of x, sum of x^2] of each channel, added up: the tensor, and the
            # collective, of ``SyncSwitchableNorm2d._reduce``, so that a process whose batch is empty (it runs the
            # autograd path) takes part in the same all-reduce
            pooled = moments.new_empty(2 * c + 1, dtype=torch.float64)
            launch(_pooled_sums_kernel, self.grid, (moments, pooled, n, c, self.spatial), self.sums_constants)
            dist.all_reduce(pooled)
        launch(
            _forward_kernel,
            self.grid,
            (
                moments,
                *parameters,
                *(sparsity or (moments,) * 6),  # read only by SSN
                *(running or (moments,) * 3),
                pooled,
                affine,
                n,
                c,
                layer.eps,
                layer.momentum,
                self.count,
            ),
            self.forward_constants,
        )
        if self.bn_source is not RUNNING:
            written_in_place(*running)
        if self.fix:
            written_in_place(*sparsity[2:])
        return passes.scale_shift(x, affine, moments), (moments, affine, pooled) if save else None

    def backward(self, layer, grad_y: Tensor, x: Tensor, parameters, saved, needs_x: bool, needs_parameters):
        """centered_dot_and_sum -> the backward kernel (p, q and every parameter's gradient; SyncSN's gradient
        of the pooled sums first, added up over the processes) -> grad_input."""
        moments, affine, pooled = saved
        passes = self.passes
        n, c = passes.vector_shape
        weight, bias, mean_weight, var_weight = parameters
        grads = [torch.empty_like(weight), torch.empty_like(bias), torch.empty_like(mean_weight)]
        grads.append(torch.empty_like(var_weight))
        radius, _, mean_fixed, var_fixed, _, _ = self.sparsity(layer._buffers) if self.sparsity else (moments,) * 6
        sums = passes.centered_dot_and_sum(grad_y, x, moments)
        pq = passes.block(moments, 2)
        arguments = (moments, affine, sums, weight, mean_weight, var_weight, radius, mean_fixed, var_fixed, pooled)
        grad_pooled = moments  # read only when pooled
        if self.bn_source is POOLED:  # this process's gradient of the pooled sums, added up as the autograd path does
            grad_pooled = torch.empty_like(pooled)
            launch(
                _backward_kernel,
                self.grid,
                (*arguments, grad_pooled, pq, *grads, n, c, float(self.spatial), layer.eps),
                self.pooled_gradient_constants,
            )
            dist.all_reduce(grad_pooled)
        launch(
            _backward_kernel,
            self.grid,
            (*arguments, grad_pooled, pq, *grads, n, c, float(self.spatial), layer.eps),
            self.backward_constants,
        )
        return passes.grad_input(grad_y, x, affine, pq, moments, True) if needs_x else None, grads


class SwitchableClosedForms:
    """SN's closed forms as tensor operations, for inputs of one signature (``fused.FusedPlan``; the module
    docstring's equations, in the statistics dtype), around ``map_passes.TorchPasses``."""

    def __init__(self, layer, x: Tensor):
        n, _, h, w = x.shape
        self.spatial = h * w
        self.batch_stats = layer.training and layer.use_bn
        self.count = float(n * h * w)
        self.fix = layer.branch_mapping == "sparsestmax" and layer.training  # SSN's rule, as the kernels'

    def forward(self, layer, x: Tensor, parameters, save: bool):
        if self.fix and not is_replaying():
            layer.fix_one_hot_weights(stat_dtype(x))
        moments = TorchPasses.moments(x, save)
        affine, saved = self._statistics(layer, parameters, moments)
        return TorchPasses.scale_shift(x, affine, moments), (moments, affine, saved) if save else None

    def _statistics(self, layer, parameters, moments):
        mean, var = moments[0], moments[1]
        weight, bias = parameters[:2]
        a, b = layer.branch_weights(mean.dtype)
        mu_ln = mean.mean(1, keepdim=True)
        to_ln = mu_ln - mean
        var_ln = var.mean(1, keepdim=True) + to_ln.square().mean(1, keepdim=True)
        offset, mixed = a[1] * to_ln, b[0] * var + b[1] * var_ln
        to_bn = var_bn = mean.new_zeros(())
        if layer.use_bn:
            running_mean, running_var, _ = running = layer.running_buffers()
            if self.batch_stats:
                mu_bn = mean.mean(0)
                to_bn = mu_bn - mean
                var_bn = var.mean(0) + to_bn.square().mean(0)
                count = mean.new_full((), self.count)
                update_running_moments(*running, mu_bn, var_bn, count, layer.momentum, False, False)
            else:
                to_bn = running_mean.to(mean.dtype) - mean
                var_bn = running_var.to(mean.dtype)
            offset, mixed = offset + a[2] * to_bn, mixed + b[2] * var_bn
        r = torch.rsqrt(mixed + layer.eps)
        scale = weight.to(mean.dtype) * r
        shift = bias.to(mean.dtype) - offset * scale
        return (scale, shift), (r, offset, to_ln, var_ln, to_bn, var_bn, a, b)

    def backward(self, layer, grad_y: Tensor, x: Tensor, parameters, saved, needs_x: bool, needs_parameters):
        moments, affine, saved = saved
        mean, var = moments[0], moments[1]
        scale = affine[0]
        dot, total = TorchPasses.centered_dot_and_sum(grad_y, x, moments)
        r, offset, to_ln, var_ln, to_bn, var_bn, a, b = saved
        n, c = mean.shape
        e = dot - total * offset
        g = -0.5 * e * scale * r.square()
        h = -total * scale
        row_g, row_h = g.sum(1, keepdim=True), h.sum(1, keepdim=True)
        grad_a = [mean.new_zeros(()), (h * to_ln).sum()]
        grad_b = [(g * var).sum(), (g * var_ln).sum()]
        # -(a_ln + a_bn) H - scale S = a_in H, as H = -scale S
        grad_m = a[0] * h + (a[1] * row_h - 2 * b[1] * row_g * to_ln) / c
        grad_v = b[0] * g + b[1] * row_g / c
        if layer.use_bn:
            grad_a.append((h * to_bn).sum())
            grad_b.append((g * var_bn).sum())
            if self.batch_stats:
                column_g, column_h = g.sum(0), h.sum(0)
                grad_m = grad_m + (a[2] * column_h - 2 * b[2] * column_g * to_bn) / n
                grad_v = grad_v + b[2] * column_g / n
        grads = [(e * r).sum(0), total.sum(0), *layer.logit_gradients(a, b, torch.stack(grad_a), torch.stack(grad_b))]
        grads = [grad.to(parameter.dtype) for grad, parameter in zip(grads, parameters)]
        pq = (2 * grad_v / self.spatial, grad_m / self.spatial)
        return TorchPasses.grad_input(grad_y, x, affine, pq, moments, True) if needs_x else None, grads
