"""The four passes over full-size (N, C, H, W) tensors in PyTorch operations (``TorchPasses``): the same API as
the Triton passes of the kernel path (``kernels.TritonPasses``), on blocks that are tuples of (N, C) tensors,
for the layers' PyTorch path, and the plain statistics the layers' TorchScript and exported forms are made of.
Everything between the passes is small (N, C) code (``moment_normalizer``):

- ``moments(x, residual)``: the IN mean and biased variance of every (n, c) map, and with ``residual`` each
  mean's residual (below);
- ``scale_shift(x, affine, moments)``: (x - mean) * scale + shift per map;
- ``centered_dot_and_sum(grad_y, x, moments)``: sum(grad_y * (x - mean)) and sum(grad_y) per map;
- ``grad_input(grad_y, x, affine, pq, moments, residual)``: grad_y * scale + (x - mean - residual) * p + q
  (without ``residual``: x - mean).

Statistics are in the statistics dtype (``stat_dtype``: float32, float64 for float64 inputs); full-size
outputs have x's dtype.

The residual. A map whose mean is 1e4 times its spread loses digits of its spread to rounding its mean m
to the statistics dtype (m = mean + residual). The backward's p term is the derivative of the variance,
2 (x - m) / HW, taken at the exact mean, and ``grad_input`` with the residual keeps it there (the
autograd path gets the same from differentiating through the rounded mean, whose deviations do not sum
to 0).

``moments`` (``plain_moments``) reads x once for sum(x) and once for sum(x^2) in fp32, and computes the
(rare) maps whose mean exceeds three times their spread, where E[x^2] - E[x]^2 and a summed mean lose digits,
again in float64 by the centred two-pass formula (a traced model runs this branch always, since the tracer
cannot record a data-dependent branch); the affine passes and the backward's dot product go through
BatchNorm's evaluation kernels on the (1, N*C, H*W) view, whose forward is exactly
(x - mean) * weight / sqrt(var + eps) + bias and whose backward computes exactly the two sums (with
mean = center, var = 1, eps = 0), in one fused pass each rather than several broadcasting ops (full-size
passes dominate the layer's cost). Under autograd (a differentiable backward: create_graph) the passes are
plain differentiable operations, and so are ``plain_moments`` and ``plain_scale_shift``, which TorchScript
compiles; ``centred_moments`` is what exporters record (``base.exporting``).
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in ``dtype``: x itself when it has it already, where ``x.to(dtype)`` would still be recorded by a tracer
    (an exported graph's Cast that does nothing)."""
    return x if x.dtype == dtype else x.to(dtype)


def per_channel(vector: Tensor, like: Tensor) -> Tensor:
    """A per-channel (C,) vector in the dtype of ``like`` and shaped to broadcast against it: per-(n, c)
    statistics (N, C) as it is, (N, C, 1, 1) statistics or (N, C, H, W) maps as (C, 1, 1)."""
    vector = as_dtype(vector, like.dtype)
    return vector if like.dim() == 2 else vector.view(-1, 1, 1)


# Above this ratio mean^2 / var, a map's moments are recomputed in float64: a summed fp32 mean is a few
# units of its last place off, and E[x^2] - E[x]^2 loses log10(ratio) digits.
_ILL_CONDITIONED = 10.0


def plain_mean(x: Tensor) -> Tensor:
    """The IN mean (N, C) of x in the statistics dtype, from one read of x (the float32 sum, a few units of its
    last place from the exact mean)."""
    return as_dtype(x, stat_dtype(x)).sum((2, 3)) / max(x.shape[2] * x.shape[3], 1)


def plain_moments(x: Tensor, ill_conditioned: float = _ILL_CONDITIONED) -> tuple[Tensor, Tensor, Tensor]:
    """The IN mean and biased variance (N, C) of x, in the statistics dtype, and the residual of each mean
    (module docstring): the float64 mean's part that rounding to the statistics dtype took off, for the maps
    recomputed in float64; 0 for the others, whose mean is within a few units of its last place of a spread at
    least a third of it. Plain tensor operations, which TorchScript compiles (the threshold is an argument
    because it reads no global float)."""
    xs = x.to(stat_dtype(x))
    count = max(xs.shape[2] * xs.shape[3], 1)
    mean = xs.sum((2, 3)) / count
    mean_sq = torch.linalg.vector_norm(xs, dim=(2, 3)).square() / count
    var = (mean_sq - mean.square()).clamp(min=0)
    recompute = mean.square() > ill_conditioned * var
    residual = torch.zeros_like(mean)
    if torch.jit.is_tracing() or bool(recompute.any()):
        maps = xs.flatten(2)[recompute].double()
        exact_mean = maps.mean(1)
        rounded = exact_mean.to(mean.dtype)
        # index_put, not `t[mask] = v`: the tracer records the latter with the value's shape of the moment
        mean = mean.index_put((recompute,), rounded)
        var = var.index_put((recompute,), (maps - exact_mean[:, None]).square().mean(1).to(var.dtype))
        residual = residual.index_put((recompute,), (exact_mean - rounded.double()).to(mean.dtype))
    return mean, var, residual


def centred_moments(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(mean, x - mean, variance) of every (n, c) map of x in the statistics dtype, mean and variance of shape
    (N, C, 1, 1): the two-pass formula in the fewest plain operations (a mean, a subtraction, a product, a
    mean), with no branch and no float64, which every exporter records as it is and every runtime runs. Its
    variance is accurate whatever a map's mean-to-spread ratio (the deviations are taken from the float32
    mean, which is within a few units of its last place of the exact one); the price is a full-size
    temporary, which the exported model's runtime fuses or pays, and the eager layers avoid (``moments``)."""
    xs = as_dtype(x, stat_dtype(x))
    mean = xs.mean((2, 3), keepdim=True)
    centred = xs - mean
    return mean, centred, (centred * centred).mean((2, 3), keepdim=True)


def plain_scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """(x - center) * scale + shift with scale, shift and center broadcastable to (N, C), computed in their
    dtype and returned in x's, in plain differentiable operations (TorchScript, create_graph)."""
    size = [x.shape[0], x.shape[1]]
    scale, shift, center = scale.expand(size), shift.expand(size), center.expand(size)
    centered = x.to(scale.dtype) - center[:, :, None, None]
    return torch.addcmul(shift[:, :, None, None], centered, scale[:, :, None, None]).to(x.dtype)


class TorchPasses:
    """The four passes in PyTorch operations, for any x, on blocks that are tuples of (N, C) tensors (module
    docstring): static methods, used as the class itself."""

    @staticmethod
    def moments(x: Tensor, residual: bool = False) -> tuple[Tensor, ...]:
        """The moments block: mean, variance and, with ``residual``, each mean's residual."""
        mean, var, mean_residual = plain_moments(x)
        return (mean, var, mean_residual) if residual else (mean, var)

    @staticmethod
    def block_of(*vectors: Tensor) -> tuple[Tensor, ...]:
        """The block whose rows are ``vectors``."""
        return vectors

    @staticmethod
    def scale_shift(x: Tensor, affine, moments) -> Tensor:
        scale, shift = affine[0], affine[1]
        return _torch_scale_shift(x.to(scale.dtype), scale, shift, moments[0]).to(x.dtype)

    @staticmethod
    def centered_dot_and_sum(grad_y: Tensor, x: Tensor, moments) -> tuple[Tensor, Tensor]:
        center = moments[0]
        return _torch_centered_dot_and_sum(grad_y.to(center.dtype), x.to(center.dtype), center)

    @staticmethod
    def grad_input(grad_y: Tensor, x: Tensor, affine, pq, moments, residual: bool) -> Tensor:
        scale, p, q = affine[0], pq[0], pq[1]
        if residual:  # (x - center - residual) p + q, with the (N, C) part folded into q
            q = q - p * moments[2]
        # one full-size write, then an in-place update: no second full-size temporary
        grad_x = _torch_scale_shift(x.to(scale.dtype), p, q, moments[0])
        return grad_x.addcmul_(grad_y.to(scale.dtype), scale[:, :, None, None]).to(x.dtype)


# BatchNorm's evaluation kernels serve as fused passes with running_var 1 and no eps. torch 2.11 refuses
# eps <= 0 in F.batch_norm (later releases in training only); 1e-300 is positive and changes nothing:
# it rounds to 0 in float32 and vanishes against the variance 1 in float64.
_NO_EPS = 1e-300


def _torch_scale_shift(xs: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    n, c = scale.shape
    if torch.is_grad_enabled() or xs.numel() == 0 or not xs.is_contiguous():
        return plain_scale_shift(xs, scale, shift, center)
    ones = scale.new_ones(n * c)
    with torch.autocast(xs.device.type, enabled=False):
        y = F.batch_norm(
            xs.view(1, n * c, -1), center.reshape(-1), ones, scale.reshape(-1), shift.reshape(-1), False, 0.0, _NO_EPS
        )
    # detached: not a view in autograd's eyes, so that a custom Function returning it allows an in-place
    # op after the layer (detectron2's ReLU)
    return y.view_as(xs).detach()


def _torch_centered_dot_and_sum(gy: Tensor, xs: Tensor, center: Tensor) -> tuple[Tensor, Tensor]:
    n, c = xs.shape[:2]
    if torch.is_grad_enabled() or xs.numel() == 0:
        return (gy * (xs - center[:, :, None, None])).sum((2, 3)), gy.sum((2, 3))
    ones = xs.new_ones(n * c)
    _, dot, total = torch.ops.aten.native_batch_norm_backward(
        gy.reshape(1, n * c, -1),
        xs.reshape(1, n * c, -1),
        ones,
        center.reshape(-1),
        ones,
        center.reshape(-1),
        ones,
        False,
        _NO_EPS,
        [False, True, True],
    )
    return dot.view(n, c), total.view(n, c)
