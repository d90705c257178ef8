"""Group Normalization (Wu and He, ECCV 2018) with detectron2's default of 32 groups.

    y = gamma * (x - mu_g) / sqrt(var_g + eps) + beta,  moments over (C / G channels of a group, H, W)

A subclass of ``torch.nn.GroupNorm`` so that parameters (``weight``, ``bias`` of shape (C,)) and state
dicts are PyTorch's, and code that recognises torch's GroupNorm (detectron2's optimizer rules for norm
parameters, converters) recognises it; and of this package's ``NormBase``, for the constructor's checks,
the saved identity, freezing and ``extra_repr``. Two things change from PyTorch's. The constructor takes
the channel count first, like the other layers of this package, and fails with both numbers when they do
not divide. The forward computes in at least float32 and returns the input's dtype, so fp16 inputs and
bf16 autocast regions (where PyTorch would return float32) behave as for the other layers; so does a
layer whose parameters were converted to fp16 or bf16.
"""

import torch.nn.functional as F
from torch import Tensor, nn

from .base import NormBase, check_input
from .map_passes import stat_dtype
from .options import POSITIVE, POSITIVE_INT


class GroupNorm2d(NormBase, nn.GroupNorm):
    """GN over (N, C, H, W) inputs with ``num_groups`` groups of channels.

    ``nn.GroupNorm``'s constructor builds it (``weight``, ``bias`` and its attributes, then
    ``reset_parameters``, the base's: affine 1, 0, as torch's); the base's constructor, which would build
    the same, is not run, but its checks are."""

    option_rules = {"num_groups": POSITIVE_INT, "eps": POSITIVE}

    def __init__(self, num_channels: int, *, num_groups: int = 32, eps: float = 1e-5):
        self.check_arguments(num_channels, num_groups=num_groups, eps=eps)
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm2d: num_channels={num_channels} is not divisible by num_groups={num_groups}")
        nn.GroupNorm.__init__(self, num_groups, num_channels, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.num_channels)
        dtype = stat_dtype(x)  # parameters too: a model converted with .half() keeps fp16 ones
        weight, bias = self.weight, self.bias
        if x.dtype == weight.dtype == bias.dtype == dtype:  # nothing to cast (no call: host time on a GPU)
            return F.group_norm(x, self.num_groups, weight, bias, self.eps)
        y = F.group_norm(x.to(dtype), self.num_groups, weight.to(dtype), bias.to(dtype), self.eps)
        return y.to(x.dtype)
