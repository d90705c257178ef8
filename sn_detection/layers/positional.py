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

On the kernel path (``kernels.kernel_path``: CUDA, or Triton's interpreter) the layer runs as one Triton
kernel forward and two backward (``positional_kernels``); elsewhere, and under TorchScript, as tensor
operations (``plain_forward``), which are also the kernels' oracle in the tests.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import NormBase, check_input, exporting
from .map_passes import as_dtype, per_channel, stat_dtype
from .options import POSITIVE
from .positional_kernels import PositionalKernels, supports


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

    @torch.jit.unused
    def make_call_plan(self, x: Tensor) -> PositionalKernels | None:
        """The Triton kernels (``positional_kernels``) where they take x and the parameters; None (the PyTorch
        path, ``plain_forward``) elsewhere."""
        check_input(x, self.num_channels)
        return PositionalKernels(x) if supports(x, self.weight, self.bias) else None

    def plain_forward(self, x: Tensor) -> Tensor:
        """PONO and the affine in tensor operations: the layer's PyTorch path (float64, other layouts, empty
        inputs), its TorchScript and exported forms, and the kernels' oracle."""
        return _affine_pono(x, self.weight, self.bias, self.eps)


def _affine_pono(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    if not torch.jit.is_scripting() and not exporting() and not torch.is_grad_enabled():
        return _evaluated_affine_pono(x, weight, bias, eps)
    normalized, _, _ = pono(x, eps)
    y = torch.addcmul(bias[:, None, None], normalized, weight[:, None, None])
    return as_dtype(y, x.dtype)


@torch.jit.unused
def _evaluated_affine_pono(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """``_affine_pono`` without gradients, returned contiguous: ``pono``'s shifted values, then each sample's
    (C, H * W) view through BatchNorm's training-mode kernel, whose "channels" are then the positions and
    whose batch is the channels, so that it makes PONO's two-pass moments over the channels and normalizes
    in one call, whose result the weight scales into place. The shift keeps the moments exact whatever a
    position's mean-to-spread ratio (BatchNorm's summed mean alone is a few units of its last place off).
    Its reductions run along contiguous rows, where broadcast reductions over the channels would cross the
    strided channel axis."""
    xs = as_dtype(x, stat_dtype(x))
    centred = torch.empty(xs.shape, dtype=xs.dtype, device=xs.device)
    torch.sub(xs, xs[:, :1], out=centred)
    channels = x.shape[1]
    scale = as_dtype(weight, centred.dtype).view(-1, 1)
    for sample in centred:
        rows = sample.view(channels, -1)
        # one channel: the shifted values, zeros, are the normalized ones (BatchNorm refuses a batch of one)
        normalized = F.batch_norm(rows, None, None, training=True, eps=eps) if channels > 1 else rows
        torch.mul(normalized, scale, out=rows)
    y = centred.add_(per_channel(bias, centred))
    return as_dtype(y, x.dtype)
