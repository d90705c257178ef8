"""Switchable Normalization (Luo, Ren, Peng, ICLR 2019), Eq. 3-5, and its synchronized variant.

    y = gamma * (x - sum_k w_k mu_k) / sqrt(sum_k w'_k var_k + eps) + beta,   k in [IN, LN, BN]

with w = softmax(mean_weight), w' = softmax(var_weight) (Eq. 4; two independent softmaxes). The IN
moments are computed once and LN / BN moments derived from them (Eq. 5, see ``moment_normalizer``); the
normalization and the affine are folded into one per-(n, c) scale and shift.

Choices the paper leaves open, and how they are settled here:

- Logits are initialised to 1 (the paper's lambda = 1), ordered [IN, LN, BN] like the authors'
  checkpoints, which store logits rather than weights. ``use_bn=False`` drops the BN branch (2 logits
  each), as the authors do with one image per GPU, where BN equals IN in training.
- At test time IN and LN statistics still come from the sample itself; only the BN branch uses stored
  ``running_mean`` / ``running_var``. In training they follow PyTorch's momentum convention,
  ``running = (1 - momentum) * running + momentum * batch`` (the original code's ``momentum=0.9`` is
  the opposite convention, i.e. 0.1 here), and store the *biased* batch variance, the one the layer
  normalizes with (PyTorch's BatchNorm stores the unbiased one). Momentum ``None`` is BatchNorm's
  cumulative average (momentum 1 / num_batches_tracked: every batch weighs the same).
- The paper's "batch average" (Sec. 2.1, Inference) is the protocol ``start_batch_average()`` /
  ``finish_batch_average()``: in between, training-mode forwards pool the exact per-channel sums of
  the BN branch instead of updating the moving average, and ``finish`` stores their mean and variance
  (the statistics of the concatenation of all those batches). ``num_batches_tracked`` is not changed.
- With ``use_bn=False`` there is nothing to estimate: the layer has no buffers, behaves identically in
  training and evaluation, and the batch-average methods do nothing.
- An empty batch (N = 0) yields an empty output and leaves the buffers untouched.

``SyncSwitchableNorm2d`` pools the BN branch over all processes: each one all-reduces its per-channel
(sum, sum of squares, count), so unequal and even empty per-process batches are weighted exactly, and
the all-reduce is differentiable so gradients flow across processes as in one big batch. As with
``torch.nn.SyncBatchNorm``, every process must run each training forward and backward of the layer
(its all-reduce and that of its gradient): a process with an empty batch still calls the layer and
lets its empty output reach the loss. The batch average pools the already all-reduced sums, so every
process stores the same statistics. Without an initialized process group (or with one process) the
layer is exactly ``SwitchableNorm2d``.

The closed forms of the statistics and their gradients, as Triton kernels and as tensor operations, are
``switchable_kernels``; SyncSN's all-reduces sit between its kernels there.
"""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor, nn

from .fused import FusedPlan
from .inference import EvaluationForm
from .kernels import kernel_path
from .map_passes import as_dtype, per_channel
from .moment_normalizer import MomentNormalizer, affine_from_moments
from .options import BOOLEAN, MOMENTUM, POSITIVE
from .running import MomentSums, RunningMoments, group_sums, moments_from_sums
from .switchable_kernels import SwitchableClosedForms, SwitchableKernels


class SwitchableNorm2d(MomentNormalizer, RunningMoments):
    """Switchable Normalization over (N, C, H, W) inputs; see the module docstring."""

    option_rules = {"eps": POSITIVE, "momentum": MOMENTUM, "use_bn": BOOLEAN}
    gate_parameters = ("mean_weight", "var_weight")
    branch_mapping = "softmax"  # the mapping from logits to weights in the fused kernels

    def __init__(self, num_channels: int, *, eps: float = 1e-5, momentum: float | None = 0.1, use_bn: bool = True):
        super().__init__(num_channels, eps=eps, momentum=momentum, use_bn=use_bn)
        num_branches = 3 if use_bn else 2
        self.mean_weight = nn.Parameter(torch.empty(num_branches))
        self.var_weight = nn.Parameter(torch.empty(num_branches))
        if use_bn:
            self._register_running_moments(num_channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Affine 1, 0; every logit 1 (the paper's lambda = 1: equal importance); running statistics reset."""
        super().reset_parameters()
        nn.init.ones_(self.mean_weight)
        nn.init.ones_(self.var_weight)

    def scale_and_shift(self, mean_in: Tensor, var_in: Tensor, spatial_size: int) -> tuple[Tensor, Tensor]:
        """The per-(n, c) scale and shift this layer applies, y = (x - mean_in) * scale + shift, from the IN
        mean and variance of an input with ``spatial_size`` = H * W, each (N, C) or, in evaluation,
        (N, C, 1, 1); updates the running statistics in training. Only the branches of ``used_branches()``
        are computed. The means enter as offsets from mean_in (IN's own offset is 0): differences of nearby
        values keep their digits, which the centred output needs (``moment_normalizer``)."""
        mean_weights, var_weights = self.branch_weights(mean_in.dtype)
        used = self.used_branches()
        offsets: list[Tensor] = []
        variances: list[Tensor] = []
        if used[0]:
            variances.append(var_weights[0] * var_in)
        if used[1]:
            to_in, var_ln = layer_moments(mean_in, var_in)
            offsets.append(-mean_weights[1] * to_in)
            variances.append(var_weights[1] * var_ln)
        if used[2]:
            mean_bn, var_bn = self._batch_branch(mean_in, var_in, spatial_size)
            offsets.append(mean_weights[2] * (mean_bn - mean_in))
            variances.append(var_weights[2] * var_bn + self.eps)  # in evaluation one constant: one operation
        var_eps = _sum(variances) if used[2] else _sum(variances) + self.eps
        offset = _sum(offsets) if len(offsets) > 0 else torch.zeros_like(mean_in)
        return affine_from_moments(per_channel(self.weight, mean_in), per_channel(self.bias, mean_in), offset, var_eps)

    def branch_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The importance weights of the branches [IN, LN(, BN)] for the means and for the variances (Eq. 4),
        in ``dtype``: softmax(mean_weight), softmax(var_weight)."""
        # in the statistics' dtype even for fp16 logits (model.half())
        return torch.softmax(self.mean_weight.to(dtype), 0), torch.softmax(self.var_weight.to(dtype), 0)

    def used_branches(self) -> list[bool]:
        """Whether the mixture computes each branch [IN, LN, BN]: every branch the layer has."""
        return [True, True, self.use_bn]

    def logit_gradients(
        self, mean_weights: Tensor, var_weights: Tensor, grad_mean_weights: Tensor, grad_var_weights: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The gradients of ``mean_weight`` and ``var_weight`` from those of the weights ``branch_weights``
        gave (the closed forms' backward): the softmax's, w * (g - sum_k w_k g_k)."""
        return _softmax_backward(mean_weights, grad_mean_weights), _softmax_backward(var_weights, grad_var_weights)

    def evaluation_form(self) -> EvaluationForm:
        """At inference (``inference``): ``FrozenSwitchableNorm2d``, the layer with its weights as constants."""
        return EvaluationForm(None, FrozenSwitchableNorm2d.of(self))

    @torch.jit.unused
    def fused_plan(self, x: Tensor) -> FusedPlan | None:
        if self.use_bn and self._batch_average is not None:  # the batch average pools float64 sums
            return None
        return SwitchableKernels(self, x) if kernel_path(x) else SwitchableClosedForms(self, x)

    def _batch_branch(self, mean_in: Tensor, var_in: Tensor, spatial_size: int) -> tuple[Tensor, Tensor]:
        if not self.training:
            return per_channel(self.running_mean, mean_in), per_channel(self.running_var, mean_in)
        sums = self._reduce(group_sums(mean_in, var_in, spatial_size))
        self._track(sums)
        mean, var = moments_from_sums(sums)
        return mean.to(mean_in.dtype), var.to(mean_in.dtype)

    def _reduce(self, sums: MomentSums) -> MomentSums:
        """Pools the BN-branch sums over the units that share statistics; here, this process only."""
        return sums


class FrozenSwitchableNorm2d(SwitchableNorm2d):
    """SN (SyncSN, SSN) at inference, its ``evaluation_form``: the layer's importance weights as they are now,
    kept as the buffers ``frozen_mean_weights`` and ``frozen_var_weights`` (float32), which its torch path and
    its exports read as constants instead of recomputing them from the logits; the logits are log(weights), so
    that the fused kernels' softmax gives the same weights (a weight of 0, which SSN's SparsestMax gives, has
    logit -inf and stays 0). Only the branches some weight uses are computed. Its parameters are frozen, so it
    stays in evaluation mode (``base``)."""

    option_rules = dict(SwitchableNorm2d.option_rules)  # its own: the identity names it (not SN's, whose keys differ)

    def __init__(self, num_channels: int, *, eps: float = 1e-5, momentum: float | None = 0.1, use_bn: bool = True):
        super().__init__(num_channels, eps=eps, momentum=momentum, use_bn=use_bn)
        branches = 3 if use_bn else 2
        self.register_buffer("frozen_mean_weights", torch.full((branches,), 1 / branches))
        self.register_buffer("frozen_var_weights", torch.full((branches,), 1 / branches))
        self._used = [True, True, use_bn]

    @classmethod
    def of(cls, layer: SwitchableNorm2d) -> "FrozenSwitchableNorm2d":
        """The frozen form of ``layer`` (in evaluation mode: its weights and statistics as they are now)."""
        frozen = cls(layer.num_channels, eps=layer.eps, momentum=layer.momentum, use_bn=layer.use_bn)
        frozen.to(layer.weight.device)
        with torch.no_grad():
            mean_weights, var_weights = layer.branch_weights(torch.float32)
            frozen.frozen_mean_weights.copy_(mean_weights)
            frozen.frozen_var_weights.copy_(var_weights)
            frozen.mean_weight.copy_(_logits_of(mean_weights))
            frozen.var_weight.copy_(_logits_of(var_weights))
            frozen.weight.copy_(layer.weight)
            frozen.bias.copy_(layer.bias)
            if layer.use_bn:
                for name in ("running_mean", "running_var", "num_batches_tracked"):
                    getattr(frozen, name).copy_(getattr(layer, name))
        used = (mean_weights != 0) | (var_weights != 0)
        frozen._used = [bool(used[k]) if k < len(used) else False for k in range(3)]
        return frozen.requires_grad_(False).eval()

    def branch_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The weights the layer had when frozen, in ``dtype``."""
        return as_dtype(self.frozen_mean_weights, dtype), as_dtype(self.frozen_var_weights, dtype)

    def used_branches(self) -> list[bool]:
        """The branches some frozen weight uses."""
        return self._used

    def evaluation_form(self):
        return EvaluationForm(None, self)


class SyncSwitchableNorm2d(SwitchableNorm2d):
    """SN whose BN branch pools statistics over all processes of the default process group."""

    @torch.jit.unused
    def fused_plan(self, x: Tensor) -> FusedPlan | None:
        if not (self.training and self.use_bn and _several_processes()):
            return super().fused_plan(x)
        if self._batch_average is not None or not kernel_path(x):  # the autograd path's all-reduce
            return None
        return SwitchableKernels(self, x, pooled=True)

    @torch.jit.unused
    def exported_forward(self, x: Tensor) -> Tensor:
        """SN's (``moment_normalizer``), except in training across several processes, which no exporter can
        record: the BN branch all-reduces over the process group."""
        if self.training and self.use_bn and _several_processes():
            raise RuntimeError(
                "SyncSwitchableNorm2d cannot be exported in training mode across several processes: its BN branch "
                "all-reduces over the process group, which no exporter records. Export the model in evaluation "
                "mode (model.eval()), where SyncSN computes what SN does"
            )
        return super().exported_forward(x)

    @torch.jit.unused
    def plan_context(self) -> bool:
        """Whether the BN branch pools over several processes: a plan made before the process group was
        initialized (or after it was destroyed) is not taken."""
        return _several_processes()

    def _reduce(self, sums: MomentSums) -> MomentSums:
        if torch.jit.is_scripting():
            raise RuntimeError(
                "SyncSwitchableNorm2d cannot all-reduce under TorchScript (torch.distributed's differentiable "
                "all_reduce is Python only): run a scripted model in evaluation mode"
            )
        if not _several_processes():
            return sums
        # one collective for all three float64 sums; a process with an empty batch contributes zeros
        packed = dist_fn.all_reduce(torch.cat([sums.count.view(1), sums.total, sums.total_sq]))
        count, total, total_sq = packed.split([1, self.num_channels, self.num_channels])
        return MomentSums(count.squeeze(0), total, total_sq)


def _several_processes() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _softmax_backward(weights: Tensor, grad_weights: Tensor) -> Tensor:
    """The gradient of the logits of ``weights = softmax(logits)``."""
    return weights * (grad_weights - (weights * grad_weights).sum())


# the logit of a weight of 0: its softmax underflows to exactly 0 in float32 and float64 (and it is finite: a
# checkpoint refuses Inf)
_ZERO_WEIGHT_LOGIT = -1e4


def _logits_of(weights: Tensor) -> Tensor:
    """Logits whose softmax is ``weights``: their logarithms, ``_ZERO_WEIGHT_LOGIT`` for zeros."""
    return torch.where(weights > 0, weights.clamp_min(torch.finfo(weights.dtype).tiny).log(), _ZERO_WEIGHT_LOGIT)


def layer_moments(mean_in: Tensor, var_in: Tensor) -> tuple[Tensor, Tensor]:
    """LN's statistics from the IN ones (Eq. 5, pooled over channels): each map's mean's deviation from its
    sample's, mean_in - mu_ln, and var_ln, written as the law of total variance, which subtracts no large
    second moments."""
    to_in = mean_in - mean_in.mean(1, keepdim=True)
    return to_in, (var_in + to_in.square()).mean(1, keepdim=True)


def _sum(terms: list[Tensor]) -> Tensor:
    """The sum of ``terms`` (at least one), broadcast; a loop TorchScript compiles."""
    total = terms[0]
    for k in range(1, len(terms)):
        total = total + terms[k]
    return total
