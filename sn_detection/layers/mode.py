"""Mode Normalization (MN) and Mode Group Normalization (MGN), Deecke, Murray & Bilen, ICLR 2019.

MN (paper Eq. 2-4, Alg. 1 for training, Alg. 2 for test). Each sample n gets soft assignments to K
modes, g_n = softmax(Psi(s_n)), where s_n is the sample's per-channel mean over H, W and Psi: R^C -> R^K
is affine (`gate`). Each mode has gate-weighted batch statistics (per channel, over n, H and W):

    N_k = sum_n g_nk,   <x>_k = sum_n g_nk E_HW[x_n] / N_k,   <x^2>_k = sum_n g_nk E_HW[x_n^2] / N_k
    y_n = weight * sum_k g_nk (x_n - <x>_k) / sqrt(<x^2>_k - <x>_k^2 + eps) + bias

In training the modes' <x>_k and <x^2>_k also update the running estimates (Eq. 4), the buffers
`running_mean` and `running_sq_mean` of shape (K, C), with running = (1 - m) running + m batch (PyTorch
convention; m is the paper's lambda). At test time they replace the batch estimates; the gates still come
from the test sample. K = 1 is BN.

MGN (Eq. 5, Alg. 3). Per sample, each channel c gets soft assignments g_ck = softmax(Psi(s_c)) with
Psi: R -> R^K affine (`gate`, 2K parameters). Each mode has gate-weighted statistics over the channels of
that sample, using all pixels of each channel:

    C_k = sum_c g_ck,   <x>_k = sum_c g_ck E_HW[x_c] / C_k,   <x^2>_k = sum_c g_ck E_HW[x_c^2] / C_k
    y = weight / K * sum_k (x - <x>_k) / sqrt(<x^2>_k - <x>_k^2 + eps) + bias

Training and test are the same; there are no buffers. K = 1 is LN.

Choices the paper leaves open, and how they are settled here:

* MGN's output. Eq. 5 and Alg. 3 average the K normalized maps with equal weight 1/K; the gates only
  decide which channels estimate which mode's statistics. This is followed literally (MN's Eq. 2, by
  contrast, weights each mode's map by the sample's gate).
* Variances. The paper's <x^2>_k - <x>_k^2 is computed, with identical value and gradient, as the
  gate-weighted mean of var + (mean - <x>_k)^2 over the (n, c) summaries, which never cancels two large
  second moments in fp32. The running estimates stay E[x] and E[x^2] as in the paper (Alg. 2), so the
  test-time variance keeps the paper's fp32 cancellation for a channel whose mean dwarfs its spread.
* MN clamps N_k at `_MIN_MODE_WEIGHT` so that a mode no sample chooses gives finite statistics and
  gradients; it then has almost no weight in the output anyway. MGN cannot do that: its K maps have
  equal weight, and a mode whose gates all underflow to 0 (large channel means make the gate logits
  huge) would get statistics (0, 0) and the map x / sqrt(eps), which overflows fp16. So MGN computes
  each channel's share of a mode, g_ck / C_k, as a softmax over channels of log g_ck: the same value
  whenever C_k > 0, and always normalized.
* Cost: statistics are computed once per (n, c) in fp32 (in the input's dtype if that is wider); the
  mixture over modes folds into one per-(n, c) scale and shift, so the activation is read twice and
  written once whatever K is (plus one fp32 copy for fp16/bf16 input; the output is cast back).
* An empty batch (N = 0) gives an empty output and leaves the buffers alone; in training MN then has no
  batch estimates and uses the running ones.
* Batch average (MN): between `start_batch_average()` and `finish_batch_average()`, training-mode
  forwards add each mode's <x>_k and <x^2>_k, weighted by N_k * H * W (the mode's share of pixels), to
  float64 sums instead of updating the running estimates; finish writes the pooled estimates, which equal
  the estimates of the concatenated batches.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .freezing import FreezableNorm
from .statistics import MomentNormalizer

# Floor for MN's total gate weight of a mode, N_k (in samples).
_MIN_MODE_WEIGHT = 1e-6


def _check_options(num_channels, num_modes, eps) -> None:
    for name, value in (("num_channels", num_channels), ("num_modes", num_modes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


class ModeNorm2d(MomentNormalizer, FreezableNorm, nn.Module):
    """Mode Normalization (Alg. 1 and 2) over (N, C, H, W) input; see the module docstring.

    Args:
        num_channels: C.
        num_modes: K.
        eps: added to each mode's variance.
        momentum: running = (1 - momentum) * running + momentum * batch (the paper's lambda).
    """

    def __init__(self, num_channels: int, *, num_modes: int = 2, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        _check_options(num_channels, num_modes, eps)
        if not 0 <= momentum <= 1:
            raise ValueError(f"momentum must be in [0, 1] (PyTorch convention), got {momentum!r}")
        self.num_channels = num_channels
        self.num_modes = num_modes
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.gate = nn.Linear(num_channels, num_modes)
        self.register_buffer("running_mean", torch.zeros(num_modes, num_channels))
        self.register_buffer("running_sq_mean", torch.ones(num_modes, num_channels))
        # Sums (w_k, w_k <x>_k, w_k <x^2>_k), w_k = N_k * H * W, while a batch average is running.
        self._average_sums: Optional[list[Tensor]] = None

    def gate_logits(self, mean: Tensor) -> Tensor:
        """Psi(s_n) of each sample from its per-channel means (N, C): (N, K), in mean's dtype."""
        return F.linear(mean, self.gate.weight.to(mean.dtype), self.gate.bias.to(mean.dtype))

    def scale_and_shift(self, mean: Tensor, var: Tensor, spatial_size: int) -> tuple[Tensor, Tensor]:
        """The per-(n, c) scale and shift this layer applies, y = x * scale + shift, from the IN mean and
        variance (N, C) of an input with ``spatial_size`` = H * W; updates the running statistics in training."""
        dtype = mean.dtype
        gates = torch.softmax(self.gate_logits(mean), dim=1)
        if self.training and mean.shape[0] > 0:
            mode_mean, mode_var, mode_weight = self._batch_estimates(gates, mean, var)
            # detached: TorchScript ignores _record_batch's no_grad decorator
            self._record_batch(mode_weight.detach() * spatial_size, mode_mean.detach(), mode_var.detach())
        else:
            mode_mean = self.running_mean.to(dtype)
            mode_var = (self.running_sq_mean.to(dtype) - mode_mean.square()).clamp_min(0)
        # The per-sample mixture over modes folds into one scale and shift per (n, c).
        inv_std = torch.rsqrt(mode_var + self.eps)
        weight = self.weight.to(dtype)
        scale = weight * (gates @ inv_std)
        shift = self.bias.to(dtype) - weight * (gates @ (mode_mean * inv_std))
        return scale, shift

    @staticmethod
    def _batch_estimates(gates: Tensor, mean: Tensor, var: Tensor, min_weight: float = _MIN_MODE_WEIGHT):
        """Per-mode gate-weighted mean and variance over the batch (K, C), and N_k (K,)."""
        # min_weight: TorchScript reads no module-level float
        mode_weight = gates.sum(0).clamp_min(min_weight)
        share = gates / mode_weight
        mode_mean = share.t() @ mean
        spread = (mean[:, None, :] - mode_mean).square()
        mode_var = share.t() @ var + torch.einsum("nk,nkc->kc", share, spread)
        return mode_mean, mode_var, mode_weight

    @torch.no_grad()
    def _record_batch(self, pixel_weight: Tensor, mode_mean: Tensor, mode_var: Tensor) -> None:
        """pixel_weight: each mode's gate-weighted number of pixels in this batch, (K,)."""
        sq_mean = mode_var + mode_mean.square()
        if self._average_sums is not None:
            pixel_weight, mode_mean, sq_mean = pixel_weight.double(), mode_mean.double(), sq_mean.double()
            sums = (pixel_weight, pixel_weight[:, None] * mode_mean, pixel_weight[:, None] * sq_mean)
            self._average_sums = [total + new for total, new in zip(self._average_sums, sums)]
        else:
            self.running_mean.lerp_(mode_mean.to(self.running_mean.dtype), self.momentum)
            self.running_sq_mean.lerp_(sq_mean.to(self.running_sq_mean.dtype), self.momentum)

    def start_batch_average(self) -> None:
        """Begin the batch average: training-mode forwards now accumulate exact per-mode estimates
        instead of updating the running ones; `finish_batch_average()` writes the pooled result."""
        zeros = torch.zeros_like(self.running_mean, dtype=torch.float64)
        self._average_sums = [zeros.new_zeros(self.num_modes), zeros, zeros.clone()]

    def finish_batch_average(self) -> None:
        """Write the per-mode estimates of all batches seen since `start_batch_average()` into the
        running buffers, as if those batches had been one batch."""
        # leave averaging mode first, so that a failed finish does not leave the layer stuck in it
        sums, self._average_sums = self._average_sums, None
        if sums is None:
            raise RuntimeError("finish_batch_average() called without start_batch_average()")
        pixel_weight, mean_sum, sq_sum = sums
        if not pixel_weight.any():
            raise RuntimeError(
                "finish_batch_average(): no non-empty training-mode batch was seen since "
                "start_batch_average(); run some batches with the module in train mode first"
            )
        pixel_weight = pixel_weight.clamp_min(_MIN_MODE_WEIGHT)[:, None]
        self.running_mean.copy_(mean_sum / pixel_weight)
        self.running_sq_mean.copy_(sq_sum / pixel_weight)

    def extra_repr(self) -> str:
        return f"{self.num_channels}, num_modes={self.num_modes}, eps={self.eps}, momentum={self.momentum}"


class ModeGroupNorm2d(MomentNormalizer, nn.Module):
    """Mode Group Normalization (Alg. 3, Eq. 5) over (N, C, H, W) input; see the module docstring.

    Args:
        num_channels: C.
        num_modes: K.
        eps: added to each mode's variance.
    """

    def __init__(self, num_channels: int, *, num_modes: int = 2, eps: float = 1e-5):
        super().__init__()
        _check_options(num_channels, num_modes, eps)
        self.num_channels = num_channels
        self.num_modes = num_modes
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.gate = nn.Linear(1, num_modes)

    def gate_logits(self, mean: Tensor) -> Tensor:
        """Psi(s_nc) of each (sample, channel) from its mean (N, C): (N, C, K), in mean's dtype."""
        return mean[:, :, None] * self.gate.weight.to(mean.dtype)[:, 0] + self.gate.bias.to(mean.dtype)

    def scale_and_shift(self, mean: Tensor, var: Tensor, spatial_size: int) -> tuple[Tensor, Tensor]:
        """The per-(n, c) scale and shift this layer applies, y = x * scale + shift, from the IN mean and
        variance (N, C); ``spatial_size`` (H * W) is unused: MGN has no batch statistics to pool."""
        dtype = mean.dtype
        mode_mean, mode_var = self._sample_estimates(torch.log_softmax(self.gate_logits(mean), dim=2), mean, var)
        # Eq. 5: equal-weight average of the K normalized maps, folded into a scale and shift.
        inv_std = torch.rsqrt(mode_var + self.eps)
        weight = self.weight.to(dtype) / self.num_modes
        scale = weight * inv_std.sum(1, keepdim=True)
        shift = self.bias.to(dtype) - weight * (mode_mean * inv_std).sum(1, keepdim=True)
        return scale, shift

    @staticmethod
    def _sample_estimates(log_gates: Tensor, mean: Tensor, var: Tensor):
        """Per-sample, per-mode gate-weighted mean and variance over the channels, (N, K) each, from the
        log-gates (N, C, K)."""
        share = torch.softmax(log_gates, dim=1)  # g_ck / C_k, see the module docstring
        mode_mean = torch.einsum("nck,nc->nk", share, mean)
        spread = (mean[:, :, None] - mode_mean[:, None, :]).square()
        mode_var = torch.einsum("nck,nc->nk", share, var) + (share * spread).sum(1)
        return mode_mean, mode_var

    def extra_repr(self) -> str:
        return f"{self.num_channels}, num_modes={self.num_modes}, eps={self.eps}"
