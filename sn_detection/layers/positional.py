"""Positional Normalization, PONO, and its Moment Shortcut, MS (Li et al., NeurIPS 2019).

    mu_{n,h,w} = mean_c x_{n,c,h,w},  sigma_{n,h,w} = sqrt(var_c x_{n,c,h,w} + eps),  PONO(x) = (x - mu) / sigma
    MS(x, mu, sigma) = x * sigma + mu

The statistics have shape (N, 1, H, W) and are computed from the sample itself, so there are no running
statistics and training and evaluation behave identically. Choices:

- The variance is the biased one over channels, as in the paper's TensorFlow listing (``tf.nn.moments``);
  the paper's typeset formula, which subtracts mu from x^2 rather than squaring (x - mu), is a typo.
- ``PositionalNorm2d`` adds a per-channel affine (``weight``, ``bias`` of shape (C,)) so that it is a
  drop-in for BN / GN as a detectron2 norm type; it then equals detectron2's channel-wise ``LayerNorm``.
- Statistics and normalization are computed in at least float32, and the output has the input's dtype.

On the kernel path (``map_passes.kernel_path``: CUDA, or Triton's interpreter) the layer runs as one Triton
kernel forward and two backward (``positional_kernels``); elsewhere, and under TorchScript, as tensor
operations, which are also the kernels' oracle in the tests.
"""

import torch
from torch import Tensor

from .base import NormBase
from .map_passes import as_dtype, exporting, stat_dtype
from .moment_normalizer import check_input, per_channel
from .options import POSITIVE
from .positional_kernels import PositionalKernels, positional_norm, supports


def pono(x: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """(normalized, mean, std) of PONO for an (N, C, H, W) x; mean and std are (N, 1, H, W), float32+."""
    xs = as_dtype(x, stat_dtype(x))
    # the mean as one channel's value plus the mean offset from it: a plain mean of C large values keeps
    # only their last place, the offsets keep as many digits as their spread
    shift = xs[:, :1]
    centered = xs - shift
    offset = centered.mean(1, keepdim=True)
    centered = centered - offset
    # two passes rather than torch.var_mean, which warns on empty batches
    std = torch.sqrt(centered.square().mean(1, keepdim=True) + eps)
    return centered / std, shift + offset, std


def moment_shortcut(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """MS: re-inject PONO moments taken elsewhere in the network, x * std + mean."""
    return x * std + mean


class PositionalNorm2d(NormBase):
    """PONO followed by a per-channel affine."""

    option_rules = {"eps": POSITIVE}

    def __init__(self, num_channels: int, *, eps: float = 1e-5):
        super().__init__(num_channels, eps=eps)
        self.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            check_input(x, self.num_channels)
            return self._autograd_forward(x)
        return self._kernel_or_autograd_forward(x)

    @torch.jit.unused
    def _kernel_or_autograd_forward(self, x: Tensor) -> Tensor:
        if exporting():  # plain operations (``map_passes.exporting``)
            check_input(x, self.num_channels)
            return self._autograd_forward(x)
        plan = self.call_plan(x)
        if plan is not None:
            weight, bias = self.parameter_tuple()
            return positional_norm(self, plan, x, weight, bias)
        return self._autograd_forward(x)

    @torch.jit.unused
    def make_call_plan(self, x: Tensor) -> PositionalKernels | None:
        """The Triton kernels (``positional_kernels``) where they take x and the parameters; None (the
        autograd path) elsewhere."""
        check_input(x, self.num_channels)
        return PositionalKernels(x) if supports(x, self.weight, self.bias) else None

    @torch.jit.unused
    def replayed_forward(self, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """The layer in plain differentiable operations with the given weight and bias (those of the call a
        backward under create_graph differentiates)."""
        return _affine_pono(x, weight, bias, self.eps)

    def _autograd_forward(self, x: Tensor) -> Tensor:
        """The layer in tensor operations with autograd: the oracle of the kernels, and the path wherever
        they do not apply (float64, other layouts, empty inputs, TorchScript)."""
        return _affine_pono(x, self.weight, self.bias, self.eps)


def _affine_pono(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    if not torch.jit.is_scripting() and not exporting() and not torch.is_grad_enabled():
        return _evaluated_affine_pono(x, weight, bias, eps)
    normalized, _, _ = pono(x, eps)
    y = torch.addcmul(bias[:, None, None], normalized, weight[:, None, None])
    return as_dtype(y, x.dtype)


@torch.jit.unused
def _evaluated_affine_pono(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """``_affine_pono`` without gradients: the same statistics (``pono``'s shifted mean, the two-pass
    variance, as the vector norm of the centred values) with one full-size allocation and every other pass in
    place (on a CPU an activation's allocation costs as much as a pass over it, a broadcast multiply-add two)."""
    xs = as_dtype(x, stat_dtype(x))
    centred = xs - xs[:, :1]
    centred.sub_(centred.mean(1, keepdim=True))
    channels = max(x.shape[1], 1)
    inv_std = torch.rsqrt(torch.linalg.vector_norm(centred, dim=1, keepdim=True).square_().div_(channels).add_(eps))
    y = centred.mul_(inv_std).mul_(per_channel(weight, centred)).add_(per_channel(bias, centred))
    return as_dtype(y, x.dtype)
