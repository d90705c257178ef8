"""What a norm layer is at inference: ``evaluation_form(module)``, the cheapest modules that compute what the
layer computes in evaluation mode, from its parameters and buffers as they are now.

In evaluation a layer's parameters and running statistics are constants, and its output depends on the
sample only through what the paper's statistics take from it. Worked out once, many layers are then less
than they look:

- BatchNorm with its running statistics (torch's, detectron2's ``FrozenBatchNorm2d``), DN whose batch gate
  is on and MN with one mode are a per-channel constant affine, y = x * scale + shift
  (``ChannelAffine``), which merges into the weights of a convolution before it (``fold_into_conv``) and
  then costs nothing;
- BNSR is that affine (its standardization) followed by phi_p and its own affine
  (``skewness.SignedPowerAffine``);
- DN whose channel gates pool contiguous groups is exactly GN with that many groups (``GroupNorm2d``, one
  fused moments-and-affine kernel): GN's statistics of a group are the pooled IN statistics of its
  channels, and DN adds eps after pooling, as GN does;
- the others (SN, SyncSN, DN with strided groups, MN, MGN, GN, PONO) already evaluate as one moments
  pass and one affine pass: their form is the layer itself, frozen.

A form is an ``EvaluationForm(affine, module)``: the layer's evaluation output is ``module(affine(x))``, where
either part may be None (nothing to do). Each layer class of this package says its own form
(``evaluation_form()``); this module adds torch's BatchNorm. ``sn_detection.d2.fold_norms`` applies the
forms to a whole detectron2 model.

The forms are equal to the layer in evaluation mode up to float32 rounding (the tests hold them to 1e-5
relative): they take the same statistics of the sample and differ only in the order of the constant
arithmetic. They are for inference only: the parameters they hold are copies, frozen, and a form keeps
no running statistic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ChannelAffine(nn.Module):
    """y = x * scale + shift per channel of (N, C, H, W) input: what a layer whose evaluation output is a
    constant affine becomes (``evaluation_form``). ``scale`` and ``shift`` are float32 buffers; the output
    has the input's dtype."""

    def __init__(self, scale: Tensor, shift: Tensor):
        super().__init__()
        self.register_buffer("scale", scale.detach().float().clone())
        self.register_buffer("shift", shift.detach().float().clone())

    @classmethod
    def of_statistics(cls, mean: Tensor, var: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float):
        """The affine of weight * (x - mean) / sqrt(var + eps) + bias (no weight: 1, no bias: 0), computed in
        float64 so that its two constants are rounded once each."""
        mean, var = mean.detach().double(), var.detach().double()
        scale = 1 / torch.sqrt(var + eps)
        if weight is not None:
            scale = scale * weight.detach().double()
        shift = -mean * scale
        if bias is not None:
            shift = shift + bias.detach().double()
        return cls(scale, shift)

    def forward(self, x: Tensor) -> Tensor:
        return channel_affine(x, self.scale, self.shift)

    def extra_repr(self) -> str:
        return f"{self.scale.numel()}"


# BatchNorm's evaluation kernel as a per-channel affine: running variance 1 and an eps that changes nothing
# (it rounds to 0 in float32 and vanishes against 1 in float64; torch refuses eps <= 0 in places)
_NO_EPS = 1e-300


def channel_affine(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """x * scale + shift per channel of (N, C, ...) x, in x's dtype: BatchNorm's evaluation kernel (mean 0,
    variance 1), one fused pass where a broadcast multiply-add takes twice as long on a CPU, and one operator
    (BatchNormalization) in an exported graph."""
    scale, shift = scale.to(x.dtype), shift.to(x.dtype)
    zeros, ones = torch.zeros_like(scale), torch.ones_like(scale)
    return F.batch_norm(x, zeros, ones, scale, shift, False, 0.0, _NO_EPS)


class EvaluationForm(NamedTuple):
    """A layer at inference: ``module(affine(x))``, either part None for nothing (module docstring)."""

    affine: ChannelAffine | None
    module: nn.Module | None


def evaluation_form(module: nn.Module) -> EvaluationForm | None:
    """The form of ``module`` at inference (module docstring): a layer of this package says its own; torch's
    BatchNorm (1d-3d, SyncBatchNorm) with running statistics is a ``ChannelAffine``. None for a module that
    is neither (its caller leaves it as it is)."""
    own = getattr(module, "evaluation_form", None)
    if own is not None and callable(own):
        return own()
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
        return EvaluationForm(
            ChannelAffine.of_statistics(
                module.running_mean, module.running_var, module.weight, module.bias, module.eps
            ),
            None,
        )
    return None


def fold_into_conv(conv: nn.Conv2d, affine: ChannelAffine) -> None:
    """Merge ``affine`` applied after ``conv`` into the convolution's weight and bias, in place:
    conv'(x) = scale * conv(x) + shift. The arithmetic is float64, rounded once to the weights' dtype."""
    if conv.out_channels != affine.scale.numel():
        raise ValueError(
            f"cannot fold a {affine.scale.numel()}-channel affine into a convolution with {conv.out_channels} "
            "output channels"
        )
    with torch.no_grad():
        scale = affine.scale.double()
        weight = conv.weight.double() * scale.view(-1, *([1] * (conv.weight.dim() - 1)))
        bias = affine.shift.double()
        if conv.bias is not None:
            bias = bias + conv.bias.double() * scale
        conv.weight.copy_(weight.to(conv.weight.dtype))
        if conv.bias is None:
            conv.bias = nn.Parameter(bias.to(conv.weight.dtype), requires_grad=conv.weight.requires_grad)
        else:
            conv.bias.copy_(bias.to(conv.bias.dtype))
