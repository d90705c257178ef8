"""The four passes over full-size (N, C, H, W) tensors that the moment-based normalizers share, each with
its PyTorch implementation and, for CUDA tensors when Triton is importable, a Triton kernel
(``triton_kernels``):

- ``moments(x)``: the IN mean and biased variance of every (n, c) map;
- ``scale_shift(x, scale, shift, center)``: (x - center) * scale + shift per map;
- ``centered_dot_and_sum(grad_y, x, center)``: sum(grad_y * (x - center)) and sum(grad_y) per map;
- ``grad_input(grad_y, x, scale, p, q, center[, residual])``: grad_y * scale + (x - center - residual) * p + q.

``moments_and_residual(x)`` also returns each mean's residual: the part of the exact mean m that rounding
to the statistics dtype took off (m = mean + residual). A map whose mean is 1e4 times its spread loses
digits of its spread to that rounding; the backward's p term is the derivative of the variance, 2 (x - m)
/ HW, taken at the exact mean, and ``grad_input`` with the residual keeps it there (the autograd path gets
the same from differentiating through the rounded mean, whose deviations do not sum to 0).

Per-map vectors are in the statistics dtype (``stat_dtype``: float32, float64 for float64 inputs),
full-size outputs in x's dtype. Everything between these passes is small (N, C) tensor code.

The PyTorch path (every device, and the fallback): ``moments`` reads x once for sum(x) and once for
sum(x^2) in fp32, and computes the (rare) maps whose mean exceeds three times their spread, where
E[x^2] - E[x]^2 and a summed mean lose digits, again in float64 by the centred two-pass formula (a traced
model runs this branch always, since the tracer cannot record a data-dependent branch); the affine passes
and the backward's dot product go through BatchNorm's evaluation kernels on the (1, N*C, H*W) view, whose
forward is exactly (x - mean) * weight / sqrt(var + eps) + bias and whose backward computes exactly the two
sums (with mean = center, var = 1, eps = 0), in one fused pass each rather than several broadcasting ops
(full-size passes dominate the layer's cost).

The Triton path: one kernel each, reading fp16 / bf16 inputs directly (no fp32 copy), NCHW or
channels_last; ``moments`` in one read with shifted sums (exact whatever the ratio). It is taken for CUDA
tensors with Triton 3 or newer, and, for CPU tensors, when the tests run Triton's interpreter
(``TRITON_INTERPRET=1``); tensors it does not take (float64, other layouts) use the PyTorch path.
Under create_graph (a differentiable backward) every pass is plain autograd-tracked tensor code. Where
Triton is missing or older than 3, CUDA tensors take the PyTorch path too, and the first layer to plan a
call on one says so, once per process (``warn_if_kernels_off``).
"""

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import triton_kernels


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _triton_version_ok() -> bool:
    if not triton_kernels.available():
        return False
    major = int(triton_kernels.triton.__version__.split(".")[0])
    return major >= 3  # the kernels are written and tested for Triton 3


_TRITON = _triton_version_ok()
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_warned_kernels_off = False


# A warning rather than a log record, as Python's logging guide advises for a cause the user can remove (torch
# warns so of its environment too): it reaches stderr in any script, whatever loggers it set up, pytest lists
# it, and a user who means to run without the kernels silences exactly it by its category.
class KernelsOffWarning(UserWarning):
    """CUDA tensors run the layers' PyTorch path: this process has no Triton 3 or newer."""


def _kernels_off_message() -> str:
    """What ``KernelsOffWarning`` says: the cause (Triton missing, or its version) and the fix."""
    found = f"{triton_kernels.triton.__version__} is installed" if triton_kernels.available() else "is not installed"
    return (
        f"sn_detection: Triton {found}, and the layers' Triton kernels need Triton 3 or newer, so on CUDA the "
        "layers run their plain PyTorch path meanwhile (correct, but many more kernel launches per layer). To run "
        "the kernels, install a torch that ships Triton 3 (torch >= 2.4 on Linux) or `pip install 'triton>=3'`."
    )


def warn_if_kernels_off(x: Tensor) -> None:
    """Warn (``KernelsOffWarning``), once per process, when ``x`` is a CUDA tensor and Triton is missing or
    older than 3. Called when a layer makes a call plan (``base.NormBase.call_plan``), never per call: the
    warning costs nothing on the calls that follow."""
    global _warned_kernels_off
    if _TRITON or _warned_kernels_off or not x.is_cuda:
        return
    _warned_kernels_off = True
    warnings.warn(_kernels_off_message(), KernelsOffWarning, stacklevel=1)


def kernel_path(x: Tensor) -> bool:
    """Whether ``x`` is a tensor the Triton kernels take: on CUDA (or on the CPU under Triton's interpreter),
    float32, float16 or bfloat16, NCHW-contiguous or channels_last (module docstring)."""
    if not _TRITON or x.dtype not in _KERNEL_DTYPES:
        return False
    on_device = x.is_cuda or (triton_kernels.interpreting() and x.device.type == "cpu")
    return on_device and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))


def uses_triton(x: Tensor) -> bool:
    """Whether the passes over ``x`` run as Triton kernels: on the kernel path, and not tracked by autograd
    (under create_graph every pass is plain tensor code)."""
    return not torch.is_grad_enabled() and kernel_path(x)


def torch_scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """``scale_shift`` in PyTorch operations: computed in scale's dtype, returned in x's."""
    return _torch_scale_shift(x.to(scale.dtype), scale, shift, center).to(x.dtype)


def torch_grad_input(
    grad_y: Tensor, x: Tensor, scale: Tensor, p: Tensor, q: Tensor, center: Tensor, residual: Optional[Tensor] = None
) -> Tensor:
    """``grad_input`` in PyTorch operations: computed in scale's dtype, returned in x's."""
    xs = x.to(scale.dtype)
    if residual is not None:  # (x - center - residual) p + q, with the (N, C) part folded into q
        q = q - p * residual
    # one full-size write, then an in-place update: no second full-size temporary
    grad_x = _torch_scale_shift(xs, p, q, center)
    return grad_x.addcmul_(grad_y.to(scale.dtype), scale[:, :, None, None]).to(x.dtype)


class TorchPasses:
    """The four passes of a layer's fused path in PyTorch operations, for any x, with blocks that are tuples
    of (N, C) tensors in the statistics dtype, their rows as ``triton_kernels.MapPasses`` has them: static
    methods, used as the class itself."""

    @staticmethod
    def moments(x: Tensor) -> tuple[Tensor, Tensor]:
        return torch_moments(x.to(stat_dtype(x)))

    @staticmethod
    def moments_and_residual(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return torch_moments_and_residual(x.to(stat_dtype(x)))

    @staticmethod
    def scale_shift(x: Tensor, affine, moments) -> Tensor:
        return torch_scale_shift(x, affine[0], affine[1], moments[0])

    @staticmethod
    def centered_dot_and_sum(grad_y: Tensor, x: Tensor, moments) -> tuple[Tensor, Tensor]:
        center = moments[0]
        return _torch_centered_dot_and_sum(grad_y.to(center.dtype), x.to(center.dtype), center)

    @staticmethod
    def grad_input(grad_y: Tensor, x: Tensor, affine, pq, moments, residual: bool) -> Tensor:
        return torch_grad_input(grad_y, x, affine[0], pq[0], pq[1], moments[0], moments[2] if residual else None)


# The passes for separate (N, C) tensors from outside a layer's plan (the autograd path): the Triton kernels'
# (``triton_kernels.MapPasses``) where ``uses_triton(x)``, the vectors checked and put in blocks; else
# PyTorch's. (A layer's fused path runs the passes its plan chose on its own blocks: ``fused.FusedPlan``.)


def moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """The IN mean and biased variance (N, C) of x, in the statistics dtype, without autograd."""
    if uses_triton(x):
        mean, var = triton_kernels.MapPasses(x).moments(x).unbind(0)
        return mean, var
    return TorchPasses.moments(x)


def moments_and_residual(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``moments`` and each mean's residual (module docstring), without autograd."""
    if uses_triton(x):
        mean, var, residual = triton_kernels.MapPasses(x).moments_and_residual(x).unbind(0)
        return mean, var, residual
    return TorchPasses.moments_and_residual(x)


def scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """(x - center) * scale + shift with (N, C) scale, shift and center, computed in their dtype, returned
    in x's dtype as a new tensor that is no view."""
    if uses_triton(x):
        scale, shift, center = triton_kernels.checked_vectors(scale, shift, center)
        return triton_kernels.MapPasses(x).scale_shift(x, torch.stack([scale, shift]), center)
    return torch_scale_shift(x, scale, shift, center)


def centered_dot_and_sum(grad_y: Tensor, x: Tensor, center: Tensor) -> tuple[Tensor, Tensor]:
    """sum(grad_y * (x - center)) and sum(grad_y) over H*W per (n, c), in center's dtype, in one read."""
    if uses_triton(x):
        (center,) = triton_kernels.checked_vectors(center)
        dot, total = triton_kernels.MapPasses(x).centered_dot_and_sum(grad_y, x, center).unbind(0)
        return dot, total
    return TorchPasses.centered_dot_and_sum(grad_y, x, (center,))


def grad_input(
    grad_y: Tensor, x: Tensor, scale: Tensor, p: Tensor, q: Tensor, center: Tensor, residual: Optional[Tensor] = None
) -> Tensor:
    """grad_y * scale + (x - center - residual) * p + q with (N, C) vectors (no residual: 0), returned in x's
    dtype; one write."""
    if uses_triton(x):
        scale, p, q, center = triton_kernels.checked_vectors(scale, p, q, center)
        # the kernel reads the center from a moments block's row 0 and the residual from its row 2 (row 1, the
        # variance, is not read)
        moments = center if residual is None else torch.stack([center, center, *triton_kernels.checked_vectors(residual)])
        pq = torch.stack([p, q])
        return triton_kernels.MapPasses(x).grad_input(grad_y, x, scale, pq, moments, residual is not None)
    return torch_grad_input(grad_y, x, scale, p, q, center, residual)


def like(grad_y: Tensor, x: Tensor) -> Tensor:
    """grad_y in x's memory layout (autograd may hand over an expanded or differently strided one)."""
    layout = torch.channels_last if not x.is_contiguous() else torch.contiguous_format
    return grad_y.contiguous(memory_format=layout)


# Above this ratio mean^2 / var, a map's moments are recomputed in float64: a summed fp32 mean is a few
# units of its last place off, and E[x^2] - E[x]^2 loses log10(ratio) digits.
_ILL_CONDITIONED = 10.0


def torch_moments(xs: Tensor, ill_conditioned: float = _ILL_CONDITIONED) -> tuple[Tensor, Tensor]:
    """``moments`` in PyTorch operations, of xs already in the statistics dtype (TorchScript compiles it:
    the threshold is an argument because it reads no global float)."""
    mean, var, _ = torch_moments_and_residual(xs, ill_conditioned)
    return mean, var


def torch_moments_and_residual(
    xs: Tensor, ill_conditioned: float = _ILL_CONDITIONED
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch_moments`` and the residual of each mean (module docstring): the float64 mean's part that
    rounding to the statistics dtype took off, for the maps recomputed in float64; 0 for the others, whose
    mean is within a few units of its last place of a spread at least a third of it."""
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


def plain_scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """(x - center) * scale + shift with scale, shift and center broadcastable to (N, C), computed in their
    dtype and returned in x's, in plain differentiable operations (TorchScript, create_graph)."""
    size = [x.shape[0], x.shape[1]]
    scale, shift, center = scale.expand(size), shift.expand(size), center.expand(size)
    centered = x.to(scale.dtype) - center[:, :, None, None]
    return torch.addcmul(shift[:, :, None, None], centered, scale[:, :, None, None]).to(x.dtype)


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
        y = F.batch_norm(xs.view(1, n * c, -1), center.reshape(-1), ones, scale.reshape(-1), shift.reshape(-1), False, 0.0, _NO_EPS)
    # detached: not a view in autograd's eyes, so that a custom Function returning it allows an in-place
    # op after the layer (detectron2's ReLU)
    return y.view_as(xs).detach()


def _torch_centered_dot_and_sum(gy: Tensor, xs: Tensor, center: Tensor) -> tuple[Tensor, Tensor]:
    n, c = xs.shape[:2]
    if torch.is_grad_enabled() or xs.numel() == 0:
        return (gy * (xs - center[:, :, None, None])).sum((2, 3)), gy.sum((2, 3))
    ones = xs.new_ones(n * c)
    _, dot, total = torch.ops.aten.native_batch_norm_backward(
        gy.reshape(1, n * c, -1), xs.reshape(1, n * c, -1), ones, center.reshape(-1), ones, center.reshape(-1), ones,
        False, _NO_EPS, [False, True, True],
    )
    return dot.view(n, c), total.view(n, c)
