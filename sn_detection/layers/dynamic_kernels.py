"""Dynamic Normalization's (N, C) statistics in one forward and two backward kernels (``moment_normalizer``).

Notation: m, v (N, C) the IN moments, P = H * W, b the hard batch gate and g_j the hard gate of channel
level j (1[logit > 0], read from the logits on the device: no branch of the host depends on them), L the
number of channel levels. Level j averages along one channel sub-axis (``dynamic``): its operator A_j
averages each channel with the channels that differ from it in that sub-axis only, S_j of them (itself
included) at channel stride T_j:

    odd factor r > 1 (level 0):   S = r, T = 1            (r contiguous channels)
    bit k of the 2^k part:        S = 2, T = r * 2^k      (c and c +- r 2^k; c XOR 2^k when r = 1)

L, r and every (S_j, T_j) are compile-time constants. A_j is symmetric and idempotent.

Forward. Each level is a mixture step on a state (M, V), with Delta = A M - M:

    M' = M + g Delta
    V' = (1 - g) V + g W + g (1 - g) Delta^2,    W = A V + A(Delta^2)

(squares elementwise: A(Delta^2) is the spread of the group's means, W the group's pooled variance).

The batch level (the first) is the same step with A = the average over the N samples in training
(W = B_v, the batch's biased variance) or the constant target (running_mean, running_var) in evaluation.
The state starts at (m, v) and ends at (M_L, V_L), and

    r_L = (V_L + eps)^(-1/2),   scale = gamma r_L,   shift = beta - (M_L - m) scale.

With hard gates the g (1 - g) terms vanish, and each step either keeps the state (g = 0) or replaces it by
the group's pooled moments (g = 1). For accuracy the state's mean is kept as the offset O = M - m from the
sample's own IN mean, and Delta is computed from differences of neighbours, never from a rounded large
pooled mean:

    Delta[c] = mean_{c' in group(c)} e_{c'},   e_{c'} = (m[c'] - m[c]) + (O[c'] - O[c]) = M[c'] - M[c],
    A(Delta^2)[c] = mean_{c'} (e_{c'} - Delta[c])^2                      (M[c'] - A M = e_{c'} - Delta[c]),

and over the batch Delta_b = mean_n (m - k) - (m - k) and B_v = mean_n (v + (m - k - mean_n (m - k))^2)
with the shift k = m[0, c] per channel. m[c'] - m[c] and m - k are exact when the values are close
(Sterbenz), so a channel mean of 1e4 times the spread costs no digits: the offset, the only place the
output sees the pooled mean, keeps fp32 accuracy relative to the spread. (The running mean stored is
k + mean_n (m - k).)

Backward. The output's gradients are D with respect to scale and S with respect to shift; the centring at
m (-scale S) and shift's own dependence on m (+scale S) cancel, so everything reaches m and v through
(M_L, V_L):

    E = D - S (M_L - m),   grad gamma = sum_n E r_L,   grad beta = sum_n S,
    G_M = -S scale,        G_V = -E scale r_L^2 / 2                      (gradients of M_L, V_L).

A step's adjoint at a hard gate, from (G_M', G_V') of its output. A is symmetric (A^T = A) and A Delta = 0,
so the gradient of g A(Delta^2) with respect to M is 2 g (A - I)(Delta A G_V') = -2 g Delta A G_V' (A G_V'
is constant on a group); the g (1 - g) Delta^2 term contributes 2 g (1 - g) (A - I)(Delta G_V'), zero at
g in {0, 1}:

    g = 0:   G_M = G_M',                       G_V = G_V'
    g = 1:   G_M = A G_M' - 2 Delta A G_V',    G_V = A G_V'

and its straight-through gate gradient, the derivative of the mixture formula with respect to a real g
at the hard value (where g (1 - g) Delta^2 still contributes (1 - 2g) Delta^2):

    dL/dg = sum_{n, c} [ G_M' Delta + G_V' X ],   X = W - V + (1 - 2g) Delta^2.

The batch level in evaluation has a constant target: G_m = (1 - b) G_M1, G_v = (1 - b) G_V1. Then
grad_x = grad_y * scale + (x - m) p + q with p = 2 G_v / P and q = G_m / P (``moment_normalizer``); the logits'
gradients are the gates' (the straight-through estimator's identity).

Programs. The channel levels couple the channels of one sample, the batch level the samples of one
channel, so:

- forward, one launch, one program per block of BLOCK_N samples (the rows of its [BLOCK_N, BLOCK_C]
  tiles): it computes the batch moments of every channel itself (a read of the (N, C) moments per
  program, cheap next to a launch), walks the levels over its rows, BLOCK_C channels at a time, storing
  each state (O_j, V_j) to a scratch plane in global memory and reading a channel's group members back
  after ``tl.debug_barrier()`` (a program reads only its own rows, and each level writes a new plane, so
  no read races a write), and writes scale, shift and, for the backward, Delta_j and X_j of every level.
  Program 0 alone moves the running statistics (``kernels``' running update).
- backward, launch 1, the same programs: the levels in reverse, the same scratch-plane scheme for A G',
  giving (G_M1, G_V1) after the batch level and each sample's share of every gate's gradient (N, L + 1).
- backward, launch 2, one program per block of channels: the batch level's adjoint (its means over n of
  G_M1, G_V1), p and q, grad gamma and grad beta; program 0 sums the gates' shares over the samples.
  Sums over the batch need every sample's result, hence the second launch (no atomics: deterministic).

Everything is float32 (fp16 / bf16 parameters and buffers are widened, and their gradients and updates
stored in their dtype); variances are two-pass or pooled by the law of total variance. The kernels apply
to any C whose blocks, the largest (4 L + 6) * N * C float32 values, are indexed in int32; beyond
(``DynamicKernels.applies``) and during a running batch average, the layer keeps the autograd path.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

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

_MAX_CHUNK = 1024  # channels of one tile of the per-sample kernels
_TILE = 2048  # elements of one [BLOCK_N, BLOCK_C] tile
_MAX_BLOCK_C = 64  # channels per program of the batch-level backward


if triton is not None:

    @triton.jit
    def _level_geometry(j: tl.constexpr, ODD: tl.constexpr):
        # (S, T) of channel level j: the odd factor first (when ODD > 1), then the bits of the 2^k part
        HAS_ODD: tl.constexpr = 1 if ODD > 1 else 0
        SIZE: tl.constexpr = ODD if j < HAS_ODD else 2
        STRIDE: tl.constexpr = 1 if j < HAS_ODD else ODD * 2 ** (j - HAS_ODD)
        return SIZE, STRIDE

    @triton.jit
    def _members(cols, SIZE: tl.constexpr, STRIDE: tl.constexpr):
        # the first channel of each channel's group along the level's sub-axis
        return cols - ((cols // STRIDE) % SIZE) * STRIDE

    @triton.jit
    def _batch_moments(mean_ptr, var_ptr, cols, col_mask, N, C, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        # per channel: the shift k = m[0, c], mean_n (m - k) and the biased batch variance, two-pass
        k = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
        total = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < N)[:, None] & col_mask[None, :]
            m = tl.load(mean_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
            total += tl.where(mask, m - k[None, :], 0.0)
        shifted_mean = tl.sum(total, 0) / N
        total = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < N)[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
            v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
            d = m - k[None, :] - shifted_mean[None, :]
            total += tl.where(mask, v + d * d, 0.0)
        return k, shifted_mean, tl.sum(total, 0) / N

    @triton.jit
    def _forward_kernel(
        moments_ptr,
        weight_ptr,
        bias_ptr,
        gates_ptr,
        batch_gate_ptr,
        running_mean_ptr,
        running_var_ptr,
        tracked_ptr,
        affine_ptr,
        N,
        C,
        eps,
        momentum,
        count,
        NUM_LEVELS: tl.constexpr,
        ODD: tl.constexpr,
        BATCH_STATS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # One program: BLOCK_N samples. The blocks (``kernels``): moments (m, v), affine (scale, shift,
        # then the state planes). Planes of state_ptr, each (N, C): 0 Delta_b, 1 X_b; 2 + 2j, 3 + 2j the
        # state (O_j, V_j) before channel level j (j = L: the final one); 4 + 2L + 2j, 5 + 2L + 2j Delta_j,
        # X_j.
        pid = tl.program_id(0)
        plane = N * C
        mean_ptr, var_ptr = moments_ptr, moments_ptr + plane
        scale_ptr, shift_ptr, state_ptr = affine_ptr, affine_ptr + plane, affine_ptr + 2 * plane
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        row_base = rows[:, None] * C
        b_on = tl.load(batch_gate_ptr).to(tl.float32) > 0
        b = b_on.to(tl.float32)
        if BATCH_STATS:  # a batch of ``count`` values per channel
            average_factor = running_factor(tracked_ptr, momentum, 1)

        # the batch level
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_mask = cols < C
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = row_base + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
            v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
            if BATCH_STATS:
                k, shifted_mean, target_var = _batch_moments(mean_ptr, var_ptr, cols, col_mask, N, C, BLOCK_N, BLOCK_C)
                delta = shifted_mean[None, :] - (m - k[None, :])
                first = col_mask & (pid == 0)  # program 0 records the batch
                store_running_moments(
                    running_mean_ptr,
                    running_var_ptr,
                    cols,
                    first,
                    k + shifted_mean,
                    target_var,
                    count,
                    average_factor,
                    None,
                    False,
                    False,
                )
            else:
                target_mean = tl.load(running_mean_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                target_var = tl.load(running_var_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                delta = target_mean[None, :] - m
            target_var = target_var[None, :]
            tl.store(state_ptr + offsets, delta, mask=mask)
            tl.store(state_ptr + plane + offsets, target_var - v + (1 - 2 * b) * delta * delta, mask=mask)
            tl.store(state_ptr + 2 * plane + offsets, tl.where(b_on, delta, 0.0), mask=mask)
            tl.store(state_ptr + 3 * plane + offsets, tl.where(b_on, target_var, v), mask=mask)
        tl.debug_barrier()

        # the channel levels, finest first; each reads plane pair j and writes pair j + 1
        for j in tl.static_range(NUM_LEVELS):
            SIZE, STRIDE = _level_geometry(j, ODD)
            g_on = tl.load(gates_ptr + j).to(tl.float32) > 0
            g = g_on.to(tl.float32)
            offset_in = state_ptr + (2 + 2 * j) * plane + row_base
            var_in = state_ptr + (3 + 2 * j) * plane + row_base
            level = state_ptr + (4 + 2 * NUM_LEVELS + 2 * j) * plane + row_base
            for c0 in range(0, C, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                mask = row_mask[:, None] & (cols < C)[None, :]
                m = tl.load(mean_ptr + row_base + cols[None, :], mask=mask, other=0.0)
                o = tl.load(offset_in + cols[None, :], mask=mask, other=0.0)
                v = tl.load(var_in + cols[None, :], mask=mask, other=0.0)
                first = _members(cols, SIZE, STRIDE)
                sum_e = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
                sum_v = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
                for i in range(SIZE):
                    other = (first + i * STRIDE)[None, :]
                    m_i = tl.load(mean_ptr + row_base + other, mask=mask, other=0.0)
                    o_i = tl.load(offset_in + other, mask=mask, other=0.0)
                    sum_e += (m_i - m) + (o_i - o)
                    sum_v += tl.load(var_in + other, mask=mask, other=0.0)
                delta = sum_e / SIZE
                spread = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
                for i in range(SIZE):
                    other = (first + i * STRIDE)[None, :]
                    m_i = tl.load(mean_ptr + row_base + other, mask=mask, other=0.0)
                    o_i = tl.load(offset_in + other, mask=mask, other=0.0)
                    d = (m_i - m) + (o_i - o) - delta
                    spread += d * d
                pooled_var = sum_v / SIZE + spread / SIZE
                tl.store(offset_in + 2 * plane + cols[None, :], tl.where(g_on, o + delta, o), mask=mask)
                tl.store(var_in + 2 * plane + cols[None, :], tl.where(g_on, pooled_var, v), mask=mask)
                tl.store(level + cols[None, :], delta, mask=mask)
                tl.store(level + plane + cols[None, :], pooled_var - v + (1 - 2 * g) * delta * delta, mask=mask)
            tl.debug_barrier()

        # the affine of the final state
        final = state_ptr + (2 + 2 * NUM_LEVELS) * plane
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_mask = cols < C
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = row_base + cols[None, :]
            o = tl.load(final + offsets, mask=mask, other=0.0)
            v = tl.load(final + plane + offsets, mask=mask, other=0.0)
            gamma = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            beta = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            scale = gamma[None, :] / tl.sqrt(v + eps)
            tl.store(scale_ptr + offsets, scale, mask=mask)
            tl.store(shift_ptr + offsets, beta[None, :] - o * scale, mask=mask)

    @triton.jit
    def _output_gradients(dot_ptr, total_ptr, scale_ptr, final_ptr, offsets, mask, plane, eps):
        # per (n, c): S, E r_L and the gradients G_M, G_V of the final state (module docstring); the
        # forward's very scale, so that G_M cancels the output's own -scale S exactly where it should
        dot = tl.load(dot_ptr + offsets, mask=mask, other=0.0)
        total = tl.load(total_ptr + offsets, mask=mask, other=0.0)
        scale = tl.load(scale_ptr + offsets, mask=mask, other=0.0)
        o = tl.load(final_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(final_ptr + plane + offsets, mask=mask, other=0.0)
        r = 1.0 / tl.sqrt(v + eps)
        e = dot - total * o
        return total, e * r, -total * scale, -0.5 * e * scale * r * r

    @triton.jit
    def _levels_backward_kernel(
        sums_ptr,
        affine_ptr,
        gates_ptr,
        pq_ptr,
        N,
        C,
        eps,
        NUM_LEVELS: tl.constexpr,
        ODD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # One program: BLOCK_N samples. The blocks: sums (D, S), affine (the forward's), pq (p, q, then the
        # planes of grad_ptr and partial_ptr). Planes of grad_ptr: 2j, 2j + 1 the gradients (G_M, G_V) of
        # the state before channel level j (j = L: the final state). partial_ptr (N, L + 1): each sample's
        # share of each channel gate's gradient, then of the batch gate's.
        pid = tl.program_id(0)
        plane = N * C
        dot_ptr, total_ptr, scale_ptr, state_ptr = sums_ptr, sums_ptr + plane, affine_ptr, affine_ptr + 2 * plane
        grad_ptr, partial_ptr = pq_ptr + 2 * plane, pq_ptr + (2 * NUM_LEVELS + 4) * plane
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        row_base = rows[:, None] * C
        final = state_ptr + (2 + 2 * NUM_LEVELS) * plane
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < C)[None, :]
            offsets = row_base + cols[None, :]
            _, _, grad_m, grad_v = _output_gradients(dot_ptr, total_ptr, scale_ptr, final, offsets, mask, plane, eps)
            tl.store(grad_ptr + 2 * NUM_LEVELS * plane + offsets, grad_m, mask=mask)
            tl.store(grad_ptr + (2 * NUM_LEVELS + 1) * plane + offsets, grad_v, mask=mask)
        tl.debug_barrier()

        for j in tl.static_range(NUM_LEVELS - 1, -1, -1):
            SIZE, STRIDE = _level_geometry(j, ODD)
            g_on = tl.load(gates_ptr + j).to(tl.float32) > 0
            grad_m_out = grad_ptr + (2 * j + 2) * plane + row_base
            grad_v_out = grad_ptr + (2 * j + 3) * plane + row_base
            level = state_ptr + (4 + 2 * NUM_LEVELS + 2 * j) * plane + row_base
            gate_sum = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
            for c0 in range(0, C, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                mask = row_mask[:, None] & (cols < C)[None, :]
                gm = tl.load(grad_m_out + cols[None, :], mask=mask, other=0.0)
                gv = tl.load(grad_v_out + cols[None, :], mask=mask, other=0.0)
                delta = tl.load(level + cols[None, :], mask=mask, other=0.0)
                x = tl.load(level + plane + cols[None, :], mask=mask, other=0.0)
                gate_sum += gm * delta + gv * x
                first = _members(cols, SIZE, STRIDE)
                sum_m = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
                sum_v = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
                for i in range(SIZE):
                    other = (first + i * STRIDE)[None, :]
                    sum_m += tl.load(grad_m_out + other, mask=mask, other=0.0)
                    sum_v += tl.load(grad_v_out + other, mask=mask, other=0.0)
                mean_gm = sum_m / SIZE
                mean_gv = sum_v / SIZE
                # into the planes of the state before this level
                grad_m_in = tl.where(g_on, mean_gm - 2 * delta * mean_gv, gm)
                tl.store(grad_m_out - 2 * plane + cols[None, :], grad_m_in, mask=mask)
                tl.store(grad_v_out - 2 * plane + cols[None, :], tl.where(g_on, mean_gv, gv), mask=mask)
            tl.store(partial_ptr + rows * (NUM_LEVELS + 1) + j, tl.sum(gate_sum, 1), mask=row_mask)
            tl.debug_barrier()

        # each sample's share of the batch gate's gradient, from the gradients after the batch level
        gate_sum = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < C)[None, :]
            offsets = row_base + cols[None, :]
            gm = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
            gv = tl.load(grad_ptr + plane + offsets, mask=mask, other=0.0)
            delta = tl.load(state_ptr + offsets, mask=mask, other=0.0)
            x = tl.load(state_ptr + plane + offsets, mask=mask, other=0.0)
            gate_sum += gm * delta + gv * x
        tl.store(partial_ptr + rows * (NUM_LEVELS + 1) + NUM_LEVELS, tl.sum(gate_sum, 1), mask=row_mask)

    @triton.jit
    def _batch_backward_kernel(
        sums_ptr,
        affine_ptr,
        batch_gate_ptr,
        pq_ptr,
        grad_weight_ptr,
        grad_bias_ptr,
        grad_gates_ptr,
        grad_batch_gate_ptr,
        N,
        C,
        spatial,
        eps,
        NUM_LEVELS: tl.constexpr,
        BATCH_STATS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        # One program: BLOCK_C channels over the whole batch; the blocks as in _levels_backward_kernel.
        pid = tl.program_id(0)
        plane = N * C
        dot_ptr, total_ptr, scale_ptr, state_ptr = sums_ptr, sums_ptr + plane, affine_ptr, affine_ptr + 2 * plane
        p_ptr, q_ptr = pq_ptr, pq_ptr + plane
        grad_ptr, partial_ptr = pq_ptr + 2 * plane, pq_ptr + (2 * NUM_LEVELS + 4) * plane
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        b_on = tl.load(batch_gate_ptr).to(tl.float32) > 0
        final = state_ptr + (2 + 2 * NUM_LEVELS) * plane

        grad_gamma = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        grad_beta = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        sum_gm = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        sum_gv = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < N)[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            total, er, _, _ = _output_gradients(dot_ptr, total_ptr, scale_ptr, final, offsets, mask, plane, eps)
            grad_gamma += tl.where(mask, er, 0.0)
            grad_beta += total
            sum_gm += tl.load(grad_ptr + offsets, mask=mask, other=0.0)
            sum_gv += tl.load(grad_ptr + plane + offsets, mask=mask, other=0.0)
        tl.store(grad_weight_ptr + cols, tl.sum(grad_gamma, 0), mask=col_mask)
        tl.store(grad_bias_ptr + cols, tl.sum(grad_beta, 0), mask=col_mask)
        mean_gm = tl.sum(sum_gm, 0) / N
        mean_gv = tl.sum(sum_gv, 0) / N

        # the batch level's adjoint: U is symmetric, so A G is the mean over the batch (training)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows < N)[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            gm = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
            gv = tl.load(grad_ptr + plane + offsets, mask=mask, other=0.0)
            if BATCH_STATS:
                delta = tl.load(state_ptr + offsets, mask=mask, other=0.0)
                pooled_gm = mean_gm[None, :] - 2 * delta * mean_gv[None, :]
                pooled_gv = mean_gv[None, :] + tl.zeros_like(gv)
            else:  # the running statistics are constants
                pooled_gm = tl.zeros_like(gm)
                pooled_gv = tl.zeros_like(gv)
            gm = tl.where(b_on, pooled_gm, gm)
            gv = tl.where(b_on, pooled_gv, gv)
            tl.store(p_ptr + offsets, 2 * gv / spatial, mask=mask)
            tl.store(q_ptr + offsets, gm / spatial, mask=mask)

        if pid == 0:  # the gates' gradients: the sum of the samples' shares
            levels = tl.arange(0, BLOCK_L)
            sums = tl.zeros([BLOCK_N, BLOCK_L], dtype=tl.float32)
            for n0 in range(0, N, BLOCK_N):
                rows = n0 + tl.arange(0, BLOCK_N)
                mask = (rows < N)[:, None] & (levels <= NUM_LEVELS)[None, :]
                sums += tl.load(partial_ptr + rows[:, None] * (NUM_LEVELS + 1) + levels[None, :], mask=mask, other=0.0)
            gate_sums = tl.sum(sums, 0)
            tl.store(grad_gates_ptr + levels, gate_sums, mask=levels < NUM_LEVELS)
            tl.store(grad_batch_gate_ptr + levels * 0, gate_sums, mask=levels == NUM_LEVELS)


class DynamicKernels:
    """DN's kernels for inputs of one signature (``fused.FusedPlan``): each direction one method, the full-size
    passes of ``kernels.TritonPasses`` around the layer's (N, C) kernels."""

    def __init__(self, layer, x: Tensor):
        self.passes = TritonPasses(x)
        n, c, h, w = x.shape
        self.spatial = float(h * w)
        self.training = layer.training
        self.running = operator.itemgetter("running_mean", "running_var", "num_batches_tracked")
        levels = self.num_levels = len(layer._gated_sizes)
        odd = layer._subaxis_shape[-1]
        # the per-sample kernels' tiles: [BLOCK_N samples of a program, BLOCK_C channels]
        block_c = min(next_pow2(c), _MAX_CHUNK)
        block_n = min(next_pow2(n), max(_TILE // block_c, 1))
        self.sample_grid = (cdiv(n, block_n),)
        self.state_size = (4 * levels + 4) * n * c  # after the affine block's scale and shift
        self.backward_size = (2 * levels + 2) * n * c + n * (levels + 1)  # after the pq block's p and q
        self.count = float(n * h * w)  # values per channel of the batch
        self.forward_constants = dict(
            NUM_LEVELS=levels, ODD=odd, BATCH_STATS=self.training, BLOCK_N=block_n, BLOCK_C=block_c
        )
        self.levels_constants = dict(NUM_LEVELS=levels, ODD=odd, BLOCK_N=block_n, BLOCK_C=block_c)
        block_l = next_pow2(levels + 1)
        block_c = min(next_pow2(c), _MAX_BLOCK_C)
        block_n = min(next_pow2(n), max(_TILE // max(block_c, block_l), 1))
        self.channel_grid = (cdiv(c, block_c),)
        self.batch_constants = dict(
            NUM_LEVELS=levels, BATCH_STATS=self.training, BLOCK_N=block_n, BLOCK_C=block_c, BLOCK_L=block_l
        )

    @staticmethod
    def applies(layer, x: Tensor) -> bool:
        """Whether the kernels take this input: every block indexed in int32 (the affine block, scale and
        shift and the state planes, is the largest)."""
        n, c = x.shape[:2]
        planes = 4 * len(layer._gated_sizes) + 6
        return planes * n * c < 2**31

    def forward(self, layer, x: Tensor, parameters, save: bool):
        """moments -> the forward kernel (scale, shift, the levels' states, the running statistics) ->
        scale_shift; saved: the moments block and the affine block."""
        weight, bias, channel_gates, batch_gate = parameters
        passes = self.passes
        n, c = passes.vector_shape
        gates = channel_gates if self.num_levels else batch_gate  # never read when there are none
        running = self.running(layer._buffers)
        moments = passes.moments(x, save)
        affine = passes.block(moments, 2, self.state_size)
        launch(
            _forward_kernel,
            self.sample_grid,
            (moments, weight, bias, gates, batch_gate, *running, affine, n, c, layer.eps, layer.momentum, self.count),
            self.forward_constants,
        )
        if self.training:
            written_in_place(*running)
        return passes.scale_shift(x, affine, moments), (moments, affine) if save else None

    def backward(self, layer, grad_y: Tensor, x: Tensor, parameters, saved, needs_x: bool, needs_parameters):
        """centered_dot_and_sum -> the levels' backward kernel -> the batch level's backward kernel (p, q and
        every parameter's gradient) -> grad_input."""
        moments, affine = saved
        weight, bias, channel_gates, batch_gate = parameters
        passes = self.passes
        n, c = passes.vector_shape
        levels = self.num_levels
        grads = [torch.empty_like(weight), torch.empty_like(bias), torch.empty_like(channel_gates)]
        grads.append(torch.empty_like(batch_gate))
        gates = channel_gates if levels else batch_gate  # never read when there are none
        grad_gates = grads[2] if levels else grads[3]  # never written when there are none
        sums = passes.centered_dot_and_sum(grad_y, x, moments)
        pq = passes.block(moments, 2, self.backward_size)
        launch(
            _levels_backward_kernel, self.sample_grid, (sums, affine, gates, pq, n, c, layer.eps), self.levels_constants
        )
        launch(
            _batch_backward_kernel,
            self.channel_grid,
            (sums, affine, batch_gate, pq, grads[0], grads[1], grad_gates, grads[3], n, c, self.spatial, layer.eps),
            self.batch_constants,
        )
        if not levels:  # no channel gate (C = 1): nothing uses the empty parameter, as autograd sees it
            grads[2] = None
        return passes.grad_input(grad_y, x, affine, pq, moments, True) if needs_x else None, grads
