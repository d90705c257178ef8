"""Dynamic Normalization (DN), Luo et al., "Differentiable Dynamic Normalization for Learning Deep
Representation", ICML 2019 (only the poster is public).

DN normalizes with statistics pooled from the instance-norm (IN) statistics mu, var (N x C, biased
variance over H, W) by two averaging matrices, U over the batch (N x N) and V over the channels (C x C):

    mu_hat  = U mu V
    var_hat = U (var + mu^2) V - mu_hat^2
    y       = weight * (x - mu_hat) / sqrt(var_hat + eps) + bias

U = I, V = I is IN; U = 11^T/N, V = I is BN; U = I, V = 11^T/C is LN; U = I with V block-diagonal is GN.
V is the Kronecker product of 2x2 factors, each I_2 or 11^T/2, picked by a binary gate
g = 1[g_hat > 0] over a learned real g_hat. The gates are trained with a straight-through estimator: the
forward pass uses the hard gate, the backward pass differentiates the factor g * 11^T/2 + (1 - g) * I as
if g were g_hat.

The matrices are never built. The channel axis is reshaped into sub-axes, one per Kronecker factor, and
each factor is applied on its own sub-axis. Applying g * A + (1 - g) * I to the first and second moments
gives the moments of a mixture of two distributions:

    mean' = (1 - g) mean + g A(mean)
    var'  = (1 - g) var + g A_var + g (1 - g) (A(mean) - mean)^2,   A_var = A(var) + A((mean - A(mean))^2)

This is the paper's formula rewritten, for any real g (so the straight-through gradients are those of
the paper's expression), but it never subtracts two large second moments, and it stays accurate in fp32
when a channel's mean is much larger than its spread. The factors act on different sub-axes, so they
commute and their order does not matter. The cost is O(N C log C) on the (N, C) summaries; the
activation itself is read twice (moments, then one fused multiply-add). Statistics and output are
computed in fp32 for fp16 / bf16 input, and the output is rounded to the input's dtype: the Triton
kernels read the input as it is, the PyTorch path converts it to fp32 in each of the two passes
(``passes``).

Choices the poster leaves open, and how they are settled here:

* Channel counts that are not powers of two. C = 2^k * r with r odd. The channel index is split
  row-major into k binary sub-axes followed by one sub-axis of size r, so V = V_1 x ... x V_k x V_r.
  For r > 1 the factor V_r (I_r or 11^T/r) gets its own gate. Gates are ordered from the finest factor
  to the coarsest: [V_r if r > 1, then the least significant bit, ..., the most significant bit]. When
  the gates that are on form a prefix of this order, V averages contiguous channel blocks, so IN, LN and
  GN with any power-of-two group count dividing C are expressible. Other gate patterns average strided
  channel sets (for example channels c and c + r). That is still a valid averaging matrix, block-diagonal
  up to a permutation of the channels; `selected_grouping()` reports it as not contiguous. GN with a
  group count that is not a power of two (for example 3 groups of C = 96) cannot be expressed.
* The batch axis. Detection batches have varying size (0, 1, 2, odd), and their samples are exchangeable,
  so binary levels over the sample index (pool samples 0-1, then 0-3, ...) mean nothing and are undefined
  for odd N. U therefore has a single gate: U = 11^T/N (pool the whole batch, BN-like) or U = I.
* Test time. A statistic pooled over the batch needs population statistics at test time, as BN does.
  In training, DN always tracks the per-channel batch statistics before channel pooling,
  mean_n(mu) and mean_n(var + mu^2) - mean_n(mu)^2 (BN's batch statistics, biased variance), in the
  buffers `running_mean` and `running_var` (shape (C,)); it tracks them whatever the batch gate says, so
  they are ready if the gate switches on late in training. At test time U mu is replaced by
  `running_mean` and U (var + mu^2) by `running_var + running_mean^2`, and the current channel pooling V
  is applied to them. So the test-time output of one sample never depends on the rest of the batch, and
  running statistics do not go stale when V's gates change. Either momentum updates
  (running = (1 - m) running + m batch) or the batch-average protocol fill the buffers.
  Unlike torch.nn.BatchNorm2d, `running_var` holds the biased variance (the factor n/(n-1) is negligible
  for feature maps, and it makes the batch average exact).
* Initial gates. `init_groups` sets the initial channel pooling to GN with that many contiguous groups:
  C (IN) or a power of two dividing C (1 is LN). The default is GN(32), or GN with the largest power of
  two dividing C when that is smaller. `init_batch_pool` switches the batch gate on (with
  init_groups=C: BN). Initial gate logits are +-1.
* An empty batch (N = 0) has no batch statistics: the output is empty, no buffer changes, and the
  parameters still get (zero) gradients.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .dynamic_kernels import DynamicKernels
from .group import GroupNorm2d
from .inference import ChannelAffine, EvaluationForm
from .kernels import kernel_path
from .map_passes import per_channel
from .moment_normalizer import MomentNormalizer, affine_from_moments
from .options import BOOLEAN, MOMENTUM, POSITIVE, POSITIVE_INT, Rule
from .running import RunningMoments, group_sums, moments_from_sums

# Magnitude of the initial gate logits: the sign is the initial gate; an optimizer step has to move a
# logit by this much before its gate flips.
_GATE_LOGIT_INIT = 1.0
_DEFAULT_GROUPS = 32


class DynamicGrouping(NamedTuple):
    """The pooling selected by the current (hard) gates of a `DynamicNorm2d`."""

    num_groups: int
    group_size: int
    # True when each group is a block of consecutive channels (IN, GN, LN); False for strided sets.
    contiguous: bool
    # True when statistics are pooled over the batch (running statistics at test time).
    pools_batch: bool


def _straight_through_gate(logits: Tensor) -> Tensor:
    """1[logits > 0] in the forward pass; gradient of the identity in the backward pass."""
    hard = (logits > 0).to(logits.dtype)
    return hard + (logits - logits.detach())


def _mixture_moments(mean: Tensor, var: Tensor, gate: Tensor, target_mean: Tensor, target_var: Tensor):
    """Mean and variance of the mixture (1 - gate) * (mean, var) + gate * (target_mean, target_var)."""
    offset = target_mean - mean
    mixed_var = (1 - gate) * var + gate * target_var + gate * (1 - gate) * offset.square()
    return mean + gate * offset, mixed_var


def _pooled_moments(mean: Tensor, var: Tensor, dim: int):
    """Mean and variance of equally sized groups pooled along `dim` (law of total variance)."""
    pooled_mean = mean.mean(dim, keepdim=True)
    spread = (mean - pooled_mean).square().mean(dim, keepdim=True)
    return pooled_mean, var.mean(dim, keepdim=True) + spread


def _split_odd_factor(num_channels: int):
    """(k, r) with num_channels = 2^k * r and r odd."""
    levels = (num_channels & -num_channels).bit_length() - 1
    return levels, num_channels >> levels


def _expressible_groups(num_channels: int) -> list[int]:
    """Group counts of contiguous-block GN that the channel gates can express."""
    levels, _ = _split_odd_factor(num_channels)
    return sorted({num_channels} | {2**j for j in range(levels + 1)})


# None (the default grouping) or a group count; whether a count suits the channels is checked on build
_GROUP_COUNT = Rule(lambda v: v is None or POSITIVE_INT.holds(v), "an int >= 1 (or None: the default grouping)")


class DynamicNorm2d(MomentNormalizer, RunningMoments):
    """Dynamic Normalization over (N, C, H, W) input; see the module docstring for the equations.

    Args:
        num_channels: C.
        eps: added to the variance.
        momentum: running = (1 - momentum) * running + momentum * batch (PyTorch convention); None: the
            cumulative average (momentum 1 / num_batches_tracked).
        init_groups: initial contiguous channel groups: C (IN), or a power of two dividing C (1 = LN).
            None: 32, or the largest power of two dividing C if smaller.
        init_batch_pool: start with the batch gate on (BN-like pooling over the batch).
    """

    option_rules = {"eps": POSITIVE, "momentum": MOMENTUM, "init_groups": _GROUP_COUNT, "init_batch_pool": BOOLEAN}
    gate_parameters = ("channel_gates", "batch_gate")

    def __init__(
        self,
        num_channels: int,
        *,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        init_groups: int | None = None,
        init_batch_pool: bool = False,
    ):
        super().__init__(
            num_channels, eps=eps, momentum=momentum, init_groups=init_groups, init_batch_pool=init_batch_pool
        )
        levels, odd = _split_odd_factor(num_channels)
        # Channel sub-axes of the (M, 2, ..., 2, r) view of an (M, C) tensor, finest factor first:
        # dimension levels + 1 is r, dimension levels - j is bit j of the channel's power-of-two part.
        self._subaxis_shape = [2] * levels + [odd]
        self._gated_dims = ([levels + 1] if odd > 1 else []) + [levels - j for j in range(levels)]
        self._gated_sizes = ([odd] if odd > 1 else []) + [2] * levels

        valid = _expressible_groups(num_channels)
        if init_groups is not None and init_groups not in valid:
            raise ValueError(
                f"DynamicNorm2d: init_groups={init_groups!r} cannot be expressed by DN's gates for {num_channels} "
                f"channels; valid choices: {valid} (C itself, or a power of two dividing C)"
            )
        self.init_groups = min(_DEFAULT_GROUPS, 2**levels) if init_groups is None else init_groups
        self.channel_gates = nn.Parameter(torch.empty(len(self._gated_sizes)))
        self.batch_gate = nn.Parameter(torch.empty(()))
        self._register_running_moments(num_channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Affine 1, 0; the initial gates (``init_groups``, ``init_batch_pool``); running statistics reset."""
        super().reset_parameters()
        with torch.no_grad():
            self.channel_gates.copy_(self._initial_channel_logits(self.init_groups))
            self.batch_gate.fill_(_GATE_LOGIT_INIT if self.init_batch_pool else -_GATE_LOGIT_INIT)

    def _initial_channel_logits(self, groups: int) -> Tensor:
        """Logits whose gates average contiguous blocks of num_channels // groups channels."""
        # A contiguous block of size 2^j * r (r > 1) or 2^j is a prefix of the fine-to-coarse factors.
        remaining = self.num_channels // groups
        logits = []
        for size in self._gated_sizes:
            on = remaining > 1 and remaining % size == 0
            remaining = remaining // size if on else remaining
            logits.append(_GATE_LOGIT_INIT if on else -_GATE_LOGIT_INIT)
        return torch.tensor(logits)

    def selected_grouping(self) -> DynamicGrouping:
        """The grouping the hard gates select now (for logging and analysis)."""
        gates_on = (self.channel_gates.detach() > 0).tolist()
        group_size = math.prod(size for size, on in zip(self._gated_sizes, gates_on) if on)
        contiguous = all(on or not later for on, later in zip(gates_on, gates_on[1:]))
        return DynamicGrouping(
            num_groups=self.num_channels // group_size,
            group_size=group_size,
            contiguous=contiguous,
            pools_batch=bool(self.batch_gate.detach() > 0),
        )

    def evaluation_form(self) -> EvaluationForm:
        """At inference (``inference``): with the batch gate on, the statistics are the running ones pooled by
        the channel gates, constants, so the layer is a ``ChannelAffine``; with it off and contiguous groups, it
        is GN with that many groups; with strided groups, itself."""
        grouping = self.selected_grouping()
        with torch.no_grad():
            if grouping.pools_batch:
                mean, var = self._pool_channels(self.running_mean[None].double(), self.running_var[None].double())
                return EvaluationForm(
                    ChannelAffine.of_statistics(mean[0], var[0], self.weight, self.bias, self.eps), None
                )
            if grouping.contiguous:
                group_norm = GroupNorm2d(self.num_channels, num_groups=grouping.num_groups, eps=self.eps)
                group_norm.to(self.weight.device, self.weight.dtype)
                group_norm.weight.copy_(self.weight)
                group_norm.bias.copy_(self.bias)
                return EvaluationForm(None, group_norm.requires_grad_(False).eval())
        return EvaluationForm(None, self)

    def scale_and_shift(self, mean_in: Tensor, var_in: Tensor, spatial_size: int) -> tuple[Tensor, Tensor]:
        """The per-(n, c) scale and shift this layer applies, y = (x - mean_in) * scale + shift, from the IN
        mean and variance of an input with ``spatial_size`` = H * W, each (N, C) or, in evaluation,
        (N, C, 1, 1); updates the running statistics in training."""
        if not torch.jit.is_scripting() and not self.training and self._gates_readable():
            mean, var = self._selected_pooling(mean_in, var_in)
        else:
            mean, var = self._pool_batch(mean_in, var_in, spatial_size)
            mean, var = self._pool_channels(mean, var)
        weight, bias = per_channel(self.weight, mean_in), per_channel(self.bias, mean_in)
        return affine_from_moments(weight, bias, mean - mean_in, var + self.eps)

    @torch.jit.unused
    def _gates_readable(self):
        """Whether evaluation may read the hard gates on the host: in a trace (where they are constants of the
        recorded graph), or with parameters on the CPU (no synchronization) when no gate needs its
        straight-through gradient; not under torch.compile / torch.export (whose parameters have no values)."""
        if torch.compiler.is_compiling():
            return False
        if torch.jit.is_tracing():
            return True
        gates_need_grad = torch.is_grad_enabled() and (
            self.channel_gates.requires_grad or self.batch_gate.requires_grad
        )
        return self.channel_gates.device.type == "cpu" and not gates_need_grad

    @torch.jit.unused
    def _selected_pooling(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
        """Evaluation's statistics with the hard gates read: the running ones if the batch gate is on, else the
        sample's, pooled over every sub-axis whose gate is on in one reduction (the law of total variance over
        equal groups), which is what the gated mixtures give at gates of exactly 0 and 1 (``_pool_batch``,
        ``_pool_channels``), in a handful of operations."""
        with warnings.catch_warnings():  # a trace records the gates as the constants they are in evaluation
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            gates_on = (self.channel_gates.detach() > 0).tolist()
            pools_batch = bool(self.batch_gate.detach() > 0)
        if pools_batch:
            mean, var = per_channel(self.running_mean, mean)[None], per_channel(self.running_var, mean)[None]
        dims = [dim for dim, on in zip(self._gated_dims, gates_on) if on]
        if not dims:
            return mean, var
        shape, rows = mean.shape, mean.shape[0]
        mean = mean.reshape([rows] + self._subaxis_shape)
        var = var.reshape([rows] + self._subaxis_shape)
        pooled = mean.mean(dims, keepdim=True)
        var = (var + (mean - pooled).square()).mean(dims, keepdim=True)
        return pooled.expand_as(mean).reshape(shape), var.expand_as(mean).reshape(shape)

    @torch.jit.unused
    def fused_plan(self, x: Tensor) -> DynamicKernels | None:
        if self._batch_average is not None or not kernel_path(x):  # the batch average pools float64 sums
            return None
        return DynamicKernels(self, x) if DynamicKernels.applies(self, x) else None

    def _pool_batch(self, mean: Tensor, var: Tensor, pixels: int):
        """Apply U: mix each sample's moments with the batch's (training; the batch's moments also go
        to the running statistics or the batch average) or with the running ones (test)."""
        if self.training and mean.shape[0] > 0:
            sums = group_sums(mean, var, pixels)
            self._track(sums)
            target_mean, target_var = moments_from_sums(sums)
            target_mean, target_var = target_mean.to(mean.dtype), target_var.to(mean.dtype)
        else:
            target_mean = per_channel(self.running_mean, mean)
            target_var = per_channel(self.running_var, mean)
        gate = _straight_through_gate(self.batch_gate).to(mean.dtype)
        return _mixture_moments(mean, var, gate, target_mean, target_var)

    def _pool_channels(self, mean: Tensor, var: Tensor):
        """Apply V: one gated 2x2 (or r x r) averaging factor per channel sub-axis."""
        shape, rows = mean.shape, mean.shape[0]
        mean = mean.reshape([rows] + self._subaxis_shape)
        var = var.reshape([rows] + self._subaxis_shape)
        gates = _straight_through_gate(self.channel_gates).to(mean.dtype)
        for gate, dim in zip(gates, self._gated_dims):
            target_mean, target_var = _pooled_moments(mean, var, dim)
            mean, var = _mixture_moments(mean, var, gate, target_mean, target_var)
        return mean.reshape(shape), var.reshape(shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, grouping={self.selected_grouping()}"
