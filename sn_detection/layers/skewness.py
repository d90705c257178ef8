"""Batch Normalization with Skewness Reduction, BNSR (Ding et al.), Alg. 1 and 2 with Eq. 6-7.

    z = (x - mu_B) / sqrt(var_B + eps),   y = gamma * phi_p(z) + beta,   phi_p(z) = sign(z) |z|^p

p = 1.01 by default (the paper's value); p = 1 is exactly BatchNorm. At test time mu_B, var_B are the
running statistics, exactly as PyTorch's ``BatchNorm2d`` keeps them: same buffer names and momentum
convention, and the *unbiased* batch variance is stored (the paper allows either estimate). The batch
average (``start_batch_average`` / ``finish_batch_average``) accordingly stores the mean and unbiased
variance of all pooled batches together, i.e. what ``BatchNorm2d(momentum=1)`` would store after one
forward of their concatenation.

Choices the paper leaves open:

- phi_p is computed in float32 (float64 for float64 inputs) whatever the input dtype.
- Its derivative p |z|^(p-1) is infinite (p < 1) or 0 (p > 1) at z = 0, which happens whenever a channel
  is constant. The gradient at exactly 0 is defined as its limit for p >= 1 (0, or 1 when p = 1) and
  as 0 for p < 1, so it is always finite.
- A batch with a single value per channel normalizes to 0 (PyTorch's BatchNorm refuses it) and, its
  unbiased variance being undefined, leaves the running variance as it was (``running``).
- The slope p |z|^(p-1) falls to 0 only at z = 0 itself: for p = 1.01 it is still 0.8 at |z| = 1e-9. So
  on a constant channel the input gradient is 0 where x - mean rounds to exactly 0, and about 0.9 times
  BatchNorm's where it rounds to a few ulps: a property of phi_p, not of rounding in this code.
"""

import torch
from torch import Tensor, nn

from .base import check_input, exporting
from .inference import ChannelAffine, EvaluationForm
from .kernels import kernel_path
from .map_passes import as_dtype, per_channel, stat_dtype
from .moment_normalizer import instance_moments, scale_shift
from .options import MOMENTUM, POSITIVE
from .running import RunningMoments, group_sums, moments_from_sums
from .skewness_kernels import SkewnessKernels


class _SignedPower(torch.autograd.Function):
    """phi_p(z) = sign(z) |z|^p with a finite derivative at z = 0 (see the module docstring)."""

    @staticmethod
    def forward(ctx, z: Tensor, p: float):
        ctx.save_for_backward(z)
        ctx.p = p
        return _signed_power_values(z, p)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (z,) = ctx.saved_tensors
        p = ctx.p
        at_zero = 1.0 if p == 1 else 0.0
        if torch.is_grad_enabled():  # create_graph: the same slope in differentiable, out-of-place operations
            zero = z == 0
            magnitude = torch.where(zero, torch.ones_like(z), z.abs())  # no infinite derivative at 0
            return torch.where(zero, torch.full_like(z, at_zero), p * magnitude.pow(p - 1)) * grad, None
        slope = z.abs().pow_(p - 1).mul_(p).masked_fill_(z == 0, at_zero)
        return slope.mul_(grad), None


def _signed_power_values(z: Tensor, p: float) -> Tensor:
    """phi_p(z) in place after one allocation (these passes are over full-size activations), with |z|^q as
    exp(q log|z|), which vectorizes where pow with a float exponent is several times slower on a CPU: for
    p > 1 as z |z|^(p - 1), a product where copysign is a slower pass (at z = 0, exp(-inf) = 0 and the product
    0); p = 1 exactly is z."""
    if p == 1:
        return z.clone()
    if p > 1:
        return z.abs().log_().mul_(p - 1).exp_().mul_(z)
    return z.abs().log_().mul_(p).exp_().copysign_(z)


def signed_power(z: Tensor, p: float) -> Tensor:
    """The skewness correction phi_p of Eq. 6."""
    if torch.jit.is_scripting() or exporting():
        # TorchScript and the exporters record no autograd Function: the same values in operations every
        # exporter knows (ONNX has no copysign), with autograd's gradient
        return torch.sign(z) * z.abs().pow(p)
    return _SignedPower.apply(z, p)


class SignedPowerAffine(nn.Module):
    """weight * phi_p(z) + bias per channel of (N, C, H, W) input: BNSR at inference after its standardization,
    which is a constant affine (``SkewnessReducedBatchNorm2d.evaluation_form``). Computed in the statistics
    dtype, returned in the input's."""

    def __init__(self, p: float, weight: Tensor, bias: Tensor):
        super().__init__()
        self.p = p
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", bias.detach().clone())

    def forward(self, z: Tensor) -> Tensor:
        zs = as_dtype(z, stat_dtype(z))
        weight, bias = per_channel(self.weight, zs), per_channel(self.bias, zs)
        if torch.jit.is_scripting() or exporting() or torch.is_grad_enabled():
            return as_dtype(signed_power(zs, self.p) * weight + bias, z.dtype)
        # one full-size allocation, every other pass in place: on a CPU the allocation of an activation costs as
        # much as a pass over it, and a broadcast multiply-add two
        return as_dtype(_signed_power_values(zs, self.p).mul_(weight).add_(bias), z.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, p={self.p}"


class SkewnessReducedBatchNorm2d(RunningMoments):
    """BNSR over (N, C, H, W) inputs; drop-in for ``BatchNorm2d`` (same parameters and buffers)."""

    option_rules = {"p": POSITIVE, "eps": POSITIVE, "momentum": MOMENTUM}
    unbiased_running_var = True

    def __init__(self, num_channels: int, *, p: float = 1.01, eps: float = 1e-5, momentum: float | None = 0.1):
        super().__init__(num_channels, p=p, eps=eps, momentum=momentum)
        self._register_running_moments(num_channels)
        self.reset_parameters()

    @torch.jit.unused
    def make_call_plan(self, x: Tensor) -> SkewnessKernels | None:
        """The kernels (``skewness_kernels``) for non-empty inputs on the kernel path; None (the PyTorch path,
        ``plain_forward``) for the others and during a batch average (its sums pool in float64)."""
        check_input(x, self.num_channels)
        if kernel_path(x) and x.numel() > 0 and self._batch_average is None:
            return SkewnessKernels(self, x)
        return None

    def evaluation_form(self) -> EvaluationForm:
        """At inference (``inference``): the standardization with the running statistics, a constant affine,
        then ``SignedPowerAffine``."""
        standardization = ChannelAffine.of_statistics(self.running_mean, self.running_var, None, None, self.eps)
        return EvaluationForm(standardization, SignedPowerAffine(self.p, self.weight, self.bias))

    @torch.jit.unused
    def exported_forward(self, x: Tensor) -> Tensor:
        """The layer as exporters record it (``base.exporting``): in evaluation Eq. 6-7 with the running
        statistics as per-channel constants, phi_p as sign(z) |z|^p; in training the plain differentiable
        forward TorchScript runs."""
        if self.training:
            return self.scripted_forward(x)
        check_input(x, self.num_channels)
        xs = as_dtype(x, stat_dtype(x))
        mean, var = per_channel(self.running_mean, xs), per_channel(self.running_var, xs)
        z = (xs - mean) / torch.sqrt(var + self.eps)
        return as_dtype(signed_power(z, self.p) * per_channel(self.weight, xs) + per_channel(self.bias, xs), x.dtype)

    def plain_forward(self, x: Tensor) -> Tensor:
        """Eq. 6-7 in tensor operations (the batch's statistics in training, moving the running ones; the running
        ones in evaluation): the layer's PyTorch path, its TorchScript form and the kernels' oracle."""
        mean, var = self._batch_statistics(x) if self.training else (self.running_mean, self.running_var)
        # buffers and parameters too: a model converted with .half() keeps fp16 ones
        dtype, (n, c) = stat_dtype(x), x.shape[:2]
        mean, var, weight, bias = (t.to(dtype).expand(n, c) for t in (mean, var, self.weight, self.bias))
        inv_std = torch.rsqrt(var + self.eps)
        zeros = torch.zeros_like(inv_std)
        # centred at the batch mean, not folded into x * a + b: see ``moment_normalizer``
        z = scale_shift(x.to(dtype), inv_std, zeros, mean)
        y = scale_shift(signed_power(z, self.p), weight, bias, zeros)
        return y.to(x.dtype)

    def _batch_statistics(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean_in, var_in = instance_moments(x)
        sums = group_sums(mean_in, var_in, x.shape[2] * x.shape[3])
        self._track(sums)
        mean, var = moments_from_sums(sums)
        return mean.to(mean_in.dtype), var.to(mean_in.dtype)
