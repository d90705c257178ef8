"""Mode Normalization (MN) and Mode Group Normalization (MGN), Deecke, Murray & Bilen, ICLR 2019.

MN (paper Eq. 2-4, Alg. 1 for training, Alg. 2 for test). Each sample n gets soft assignments to K
modes, g_n = softmax(Psi(s_n)), where s_n is the sample's per-channel mean over H, W and Psi: R^C -> R^K
is affine (`gate`). Each mode has gate-weighted batch statistics (per channel, over n, H and W):

    N_k = sum_n g_nk,   <x>_k = sum_n g_nk E_HW[x_n] / N_k,   <x^2>_k = sum_n g_nk E_HW[x_n^2] / N_k
    y_n = weight * sum_k g_nk (x_n - <x>_k) / sqrt(<x^2>_k - <x>_k^2 + eps) + bias

In training the modes' <x>_k and <x^2>_k also update the running estimates (Eq. 4) with
running = (1 - m) running + m batch (PyTorch convention; m is the paper's lambda), kept as the buffers
`running_mean` and `running_var` = <x^2> - <x>^2 of shape (K, C) (see ``running``: the same estimate,
updated without subtracting two large second moments). At test time they replace the batch estimates;
the gates still come from the test sample. K = 1 is BN.

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
* Variances. MN's batch estimates are the float64 gate-weighted sums of the (n, c) summaries
  (``running.mode_sums``), whose <x^2>_k - <x>_k^2 keeps fp32 accuracy whatever the channels' means; MGN's
  <x^2>_k - <x>_k^2 is computed, with identical value and gradient, as the gate-weighted mean of
  var + (mean - <x>_k)^2, which never cancels two large second moments. MGN's <x>_k is the sample's
  average over channels plus the gate-weighted mean of each channel's difference from it: the same
  value, but its gradient with respect to the gates is a difference of means, so the gate weight's
  gradient loses digits only in proportion to mean / spread. MN takes each mode's term of the output
  relative to that of the sample's most likely mode, and its gates' softmax in float64 (0 where a gate
  underflows in fp32, as in the kernels), so that modes with like statistics give gates' gradients
  that are differences, not a common part for the softmax's backward to cancel.
* MN clamps N_k at `_MIN_MODE_WEIGHT` so that a mode no sample chooses gives finite statistics and
  gradients; it then has almost no weight in the output anyway. MGN cannot do that: its K maps have
  equal weight, and a mode whose gates all underflow to 0 (large channel means make the gate logits
  huge) would get statistics (0, 0) and the map x / sqrt(eps), which overflows fp16. So MGN computes
  each channel's share of a mode, g_ck / C_k, as a softmax over channels of log g_ck: the same value
  whenever C_k > 0, and always normalized.
* Cost: statistics are computed once per (n, c) in fp32 (in the input's dtype if that is wider); the
  mixture over modes folds into one per-(n, c) scale and shift, so the activation is read twice and
  written once whatever K is. fp16 / bf16 input: the Triton kernels read it as it is and compute in fp32,
  the PyTorch path converts it to fp32 in each of the two passes (``passes``); the output has the input's
  dtype.
* An empty batch (N = 0) gives an empty output and leaves the buffers alone; in training MN then has no
  batch estimates and uses the running ones.
* Batch average (MN): between `start_batch_average()` and `finish_batch_average()`, training-mode
  forwards add each mode's sums, weighted by N_k * H * W (the mode's share of pixels), to float64 sums
  instead of updating the running estimates; finish writes the pooled estimates, which equal the
  estimates of the concatenated batches (``running``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .inference import ChannelAffine, EvaluationForm
from .kernels import kernel_path
from .mode_kernels import ModeGroupKernels, ModeKernels
from .moment_normalizer import MomentNormalizer
from .options import MOMENTUM, POSITIVE, POSITIVE_INT
from .running import RunningMoments, mode_sums, moments_from_sums

# Floor for MN's total gate weight of a mode, N_k (in samples).
_MIN_MODE_WEIGHT = 1e-6


class ModeNorm2d(MomentNormalizer, RunningMoments):
    """Mode Normalization (Alg. 1 and 2) over (N, C, H, W) input; see the module docstring.

    Args:
        num_channels: C.
        num_modes: K.
        eps: added to each mode's variance.
        momentum: running = (1 - momentum) * running + momentum * batch (the paper's lambda); None: the
            cumulative average (momentum 1 / num_batches_tracked).
    """

    option_rules = {"num_modes": POSITIVE_INT, "eps": POSITIVE, "momentum": MOMENTUM}
    gate_parameters = ("gate.weight", "gate.bias")
    # Alg. 2 keeps E[x] and E[x^2] with momentum: the running variance is that mixture's (``running``)
    mixture_running_var = True
    # Alg. 2: the running estimates and the gates, which read the means (``moment_normalizer``)
    variance_in_evaluation = False

    def __init__(self, num_channels: int, *, num_modes: int = 2, eps: float = 1e-5, momentum: float | None = 0.1):
        super().__init__(num_channels, num_modes=num_modes, eps=eps, momentum=momentum)
        self.gate = nn.Linear(num_channels, num_modes)
        self._register_running_moments((num_modes, num_channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Affine 1, 0; the gate as torch initialises a Linear; running statistics reset."""
        super().reset_parameters()
        self.gate.reset_parameters()

    def evaluation_form(self) -> EvaluationForm:
        """At inference (``inference``): with one mode, BatchNorm with the running statistics, a
        ``ChannelAffine``; else itself."""
        if self.num_modes == 1:
            affine = ChannelAffine.of_statistics(
                self.running_mean[0], self.running_var[0], self.weight, self.bias, self.eps
            )
            return EvaluationForm(affine, None)
        return EvaluationForm(None, self)

    def gate_logits(self, mean: Tensor) -> Tensor:
        """Psi(s_n) of each sample from its per-channel means (N, C): (N, K), in mean's dtype."""
        return F.linear(mean, self.gate.weight.to(mean.dtype), self.gate.bias.to(mean.dtype))

    def scale_and_shift(
        self, mean: Tensor, var: Tensor, spatial_size: int, min_mode_weight: float = _MIN_MODE_WEIGHT
    ) -> tuple[Tensor, Tensor]:
        """The per-(n, c) scale and shift this layer applies, y = (x - mean) * scale + shift, from the IN mean
        and variance (N, C) of an input with ``spatial_size`` = H * W; updates the running statistics in
        training. (``min_mode_weight``: the floor of N_k; an argument because TorchScript reads no global
        float.) Statistics of shape (N, C, 1, 1) (evaluation) give scale and shift of that shape."""
        shape, dtype = mean.shape, mean.dtype
        mean, var = mean.flatten(1), var.flatten(1)
        # The softmax in float64, where the gates' gradients from the float64 mode sums arrive (modes with
        # like statistics give like gradients, whose common part its backward cancels), and 0 where the
        # gate rounds to 0 in the statistics dtype, as in the kernels: such a mode has no batch estimate.
        gates64 = torch.softmax(self.gate_logits(mean).double(), dim=1)
        gates64 = gates64 * (gates64.to(dtype) > 0)
        gates = gates64.to(dtype)
        if self.training and mean.shape[0] > 0:
            sums = mode_sums(mean, var, gates64 * spatial_size)
            self._track(sums)
            mode_mean, mode_var = moments_from_sums(sums, min_mode_weight * spatial_size)
            mode_mean, mode_var = mode_mean.to(dtype), mode_var.to(dtype)
        else:
            mode_mean, mode_var = self.running_mean.to(dtype), self.running_var.to(dtype)
        # The per-sample mixture over modes folds into one scale and shift per (n, c), centred at the
        # IN mean (``moment_normalizer``):
        # sum_k g_nk (x - m_kc) inv_kc = (x - mean) * scale' - sum_k g_nk (m_kc - mean) inv_kc
        # Each mode's term is taken relative to that of the sample's most likely mode (the gates sum to 1,
        # so the value is the same): the gates' gradients are then differences between modes, which the
        # softmax's backward does not have to cancel.
        inv_std = torch.rsqrt(mode_var + self.eps)
        weight = self.weight.to(dtype)
        offsets = (mode_mean[None] - mean[:, None]) * inv_std  # (N, K, C)
        likeliest = gates.detach().argmax(1)  # (N,), on the gates' device: no index crosses to the host
        inv_ref = inv_std[likeliest]  # (N, C)
        offset_ref = offsets.gather(1, likeliest[:, None, None].expand(-1, 1, offsets.shape[2])).squeeze(1)
        scale = weight * (inv_ref + torch.einsum("nk,nkc->nc", gates, inv_std[None] - inv_ref[:, None]))
        mixed_offset = offset_ref + torch.einsum("nk,nkc->nc", gates, offsets - offset_ref[:, None])
        shift = self.bias.to(dtype) - weight * mixed_offset
        return scale.reshape(shape), shift.reshape(shape)

    @torch.jit.unused
    def fused_plan(self, x: Tensor):
        """MN's fused kernels (``mode_kernels.ModeKernels``), or None: during a batch average (its sums pool
        in float64) and for more than ``mode_kernels.MAX_MODES`` modes."""
        if self._batch_average is not None or not kernel_path(x):
            return None
        return ModeKernels.create(self, x, _MIN_MODE_WEIGHT)


class ModeGroupNorm2d(MomentNormalizer):
    """Mode Group Normalization (Alg. 3, Eq. 5) over (N, C, H, W) input; see the module docstring.

    Args:
        num_channels: C.
        num_modes: K.
        eps: added to each mode's variance.
    """

    option_rules = {"num_modes": POSITIVE_INT, "eps": POSITIVE}
    gate_parameters = ("gate.weight", "gate.bias")

    def __init__(self, num_channels: int, *, num_modes: int = 2, eps: float = 1e-5):
        super().__init__(num_channels, num_modes=num_modes, eps=eps)
        self.gate = nn.Linear(1, num_modes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Affine 1, 0; the gate as torch initialises a Linear."""
        super().reset_parameters()
        self.gate.reset_parameters()

    def gate_logits(self, mean: Tensor) -> Tensor:
        """Psi(s_nc) of each (sample, channel) from its mean (N, C): (N, C, K), in mean's dtype."""
        return mean[:, :, None] * self.gate.weight.to(mean.dtype)[:, 0] + self.gate.bias.to(mean.dtype)

    def scale_and_shift(self, mean: Tensor, var: Tensor, spatial_size: int) -> tuple[Tensor, Tensor]:
        """The per-(n, c) scale and shift this layer applies, y = (x - mean) * scale + shift, from the IN mean
        and variance, (N, C) or (N, C, 1, 1) (giving scale and shift of that shape); ``spatial_size`` (H * W) is
        unused: MGN has no batch statistics to pool."""
        shape, dtype = mean.shape, mean.dtype
        mean, var = mean.flatten(1), var.flatten(1)
        mode_mean, mode_var = self._sample_estimates(torch.log_softmax(self.gate_logits(mean), dim=2), mean, var)
        # Eq. 5: equal-weight average of the K normalized maps, folded into a scale and shift centred at
        # the IN mean (``moment_normalizer``)
        inv_std = torch.rsqrt(mode_var + self.eps)
        weight = self.weight.to(dtype) / self.num_modes
        scale = weight * inv_std.sum(1, keepdim=True)
        offsets = (mode_mean[:, None, :] - mean[:, :, None]) * inv_std[:, None, :]  # (N, C, K)
        shift = self.bias.to(dtype) - weight * offsets.sum(2)
        return scale.reshape(shape), shift.reshape(shape)

    @torch.jit.unused
    def fused_plan(self, x: Tensor):
        """MGN's fused kernels (``mode_kernels.ModeGroupKernels``), or None for more than
        ``mode_kernels.MAX_MODES`` modes."""
        return ModeGroupKernels.create(self, x) if kernel_path(x) else None

    @staticmethod
    def _sample_estimates(log_gates: Tensor, mean: Tensor, var: Tensor):
        """Per-sample, per-mode gate-weighted mean and variance over the channels, (N, K) each, from the
        log-gates (N, C, K)."""
        share = torch.softmax(log_gates, dim=1)  # g_ck / C_k, see the module docstring
        # the means relative to the sample's average (the shares sum to 1, so the value is the same): the
        # gradient of a mode mean with respect to a share is then a difference of means, not a mean whose
        # common part the softmax's backward would cancel, amplifying its rounding by mean / spread
        reference = mean.mean(1, keepdim=True)
        centred = mean - reference
        mode_offset = torch.einsum("nck,nc->nk", share, centred)
        spread = (centred[:, :, None] - mode_offset[:, None, :]).square()
        mode_var = torch.einsum("nck,nc->nk", share, var) + (share * spread).sum(1)
        return reference + mode_offset, mode_var
