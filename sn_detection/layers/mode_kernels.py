"""Mode Normalization's and Mode Group Normalization's (N, C) statistics in one forward and one backward
kernel each (``moment_normalizer``; the layers and their notation are ``mode``'s).

Notation: m, v (N, C) are the IN moments, gamma, beta the affine, eps the variance's epsilon, K the modes;
D = sum_HW grad_y (x - m) and S = sum_HW grad_y are the gradients of the output with respect to scale and
shift, and the centring at m adds -scale * S to m's gradient. Every kernel returns p = 2 g_v / HW and
q = g_m / HW, g_m and g_v the total gradients with respect to m and v, for
grad_x = grad_y * scale + (x - m) p + q (``moment_normalizer``).

MN, forward. Gates g_nk = softmax_k(z_n), z_n = W m_n + b (``gate``: W (K, C), b (K)). In training each
mode pools the batch with weights g_nk; written with the shares s_nk = g_nk / N_k = softmax_n(log g_nk)
(N_k = sum_n g_nk), which stay normalized however far the gates underflow:

    t_kc = sum_n s_nk m_nc,   V_kc = sum_n s_nk (v_nc + (m_nc - t_kc)^2)    (the mode's mean and variance)

The normalizing estimates clamp N_k at f = ``_MIN_MODE_WEIGHT`` (W_k = max(N_k, f)): mu = sum_n g m / W_k
and var = sum_n g (v + m^2) / W_k - mu^2, which is a pool of the mode with a sample of weight W_k - N_k at
0, so with a_k = N_k / W_k

    mu_kc = a_k t_kc,   var_kc = a_k V_kc + a_k (1 - a_k) t_kc^2

(a_k = 1, mu = t, var = V unless the mode is almost unused). In evaluation mu, var are the running
estimates. With r = (var + eps)^(-1/2), the per-sample mixture folds into

    scale_nc = gamma_c sum_k g_nk r_kc,   shift_nc = beta_c - gamma_c sum_k g_nk (mu_kc - m_nc) r_kc

and training moves the running estimates of every mode with N_k > 0 (some gate positive) towards (t, V)
by ``running``'s rule (mixture variance; ``kernels``' running update), num_batches_tracked counting the batch if
any mode moved.

MN, backward. With E_nkc = D_nc - S_nc (mu_kc - m_nc) (what reaches r through both terms):

    grad gamma_c = sum_{n,k} g_nk r_kc E_nkc,   grad beta_c = sum_n S_nc
    G_r = gamma sum_n g E,   G_mu = -gamma r sum_n g S,   G_var = -G_r r^3 / 2      (each (K, C))

m's direct gradient through the shift, scale * S, cancels the centring's -scale * S. The estimates
differentiate as d mu / dm_nc = g / W, d var / dm_nc = 2 g (m - mu) / W, d var / dv_nc = g / W, and with
respect to a gate (delta_k = 1 where N_k >= f, else 0: the clamp's derivative)

    d mu_kc / dg_nk = (m_nc - delta mu_kc) / W_k,
    d var_kc / dg_nk = (v_nc + (m_nc - mu_kc)^2 - delta var_kc - (1 - delta) mu_kc^2) / W_k,

so a gate's total gradient and its logit's (softmax over k) are

    G_g_nk = sum_c gamma r E + sum_c [G_mu d mu / dg + G_var d var / dg],   G_z = g (G_g - sum_j g_j G_g_j)

and g_m = sum_k (g / W) (G_mu + 2 G_var (m - mu)) + sum_k G_z W_kc,   g_v = sum_k (g / W) G_var,
grad W_kc = sum_n G_z m_nc,   grad b_k = sum_n G_z. In evaluation G_mu = G_var = 0.

MGN, forward. Per sample and channel, log-gates l_nck = log_softmax_k(w_k m_nc + b_k); each mode's
channel shares s_nck = softmax_c(l_nck) = exp(l_nck - L_nk), L_nk = log sum_c exp(l_nck), and

    mu_nk = sum_c s m,   var_nk = sum_c s (v + (m - mu_nk)^2),   r = (var + eps)^(-1/2)
    scale_nc = gamma_c / K sum_k r_nk,   shift_nc = beta_c - gamma_c / K sum_k (mu_nk - m_nc) r_nk

MGN, backward. With E_nkc = D - S (mu_nk - m_nc):

    grad gamma_c = sum_{n,k} r E / K,   grad beta_c = sum_n S
    G_r = sum_c gamma E / K,   G_mu = -r sum_c gamma S / K,   G_var = -G_r r^3 / 2      (each (N, K))
    G_l = s (G_mu (m - mu) + G_var (v + (m - mu)^2 - var))   (softmax over c; d mu/d s and d var/d s)
    G_z = G_l - softmax_k(z) sum_k G_l                         (log-softmax over k)
    g_m = sum_k s (G_mu + 2 G_var (m - mu)) + sum_k G_z w_k,   g_v = sum_k s G_var
    grad w_k = sum_{n,c} G_z m,   grad b_k = sum_{n,c} G_z

(m's direct gradient cancels the centring's as in MN.)

Accuracy. Everything is float32 and no variance subtracts two second moments: pooled moments are merged
tile by tile as weighted (count, mean, sum of squared deviations), in Chan's form, whose terms are all
non-negative; weighted means are taken relative to the largest log-weight (online softmax), so shares and
gates keep their digits when gates underflow; every mean difference (mu - m, m - t) is formed per element.
MN pools the running update's step t - running_mean as the weighted mean of m - running_mean (beside t
itself), so the running estimates keep their digits when the means are large. MGN keeps each mode's mean
relative to the sample's first channel mean m_n0 (it pools m - m_n0; stats hold mu_nk - m_n0), so that
m - mu is a difference of small numbers: a mu rounded at the means' scale would shift every m - mu of a
mode alike, which the shares' weighted sum does not cancel and the gate weight's gradient multiplies by
the means. The gates' gradients are differences between modes: per (n, c), each mode's term of G_g is
taken relative to that of the sample's most likely mode (never a clamped one: its N_k >= 1 / K), and the
softmax's backward divides by the gates' rounded sum, so that modes that agree contribute exactly 0 (as
with one sample, whose modes are all that sample).

Programs and tiles. The (n, c, k) work runs on [BLOCK_N, BLOCK_C, BLOCK_K] register tiles of at most
``_TILE`` elements, the modes innermost (padded to BLOCK_K = next_pow2(K); ``MAX_MODES`` bounds K, larger K
takes the autograd path).

- MN forward: programs over channel blocks. Each recomputes the gate logits of every sample (the (N, C) x
  (C, K) product, looping over channel tiles), pools its own channels' modes over all samples, moves their
  running estimates and writes their scale and shift; the first program stores log g and log N_k for the
  backward, and counts the batch. The logits are computed twice per program in training (for the
  estimates, then for the output), once in evaluation.
- MN backward: programs over channel blocks. A gate's gradient G_g_nk sums over all channels terms that
  need every channel's pooled gradients G_mu, G_var, which sum over all samples: every program recomputes
  them for all channel tiles (for each block of BLOCK_N samples, a pass over all samples per tile), then
  writes p, q and the gradients of its own channels; the gate bias's gradient is stored by the first.
  Each program does the whole layer's (N, C, K) work, about (1 + ceil(N / BLOCK_N)) N C K, so extra
  programs add no latency but do not reduce it either: the math couples every (n, c) to every other
  through the gates, and programs may not communicate.
- MGN forward: programs over blocks of samples, each looping over all channels: nothing is shared between
  samples.
- MGN backward: programs over channel blocks. Each recomputes the per-sample sums over all channels
  (G_r, G_mu) and writes p, q, grad gamma and grad beta of its own channels; the gate's gradients, sums
  over all (n, c), are made by the first program alone, in a second pass over all channels that
  recomputes the gates: that program's N C K work (with three exponentials per element) is the kernel's
  latency.
"""

from __future__ import annotations

import math
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

MAX_MODES = 16
_TILE = 4096  # elements of one [BLOCK_N, BLOCK_C, BLOCK_K] tile
_MAX_BLOCK_C = 64
_NUM_WARPS = 4

if triton is not None:

    @triton.jit
    def _tile_moments(w, m, v, AXIS: tl.constexpr):
        # weighted count, mean and sum of squared deviations of (m, v) along AXIS, two-pass in registers
        count = tl.sum(w, AXIS, keep_dims=True)
        mean = tl.sum(w * m, AXIS, keep_dims=True) / tl.where(count > 0, count, 1.0)
        d = m - mean
        return count, mean, tl.sum(w * (v + d * d), AXIS, keep_dims=True)

    @triton.jit
    def _merge(count, mean, m2, factor, tile_count, tile_mean, tile_m2):
        # Chan's pooling of two weighted sets, the first's weights rescaled by ``factor``
        old = count * factor
        total = old + tile_count
        frac = tl.where(total > 0, tile_count / tl.where(total > 0, total, 1.0), 0.0)
        delta = tile_mean - mean
        return total, mean + delta * frac, m2 * factor + tile_m2 + delta * delta * old * frac, frac

    @triton.jit
    def _online_weights(log_w, running_max, AXIS: tl.constexpr):
        # exp(log_w - max) with the running maximum over AXIS updated, and the old sums' rescaling factor
        new_max = tl.maximum(running_max, tl.max(log_w, AXIS, keep_dims=True))
        finite_max = tl.where(new_max > float("-inf"), new_max, 0.0)  # -inf only where nothing has weight
        return tl.exp(log_w - finite_max), new_max, tl.exp(running_max - finite_max)

    # ---------------------------------------------------------------- MN

    @triton.jit
    def _mn_log_gates(
        mean_ptr,
        gate_w_ptr,
        gate_b_ptr,
        rows,
        row_mask,
        ks,
        k_mask,
        C,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # log g (BLOCK_N, BLOCK_K) of the samples ``rows``: log-softmax of W m_n + b; -inf off rows and modes
        z = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_mask = cols < C
            m = tl.load(
                mean_ptr + rows[:, None] * C + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0
            )
            w = tl.load(
                gate_w_ptr + ks[None, :] * C + cols[:, None], mask=col_mask[:, None] & k_mask[None, :], other=0.0
            )
            z += tl.sum(m[:, :, None] * w.to(tl.float32)[None, :, :], 1)
        z += tl.load(gate_b_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.where(k_mask[None, :], z, float("-inf"))
        top = tl.max(z, 1)
        lse = top + tl.log(tl.sum(tl.exp(z - top[:, None]), 1))
        return tl.where(row_mask[:, None] & k_mask[None, :], z - lse[:, None], float("-inf"))

    @triton.jit
    def _mn_forward_kernel(
        moments_ptr,
        weight_ptr,
        bias_ptr,
        gate_w_ptr,
        gate_b_ptr,
        running_mean_ptr,
        running_var_ptr,
        tracked_ptr,
        affine_ptr,
        N,
        C,
        K,
        eps,
        momentum,
        log_min_weight,
        BATCH_STATS: tl.constexpr,
        UPDATE_RUNNING: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # The blocks (``kernels``): moments (m, v), affine (scale, shift, stats). stats: log g (N, K), log N_k
        # (K), mu (K, C), var (K, C). Tiles [BLOCK_N, BLOCK_C, BLOCK_K]: the modes innermost; per-mode
        # statistics of the channels as [BLOCK_C, BLOCK_K]
        mean_ptr, var_ptr = moments_ptr, moments_ptr + N * C
        scale_ptr, shift_ptr, stats_ptr = affine_ptr, affine_ptr + N * C, affine_ptr + 2 * N * C
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < K
        ck = ks[None, :] * C + cols[:, None]
        ck_mask = col_mask[:, None] & k_mask[None, :]
        gamma = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        beta = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        stats_mu = stats_ptr + N * K + K
        stats_var = stats_mu + K * C

        if BATCH_STATS:
            # the modes' (t, V) over all samples, pooled tile by tile; weights exp(log g - max_n log g). The
            # running update's step t - running_mean is pooled too, as the mean of m - running_mean: it
            # keeps its digits however large the means
            center = tl.load(running_mean_ptr + ck, mask=ck_mask, other=0.0).to(tl.float32)[None, :, :]
            top = tl.full([1, 1, BLOCK_K], float("-inf"), tl.float32)
            count = tl.zeros([1, 1, BLOCK_K], dtype=tl.float32)
            t = tl.zeros([1, BLOCK_C, BLOCK_K], dtype=tl.float32)
            m2 = tl.zeros([1, BLOCK_C, BLOCK_K], dtype=tl.float32)
            step = tl.zeros([1, BLOCK_C, BLOCK_K], dtype=tl.float32)
            for n0 in range(0, N, BLOCK_N):
                rows = n0 + tl.arange(0, BLOCK_N)
                row_mask = rows < N
                log_g = _mn_log_gates(
                    mean_ptr, gate_w_ptr, gate_b_ptr, rows, row_mask, ks, k_mask, C, BLOCK_N, BLOCK_K, BLOCK_C
                )
                tl.store(
                    stats_ptr + rows[:, None] * K + ks[None, :],
                    log_g,
                    mask=row_mask[:, None] & k_mask[None, :] & (pid == 0),
                )
                mask = row_mask[:, None] & col_mask[None, :]
                offsets = rows[:, None] * C + cols[None, :]
                m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)[:, :, None]
                v = tl.load(var_ptr + offsets, mask=mask, other=0.0)[:, :, None]
                w, top, factor = _online_weights(log_g[:, None, :], top, 0)
                tile_count, tile_mean, tile_m2 = _tile_moments(w, m, v, 0)
                tile_step = tl.sum(w * (m - center), 0, keep_dims=True) / tl.where(tile_count > 0, tile_count, 1.0)
                count, t, m2, frac = _merge(count, t, m2, factor, tile_count, tile_mean, tile_m2)
                step += (tile_step - step) * frac
            top = tl.max(tl.max(top, 1), 0)  # (BLOCK_K,)
            count = tl.sum(tl.sum(count, 1), 0)
            t = tl.sum(t, 0)  # (BLOCK_C, BLOCK_K)
            step = tl.sum(step, 0)
            var_t = tl.sum(m2, 0) / tl.where(count > 0, count, 1.0)[None, :]
            log_n = tl.where(count > 0, top + tl.log(tl.where(count > 0, count, 1.0)), float("-inf"))  # log N_k
            tl.store(stats_ptr + N * K + ks, log_n, mask=k_mask & (pid == 0))
            a = tl.exp(log_n - tl.maximum(log_n, log_min_weight))[None, :]  # N_k / W_k
            mu = a * t
            var = a * var_t + a * (1 - a) * t * t
            if UPDATE_RUNNING:
                mode_weight = count * tl.exp(top)  # N_k, > 0 where some gate of the mode is positive
                moved = tl.max(tl.where(k_mask & (mode_weight > 0), 1, 0), 0)
                average_factor = running_factor(tracked_ptr, momentum, moved.to(tl.int64))
                store_running_moments(
                    running_mean_ptr,
                    running_var_ptr,
                    ck,
                    ck_mask,
                    t,
                    var_t,
                    mode_weight[None, :],
                    average_factor,
                    step,
                    False,
                    True,
                )
        else:
            mu = tl.load(running_mean_ptr + ck, mask=ck_mask, other=0.0).to(tl.float32)
            var = tl.load(running_var_ptr + ck, mask=ck_mask, other=0.0).to(tl.float32)
        tl.store(stats_mu + ck, mu, mask=ck_mask)
        tl.store(stats_var + ck, var, mask=ck_mask)

        r = (1.0 / tl.sqrt(var + eps))[None, :, :]
        mu = mu[None, :, :]
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            log_g = _mn_log_gates(
                mean_ptr, gate_w_ptr, gate_b_ptr, rows, row_mask, ks, k_mask, C, BLOCK_N, BLOCK_K, BLOCK_C
            )
            if not BATCH_STATS:
                tl.store(
                    stats_ptr + rows[:, None] * K + ks[None, :],
                    log_g,
                    mask=row_mask[:, None] & k_mask[None, :] & (pid == 0),
                )
            g = tl.exp(log_g)[:, None, :]
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
            scale = gamma[None, :] * tl.sum(g * r, 2)
            offset = tl.sum(g * (mu - m[:, :, None]) * r, 2)
            tl.store(scale_ptr + offsets, scale, mask=mask)
            tl.store(shift_ptr + offsets, beta[None, :] - gamma[None, :] * offset, mask=mask)

    @triton.jit
    def _mn_mode_statistics(stats_ptr, weight_ptr, cols, col_mask, ks, k_mask, N, C, K, eps):
        # mu, var, r (BLOCK_C, BLOCK_K) and gamma (BLOCK_C) of the channels ``cols``
        ck = ks[None, :] * C + cols[:, None]
        ck_mask = col_mask[:, None] & k_mask[None, :]
        mu = tl.load(stats_ptr + N * K + K + ck, mask=ck_mask, other=0.0)
        var = tl.load(stats_ptr + N * K + K + K * C + ck, mask=ck_mask, other=0.0)
        gamma = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        return mu, var, 1.0 / tl.sqrt(var + eps), gamma

    @triton.jit
    def _mn_mode_gradients(
        mean_ptr,
        dot_ptr,
        total_ptr,
        stats_ptr,
        weight_ptr,
        cols,
        col_mask,
        ks,
        k_mask,
        N,
        C,
        K,
        eps,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # for the channels ``cols``: mu, var, r, gamma, G_mu, G_var (BLOCK_C, BLOCK_K), grad gamma and
        # grad beta (BLOCK_C), from sums over all samples
        mu, var, r, gamma = _mn_mode_statistics(stats_ptr, weight_ptr, cols, col_mask, ks, k_mask, N, C, K, eps)
        sum_e = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)
        sum_s = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)
        grad_beta = tl.zeros([BLOCK_C], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            log_g = tl.load(
                stats_ptr + rows[:, None] * K + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=float("-inf"),
            )
            g = tl.exp(log_g)[:, None, :]
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)[:, :, None]
            dot = tl.load(dot_ptr + offsets, mask=mask, other=0.0)
            total = tl.load(total_ptr + offsets, mask=mask, other=0.0)
            sum_e += tl.sum(g * (dot[:, :, None] - total[:, :, None] * (mu[None, :, :] - m)), 0)
            sum_s += tl.sum(g * total[:, :, None], 0)
            grad_beta += tl.sum(total, 0)
        grad_r = gamma[:, None] * sum_e
        grad_mu = -gamma[:, None] * r * sum_s
        grad_var = -0.5 * r * r * r * grad_r
        return mu, var, r, gamma, grad_mu, grad_var, tl.sum(r * sum_e, 1), grad_beta

    @triton.jit
    def _mn_backward_kernel(
        moments_ptr,
        affine_ptr,
        sums_ptr,
        weight_ptr,
        gate_w_ptr,
        pq_ptr,
        grad_weight_ptr,
        grad_bias_ptr,
        grad_gate_w_ptr,
        grad_gate_b_ptr,
        N,
        C,
        K,
        spatial,
        eps,
        log_min_weight,
        BATCH_STATS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # The blocks: moments (m, v), affine (its stats after row 1), sums (D, S), pq (p, q). Tiles
        # [BLOCK_N, BLOCK_C, BLOCK_K]: the modes innermost
        mean_ptr, var_ptr, stats_ptr = moments_ptr, moments_ptr + N * C, affine_ptr + 2 * N * C
        dot_ptr, total_ptr, p_ptr, q_ptr = sums_ptr, sums_ptr + N * C, pq_ptr, pq_ptr + N * C
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < K
        ck = ks[None, :] * C + cols[:, None]
        ck_mask = col_mask[:, None] & k_mask[None, :]

        # this program's channels: G_mu, G_var, grad gamma, grad beta
        mu, var, r, gamma, grad_mu, grad_var, grad_gamma, grad_beta = _mn_mode_gradients(
            mean_ptr,
            dot_ptr,
            total_ptr,
            stats_ptr,
            weight_ptr,
            cols,
            col_mask,
            ks,
            k_mask,
            N,
            C,
            K,
            eps,
            BLOCK_N,
            BLOCK_K,
            BLOCK_C,
        )
        tl.store(grad_weight_ptr + cols, grad_gamma, mask=col_mask)
        tl.store(grad_bias_ptr + cols, grad_beta, mask=col_mask)
        log_n = tl.load(stats_ptr + N * K + ks, mask=k_mask, other=float("-inf"))
        log_w = tl.maximum(log_n, log_min_weight)  # log W_k
        unclamped = tl.where(log_n >= log_min_weight, 1.0, 0.0)[None, None, :]  # delta_k
        gate_w = tl.load(gate_w_ptr + ck, mask=ck_mask, other=0.0).to(tl.float32)[None, :, :]

        grad_gate_w = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)
        grad_gate_b = tl.zeros([BLOCK_K], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            log_g = tl.load(
                stats_ptr + rows[:, None] * K + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=float("-inf"),
            )
            g = tl.exp(log_g)
            g3 = g[:, None, :]
            g_sum = tl.sum(g, 1)
            g_sum = tl.where(g_sum > 0, g_sum, 1.0)[:, None, None]
            # G_z of these samples, summed over all channels. Per (n, c, k), a channel's share of G_g:
            # x = gamma r E + (through mu, var) / W, taken relative to the sample's most likely mode's (never a
            # clamped one), so that modes that agree cancel exactly; then the softmax's backward
            # g (x - sum_j g_j x_j / sum_j g_j), per element, over the gates' rounded sum
            pivot = (ks[None, :] == tl.argmax(log_g, 1)[:, None])[:, None, :]
            inv_w = tl.exp(-log_w)[None, None, :]
            grad_logit = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for c0 in range(0, C, BLOCK_C):
                tile = c0 + tl.arange(0, BLOCK_C)
                tile_mask = tile < C
                if BATCH_STATS:
                    t_mu, t_var, t_r, t_gamma, t_grad_mu, t_grad_var, _, _ = _mn_mode_gradients(
                        mean_ptr,
                        dot_ptr,
                        total_ptr,
                        stats_ptr,
                        weight_ptr,
                        tile,
                        tile_mask,
                        ks,
                        k_mask,
                        N,
                        C,
                        K,
                        eps,
                        BLOCK_N,
                        BLOCK_K,
                        BLOCK_C,
                    )
                else:
                    t_mu, t_var, t_r, t_gamma = _mn_mode_statistics(
                        stats_ptr, weight_ptr, tile, tile_mask, ks, k_mask, N, C, K, eps
                    )
                mask = row_mask[:, None] & tile_mask[None, :]
                offsets = rows[:, None] * C + tile[None, :]
                m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)[:, :, None]
                dot = tl.load(dot_ptr + offsets, mask=mask, other=0.0)[:, :, None]
                total = tl.load(total_ptr + offsets, mask=mask, other=0.0)[:, :, None]
                t_mu = t_mu[None, :, :]
                e = dot - total * (t_mu - m)
                x = (t_gamma[:, None] * t_r)[None, :, :] * e
                if BATCH_STATS:
                    v = tl.load(var_ptr + offsets, mask=mask, other=0.0)[:, :, None]
                    t_var = t_var[None, :, :]
                    d = m - t_mu
                    d_mu = m - unclamped * t_mu
                    d_var = v + d * d - unclamped * t_var - (1 - unclamped) * t_mu * t_mu
                    x += inv_w * (t_grad_mu[None, :, :] * d_mu + t_grad_var[None, :, :] * d_var)
                x -= tl.sum(tl.where(pivot, x, 0.0), 2, keep_dims=True)
                grad_logit += tl.sum(g3 * (x - tl.sum(g3 * x, 2, keep_dims=True) / g_sum), 1)

            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)[:, :, None]
            grad_m = tl.sum(grad_logit[:, None, :] * gate_w, 2)
            grad_v = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
            if BATCH_STATS:
                share = tl.exp(log_g - log_w[None, :])[:, None, :]  # g / W
                grad_m += tl.sum(share * (grad_mu[None, :, :] + 2.0 * grad_var[None, :, :] * (m - mu[None, :, :])), 2)
                grad_v = tl.sum(share * grad_var[None, :, :], 2)
            tl.store(p_ptr + offsets, 2.0 * grad_v / spatial, mask=mask)
            tl.store(q_ptr + offsets, grad_m / spatial, mask=mask)
            grad_gate_w += tl.sum(grad_logit[:, None, :] * m, 0)
            grad_gate_b += tl.sum(grad_logit, 0)
        tl.store(grad_gate_w_ptr + ck, grad_gate_w, mask=ck_mask)
        tl.store(grad_gate_b_ptr + ks, grad_gate_b, mask=k_mask & (pid == 0))

    # ---------------------------------------------------------------- MGN

    @triton.jit
    def _mgn_log_gates(m, gate_w, gate_b, k_mask):
        # l (BLOCK_N, BLOCK_C, BLOCK_K) from the means m (BLOCK_N, BLOCK_C): log-softmax over k of w_k m + b_k
        z = m[:, :, None] * gate_w[None, None, :] + gate_b[None, None, :]
        z = tl.where(k_mask[None, None, :], z, float("-inf"))
        top = tl.max(z, 2)
        lse = top + tl.log(tl.sum(tl.exp(z - top[:, :, None]), 2))
        return z - lse[:, :, None]

    @triton.jit
    def _mgn_forward_kernel(
        moments_ptr,
        weight_ptr,
        bias_ptr,
        gate_w_ptr,
        gate_b_ptr,
        affine_ptr,
        N,
        C,
        K,
        eps,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # The blocks (``kernels``): moments (m, v), affine (scale, shift, stats). stats: mu (N, K), var (N, K),
        # L (N, K). Tiles [BLOCK_N, BLOCK_C, BLOCK_K]: the modes innermost
        mean_ptr, var_ptr = moments_ptr, moments_ptr + N * C
        scale_ptr, shift_ptr, stats_ptr = affine_ptr, affine_ptr + N * C, affine_ptr + 2 * N * C
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < K
        gate_w = tl.load(gate_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        gate_b = tl.load(gate_b_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        # the means relative to each sample's first channel mean: mu is kept as mu - ref (module docstring)
        ref = tl.load(mean_ptr + rows * C, mask=row_mask, other=0.0)

        # each mode's share-weighted moments over the channels, pooled tile by tile
        top = tl.full([BLOCK_N, 1, BLOCK_K], float("-inf"), tl.float32)
        count = tl.zeros([BLOCK_N, 1, BLOCK_K], dtype=tl.float32)
        mu = tl.zeros([BLOCK_N, 1, BLOCK_K], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_N, 1, BLOCK_K], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < C)[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
            v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
            log_g = tl.where(mask[:, :, None], _mgn_log_gates(m, gate_w, gate_b, k_mask), float("-inf"))
            w, top, factor = _online_weights(log_g, top, 1)
            tile_count, tile_mean, tile_m2 = _tile_moments(w, (m - ref[:, None])[:, :, None], v[:, :, None], 1)
            count, mu, m2, _ = _merge(count, mu, m2, factor, tile_count, tile_mean, tile_m2)
        top = tl.max(top, 1)
        count = tl.sum(count, 1)
        mu = tl.sum(mu, 1)
        var = tl.sum(m2, 1) / tl.where(count > 0, count, 1.0)
        nk = rows[:, None] * K + ks[None, :]
        nk_mask = row_mask[:, None] & k_mask[None, :]
        tl.store(stats_ptr + nk, mu, mask=nk_mask)
        tl.store(stats_ptr + N * K + nk, var, mask=nk_mask)
        tl.store(stats_ptr + 2 * N * K + nk, top + tl.log(tl.where(count > 0, count, 1.0)), mask=nk_mask)

        r = tl.where(k_mask[None, :], 1.0 / tl.sqrt(var + eps), 0.0)
        r_sum = tl.sum(r, 1)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_mask = cols < C
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
            weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) / K
            beta = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            offset = tl.sum((mu[:, None, :] - (m - ref[:, None])[:, :, None]) * r[:, None, :], 2)
            tl.store(scale_ptr + offsets, weight[None, :] * r_sum[:, None], mask=mask)
            tl.store(shift_ptr + offsets, beta[None, :] - weight[None, :] * offset, mask=mask)

    @triton.jit
    def _mgn_gate_gradients(m, ref, v, mask, mu, var, log_total, grad_mu, grad_var, gate_w, gate_b, k_mask):
        # the shares s and the logits' gradients G_z (BLOCK_N, BLOCK_C, BLOCK_K) of the means m (BLOCK_N, BLOCK_C),
        # with mu kept relative to ref (BLOCK_N)
        log_g = _mgn_log_gates(m, gate_w, gate_b, k_mask)
        valid = mask[:, :, None] & k_mask[None, None, :]
        share = tl.exp(tl.where(valid, log_g - log_total[:, None, :], float("-inf")))
        d = (m - ref[:, None])[:, :, None] - mu[:, None, :]
        grad_log = share * (grad_mu[:, None, :] * d + grad_var[:, None, :] * (v[:, :, None] + d * d - var[:, None, :]))
        g = tl.where(valid, tl.exp(log_g), 0.0)
        g_sum = tl.sum(g, 2)
        return share, grad_log - g * (tl.sum(grad_log, 2) / tl.where(g_sum > 0, g_sum, 1.0))[:, :, None]

    @triton.jit
    def _mgn_backward_kernel(
        moments_ptr,
        affine_ptr,
        sums_ptr,
        weight_ptr,
        gate_w_ptr,
        gate_b_ptr,
        pq_ptr,
        grad_weight_ptr,
        grad_bias_ptr,
        grad_gate_w_ptr,
        grad_gate_b_ptr,
        N,
        C,
        K,
        spatial,
        eps,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # The blocks: moments (m, v), affine (its stats after row 1), sums (D, S), pq (p, q). Tiles
        # [BLOCK_N, BLOCK_C, BLOCK_K]: the modes innermost
        mean_ptr, var_ptr, stats_ptr = moments_ptr, moments_ptr + N * C, affine_ptr + 2 * N * C
        dot_ptr, total_ptr, p_ptr, q_ptr = sums_ptr, sums_ptr + N * C, pq_ptr, pq_ptr + N * C
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < C
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < K
        gate_w = tl.load(gate_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        gate_b = tl.load(gate_b_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)

        grad_gamma = tl.zeros([BLOCK_C], dtype=tl.float32)
        grad_beta = tl.zeros([BLOCK_C], dtype=tl.float32)
        grad_gate_w = tl.zeros([BLOCK_K], dtype=tl.float32)
        grad_gate_b = tl.zeros([BLOCK_K], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            nk = rows[:, None] * K + ks[None, :]
            nk_mask = row_mask[:, None] & k_mask[None, :]
            mu = tl.load(stats_ptr + nk, mask=nk_mask, other=0.0)
            var = tl.load(stats_ptr + N * K + nk, mask=nk_mask, other=0.0)
            log_total = tl.load(stats_ptr + 2 * N * K + nk, mask=nk_mask, other=0.0)
            r = tl.where(k_mask[None, :], 1.0 / tl.sqrt(var + eps), 0.0)
            ref = tl.load(mean_ptr + rows * C, mask=row_mask, other=0.0)  # mu is mu - ref (the forward's)

            # G_r and sum_c gamma S / K of these samples, over all channels
            grad_r = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            sum_s = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c0 in range(0, C, BLOCK_C):
                tile = c0 + tl.arange(0, BLOCK_C)
                tile_mask = tile < C
                mask = row_mask[:, None] & tile_mask[None, :]
                offsets = rows[:, None] * C + tile[None, :]
                m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
                dot = tl.load(dot_ptr + offsets, mask=mask, other=0.0)
                total = tl.load(total_ptr + offsets, mask=mask, other=0.0)
                t_weight = tl.load(weight_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)[None, :] / K
                to_mode = mu[:, None, :] - (m - ref[:, None])[:, :, None]  # mu - m
                e = (t_weight * dot)[:, :, None] - (t_weight * total)[:, :, None] * to_mode
                grad_r += tl.sum(e, 1)
                sum_s += tl.sum(t_weight * total, 1)
            grad_mu = -r * sum_s[:, None]
            grad_var = -0.5 * r * r * r * grad_r

            # this program's channels
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
            v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
            dot = tl.load(dot_ptr + offsets, mask=mask, other=0.0)
            total = tl.load(total_ptr + offsets, mask=mask, other=0.0)
            share, grad_logit = _mgn_gate_gradients(
                m, ref, v, mask, mu, var, log_total, grad_mu, grad_var, gate_w, gate_b, k_mask
            )
            d = (m - ref[:, None])[:, :, None] - mu[:, None, :]
            grad_m = tl.sum(share * (grad_mu[:, None, :] + 2.0 * grad_var[:, None, :] * d), 2)
            grad_m += tl.sum(grad_logit * gate_w[None, None, :], 2)
            grad_v = tl.sum(share * grad_var[:, None, :], 2)
            tl.store(p_ptr + offsets, 2.0 * grad_v / spatial, mask=mask)
            tl.store(q_ptr + offsets, grad_m / spatial, mask=mask)
            grad_gamma += tl.sum(dot * tl.sum(r, 1)[:, None] + total * tl.sum(r[:, None, :] * d, 2), 0)
            grad_beta += tl.sum(total, 0)

            # the gate's gradients, sums over every (n, c): the first program's
            if pid == 0:
                for c0 in range(0, C, BLOCK_C):
                    tile = c0 + tl.arange(0, BLOCK_C)
                    mask = row_mask[:, None] & (tile < C)[None, :]
                    offsets = rows[:, None] * C + tile[None, :]
                    m = tl.load(mean_ptr + offsets, mask=mask, other=0.0)
                    v = tl.load(var_ptr + offsets, mask=mask, other=0.0)
                    _, grad_logit = _mgn_gate_gradients(
                        m, ref, v, mask, mu, var, log_total, grad_mu, grad_var, gate_w, gate_b, k_mask
                    )
                    grad_gate_w += tl.sum(tl.sum(grad_logit * m[:, :, None], 1), 0)
                    grad_gate_b += tl.sum(tl.sum(grad_logit, 1), 0)
        tl.store(grad_weight_ptr + cols, grad_gamma / K, mask=col_mask)
        tl.store(grad_bias_ptr + cols, grad_beta, mask=col_mask)
        tl.store(grad_gate_w_ptr + ks, grad_gate_w, mask=k_mask & (pid == 0))
        tl.store(grad_gate_b_ptr + ks, grad_gate_b, mask=k_mask & (pid == 0))


def _blocks(n: int, c: int, k: int, max_block_n: int, max_block_c: int = _MAX_BLOCK_C) -> tuple[int, int, int]:
    """BLOCK_N, BLOCK_K, BLOCK_C of [BLOCK_N, BLOCK_C, BLOCK_K] tiles of at most ``_TILE`` elements (each at
    least 2: no single-lane axes)."""
    block_k = max(next_pow2(k), 2)
    block_n = max(min(next_pow2(n), max_block_n), 2)
    block_c = max(min(next_pow2(c), _TILE // (block_n * block_k), max_block_c), 2)
    return block_n, block_k, block_c


class ModeKernels:
    """MN's kernels for inputs of one signature (``fused.FusedPlan``): each direction one method, the full-size
    passes of ``kernels.TritonPasses`` around the layer's (N, C) kernel."""

    def __init__(self, layer, x: Tensor, min_mode_weight: float):
        self.passes = TritonPasses(x)
        n, c, h, w = x.shape
        k = layer.num_modes
        self.spatial = float(h * w)
        self.batch_stats = layer.training
        self.log_min_weight = math.log(min_mode_weight)
        self.stats_size = n * k + k + 2 * k * c  # log g, log N_k, mu, var: what backward needs
        self.running = operator.itemgetter("running_mean", "running_var", "num_batches_tracked")
        block_n, block_k, block_c = _blocks(n, c, k, 64)
        self.grid = (cdiv(c, block_c),)
        self.constants = dict(
            BATCH_STATS=self.batch_stats, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_C=block_c, num_warps=_NUM_WARPS
        )
        self.forward_constants = dict(self.constants, UPDATE_RUNNING=self.batch_stats)

    @staticmethod
    def create(layer, x: Tensor, min_mode_weight: float) -> ModeKernels | None:
        """The kernels for ``layer`` on ``x``, or None where they do not apply (more than ``MAX_MODES`` modes)."""
        if triton is None or layer.num_modes > MAX_MODES:
            return None
        return ModeKernels(layer, x, min_mode_weight)

    def forward(self, layer, x: Tensor, parameters, save: bool):
        """moments -> the forward kernel (scale, shift, the modes' statistics, the running statistics) ->
        scale_shift; saved: the moments block and the affine block."""
        passes = self.passes
        n, c = passes.vector_shape
        running = self.running(layer._buffers)
        moments = passes.moments(x, save)
        affine = passes.block(moments, 2, self.stats_size)
        launch(
            _mn_forward_kernel,
            self.grid,
            (
                moments,
                *parameters,
                *running,
                affine,
                n,
                c,
                layer.num_modes,
                layer.eps,
                layer.momentum,
                self.log_min_weight,
            ),
            self.forward_constants,
        )
        if self.batch_stats:
            written_in_place(*running)
        return passes.scale_shift(x, affine, moments), (moments, affine) if save else None

    def backward(self, layer, grad_y: Tensor, x: Tensor, parameters, saved, needs_x: bool, needs_parameters):
        """centered_dot_and_sum -> the backward kernel (p, q and every parameter's gradient) -> grad_input."""
        moments, affine = saved
        weight, bias, gate_weight, gate_bias = parameters
        passes = self.passes
        n, c = passes.vector_shape
        grads = [torch.empty_like(weight), torch.empty_like(bias), torch.empty_like(gate_weight)]
        grads.append(torch.empty_like(gate_bias))
        sums = passes.centered_dot_and_sum(grad_y, x, moments)
        pq = passes.block(moments, 2)
        launch(
            _mn_backward_kernel,
            self.grid,
            (
                moments,
                affine,
                sums,
                weight,
                gate_weight,
                pq,
                *grads,
                n,
                c,
                layer.num_modes,
                self.spatial,
                layer.eps,
                self.log_min_weight,
            ),
            self.constants,
        )
        return passes.grad_input(grad_y, x, affine, pq, moments, True) if needs_x else None, grads


class ModeGroupKernels:
    """MGN's kernels for inputs of one signature (``fused.FusedPlan``): each direction one method, the
    full-size passes of ``kernels.TritonPasses`` around the layer's (N, C) kernel."""

    def __init__(self, layer, x: Tensor):
        self.passes = TritonPasses(x)
        n, c, h, w = x.shape
        k = layer.num_modes
        self.spatial = float(h * w)
        self.stats_size = 3 * n * k  # mu, var, L per (n, k): what backward needs
        block_n, block_k, block_c = _blocks(n, c, k, 2, 256)
        self.forward_grid = (cdiv(n, block_n),)
        self.forward_constants = dict(BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_C=block_c, num_warps=_NUM_WARPS)
        block_n, block_k, block_c = _blocks(n, c, k, 16)
        self.backward_grid = (cdiv(c, block_c),)
        self.backward_constants = dict(BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_C=block_c, num_warps=_NUM_WARPS)

    @staticmethod
    def create(layer, x: Tensor) -> ModeGroupKernels | None:
        """The kernels for ``layer`` on ``x``, or None where they do not apply (more than ``MAX_MODES`` modes)."""
        if triton is None or layer.num_modes > MAX_MODES:
            return None
        return ModeGroupKernels(layer, x)

    def forward(self, layer, x: Tensor, parameters, save: bool):
        """moments -> the forward kernel (scale, shift and the modes' statistics) -> scale_shift; saved: the
        moments block and the affine block."""
        passes = self.passes
        n, c = passes.vector_shape
        moments = passes.moments(x, save)
        affine = passes.block(moments, 2, self.stats_size)
        launch(
            _mgn_forward_kernel,
            self.forward_grid,
            (moments, *parameters, affine, n, c, layer.num_modes, layer.eps),
            self.forward_constants,
        )
        return passes.scale_shift(x, affine, moments), (moments, affine) if save else None

    def backward(self, layer, grad_y: Tensor, x: Tensor, parameters, saved, needs_x: bool, needs_parameters):
        """centered_dot_and_sum -> the backward kernel (p, q and every parameter's gradient) -> grad_input."""
        moments, affine = saved
        weight, bias, gate_weight, gate_bias = parameters
        passes = self.passes
        n, c = passes.vector_shape
        grads = [torch.empty_like(weight), torch.empty_like(bias), torch.empty_like(gate_weight)]
        grads.append(torch.empty_like(gate_bias))
        sums = passes.centered_dot_and_sum(grad_y, x, moments)
        pq = passes.block(moments, 2)
        launch(
            _mgn_backward_kernel,
            self.backward_grid,
            (
                moments,
                affine,
                sums,
                weight,
                gate_weight,
                gate_bias,
                pq,
                *grads,
                n,
                c,
                layer.num_modes,
                self.spatial,
                layer.eps,
            ),
            self.backward_constants,
        )
        return passes.grad_input(grad_y, x, affine, pq, moments, True) if needs_x else None, grads
