"""The four passes over full-size (N, C, H, W) tensors that the moment-based normalizers share, behind one
API with two implementations: ``TritonPasses`` (a Triton kernel each) and ``TorchPasses`` (PyTorch
operations). Everything between the passes is small (N, C) code (``moment_normalizer`` and the layers'
``*_kernels``):

- ``moments(x)``: the IN mean and biased variance of every (n, c) map; ``moments_and_residual(x)`` also
  each mean's residual (below);
- ``scale_shift(x, affine, moments)``: (x - mean) * scale + shift per map;
- ``centered_dot_and_sum(grad_y, x, moments)``: sum(grad_y * (x - mean)) and sum(grad_y) per map;
- ``grad_input(grad_y, x, affine, pq, moments, residual)``: grad_y * scale + (x - mean - residual) * p + q
  (without ``residual``: x - mean).

A layer's plan picks the implementation once for inputs of one signature (its ``*_kernels``); the autograd
path of ``moment_normalizer`` takes ``passes_for(x)`` on each call: ``TritonPasses`` where x is on the
kernel path (``kernel_path``) and no autograd records the passes, ``TorchPasses`` elsewhere.

Blocks. Per-map statistics travel between the passes in blocks whose rows are (N, C) vectors in the
statistics dtype (``stat_dtype``: float32, float64 for float64 inputs), row 0 first: a moments block
(mean, variance, residual), an affine block (scale, shift), a sums block (dot, total), a pq block (p, q).
``TritonPasses`` makes each block one contiguous float32 tensor whose rows of N * C values (n-major) the
kernels address at row * N * C: one allocation and one kernel argument where separate tensors would cost
one of each per vector, which is host time on a GPU (a layer's kernels may append statistics of their own
after the rows: ``TritonPasses.block``). ``TorchPasses`` makes tuples of (N, C) tensors. Blocks of vectors
from outside a plan are made by ``block_of``; each implementation reads only its own. Full-size outputs
have x's dtype and memory layout.

The residual. A map whose mean is 1e4 times its spread loses digits of its spread to rounding its mean m
to the statistics dtype (m = mean + residual). The backward's p term is the derivative of the variance,
2 (x - m) / HW, taken at the exact mean, and ``grad_input`` with the residual keeps it there (the
autograd path gets the same from differentiating through the rounded mean, whose deviations do not sum
to 0).

The PyTorch implementation (every device, and the fallback): ``moments`` reads x once for sum(x) and once
for sum(x^2) in fp32, and computes the (rare) maps whose mean exceeds three times their spread, where
E[x^2] - E[x]^2 and a summed mean lose digits, again in float64 by the centred two-pass formula (a traced
model runs this branch always, since the tracer cannot record a data-dependent branch); the affine passes
and the backward's dot product go through BatchNorm's evaluation kernels on the (1, N*C, H*W) view, whose
forward is exactly (x - mean) * weight / sqrt(var + eps) + bias and whose backward computes exactly the two
sums (with mean = center, var = 1, eps = 0), in one fused pass each rather than several broadcasting ops
(full-size passes dominate the layer's cost). Under autograd (a differentiable backward: create_graph) its
passes are plain differentiable operations, and so are ``plain_moments`` and ``plain_scale_shift``, which
TorchScript compiles.

The kernel path: CUDA tensors with Triton 3 or newer, and, for CPU tensors, Triton's interpreter
(``TRITON_INTERPRET=1``, tests only); float32, float16 or bfloat16, NCHW-contiguous or channels_last.
Elsewhere (float64, other layouts) the PyTorch implementation runs. Where Triton is missing or older than 3,
CUDA tensors take the PyTorch path too, and the first layer to plan a call on one says so, once per process
(``warn_if_kernels_off``). A process started with ``SN_DETECTION_KERNELS=0`` takes the PyTorch path on every
tensor, without the warning (read once, at import: ``kernel_launch``'s switches).

The Triton implementation. One kernel each, reading fp16 / bf16 inputs directly (no fp32 copy); loads are
widened to float32 and all arithmetic and accumulation is float32; full-size outputs are rounded once to
x's dtype. ``TritonPasses(x)`` refuses (ValueError) any x off the kernel path, and ``block_of`` any vector
that is not a float32 (N, C) tensor on x's device. grad_y is taken in x's layout (made so if needed:
autograd may hand over another). A tensor that is both NCHW-contiguous and channels_last (C == 1 or
H*W == 1) is treated as NCHW.

Tiling. Every kernel works on tiles [BLOCK_C, BLOCK_HW] of one sample whose long axis is memory's
contiguous one, so that a warp's loads are coalesced:

- NCHW: BLOCK_HW = min(next_pow2(H*W), 2048) pixels, and as many channels as fill a tile of 2048
  elements (small maps are packed several to a tile);
- channels_last: BLOCK_C = min(next_pow2(C), 32) channels by BLOCK_HW = 2048 / BLOCK_C pixels.

The two reductions (``moments``, ``centered_dot_and_sum``) run one program per (sample, channel block),
which loops over H*W tile by tile into a [BLOCK_C, BLOCK_HW] float32 tile of partial sums, reduced across
the tile once at the end (a tree of log2(BLOCK_HW) additions after H*W / BLOCK_HW terms each, rather than
one running sum). No atomics: one program owns each map, so the reductions are deterministic. The
elementwise kernels run one program per tile. All kernels use 4 warps.

Indexing. Offsets inside a sample are int32 (``TritonPasses`` requires C*H*W < 2**31); the sample's base
offset is int64, so a batch may exceed 2**31 elements.

Numerics of the Triton ``moments`` (shifted sums). E[x^2] - E[x]^2 in float32 loses log10(m^2 / s^2) digits
for a map of mean m and spread s. The kernel instead sums d = x - k for a per-map shift k and returns
mean = k + E[d], var = E[d^2] - E[d]^2 (at least 0), with k the float32 mean of the map's first tile
(reduced from the same registers that then enter the sums, so x is still read once):

1. d is exact: when |m| >> s the elements and k lie within a factor 2 of each other, and the float32
   difference of two such numbers is exact (Sterbenz's lemma).
2. d is of the size of the spread, and the final subtraction cancels only E[d]^2 = (m - k)^2, not m^2:
   nothing for a map within one tile (k is its own mean), next to nothing when the first tile is
   representative (m - k ~ s / sqrt(BLOCK_HW)); a single element as k would be off by a few spreads.
3. The mean is k plus a small correction E[d], whose rounding is relative to s, not m. Rounding k + E[d]
   to one float32 still moves it by up to half a unit of m's last place; the residual
   (k - mean) + E[d] is what it moved, exact to float32 relative to s.

So the variance keeps about as many digits as a two-pass (or Welford) float32 computation, whatever
m / s, in one read of x. ``centered_dot_and_sum``'s x - center is exact for the same reason when center is
the map's mean, and so are ``scale_shift`` and ``grad_input``: x * scale alone would round to the size of
m / s (``moment_normalizer`` centres its output at the IN mean for this reason).
"""

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernel_launch
from .kernel_launch import cdiv, interpreting, launch, next_pow2, tl, triton

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 2048  # elements per [BLOCK_C, BLOCK_HW] tile: 16 per thread and accumulator at 4 warps
_CHANNELS_LAST_BLOCK_C = 32
_NUM_WARPS = 4


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


# --------------------------------------------------------------------------------------------------
# The path: which inputs the kernels take
# --------------------------------------------------------------------------------------------------


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in ``dtype``: x itself when it has it already, where ``x.to(dtype)`` would still be recorded by a tracer
    (an exported graph's Cast that does nothing)."""
    return x if x.dtype == dtype else x.to(dtype)


def _triton_version_ok() -> bool:
    if not kernel_launch.available():
        return False
    major = int(kernel_launch.triton.__version__.split(".")[0])
    return major >= 3  # the kernels are written and tested for Triton 3


_TRITON = _triton_version_ok()
KERNELS_VARIABLE = "SN_DETECTION_KERNELS"
# whether the kernels are wanted at all (read once: kernel_launch's switches)
_KERNELS_WANTED = kernel_launch.environment_switch(
    KERNELS_VARIABLE, off="the layers' PyTorch path on CUDA, no Triton kernel", on="the Triton kernels on CUDA"
)
_warned_kernels_off = False


# A warning rather than a log record, as Python's logging guide advises for a cause the user can remove (torch
# warns so of its environment too): it reaches stderr in any script, whatever loggers it set up, pytest lists
# it, and a user who means to run without the kernels silences exactly it by its category.
class KernelsOffWarning(UserWarning):
    """CUDA tensors run the layers' PyTorch path: this process has no Triton 3 or newer."""


def _kernels_off_message() -> str:
    """What ``KernelsOffWarning`` says: the cause (Triton missing, or its version) and the fix."""
    found = f"{kernel_launch.triton.__version__} is installed" if kernel_launch.available() else "is not installed"
    return (
        f"sn_detection: Triton {found}, and the layers' Triton kernels need Triton 3 or newer, so on CUDA the "
        "layers run their plain PyTorch path meanwhile (correct, but many more kernel launches per layer). To run "
        "the kernels, install a torch that ships Triton 3 (torch >= 2.4 on Linux) or `pip install 'triton>=3'`; "
        f"to run without them and without this warning, set {KERNELS_VARIABLE}=0."
    )


def warn_if_kernels_off(x: Tensor) -> None:
    """Warn (``KernelsOffWarning``), once per process, when ``x`` is a CUDA tensor and Triton is missing or
    older than 3, unless ``SN_DETECTION_KERNELS=0`` asked for the PyTorch path. Called when a layer makes a
    call plan (``base.NormBase.call_plan``), never per call: the warning costs nothing on the calls that
    follow."""
    global _warned_kernels_off
    if _TRITON or not _KERNELS_WANTED or _warned_kernels_off or not x.is_cuda:
        return
    _warned_kernels_off = True
    warnings.warn(_kernels_off_message(), KernelsOffWarning, stacklevel=1)


def kernel_path(x: Tensor) -> bool:
    """Whether ``x`` is a tensor the Triton kernels take: on CUDA (or on the CPU under Triton's interpreter),
    float32, float16 or bfloat16, NCHW-contiguous or channels_last, in a process with Triton 3 that did not
    turn the kernels off (``SN_DETECTION_KERNELS=0``; module docstring)."""
    if not (_TRITON and _KERNELS_WANTED) or x.dtype not in _KERNEL_DTYPES:
        return False
    on_device = x.is_cuda or (interpreting() and x.device.type == "cpu")
    return on_device and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))


def passes_for(x: Tensor):
    """The passes over ``x`` outside a layer's plan (the autograd path): ``TritonPasses(x)`` on the kernel
    path where autograd does not record them, else ``TorchPasses`` (under create_graph every pass is plain
    differentiable tensor code)."""
    if not torch.is_grad_enabled() and kernel_path(x):
        return TritonPasses(x)
    return TorchPasses


@torch.jit.unused  # never reached under TorchScript: callers test torch.jit.is_scripting() first
def exporting() -> bool:
    """Whether an exporter is recording the call: ``torch.jit.trace`` (and so the TorchScript-based
    ``torch.onnx.export``), the ONNX exporter, or torch.compile / ``torch.export`` (dynamo or the non-strict
    tracer). The layers then take their plain path (``centred_moments``): tensor operations only, no
    autograd Function, no call plan, no branch on a tensor's values, so that what is recorded is what runs."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


# --------------------------------------------------------------------------------------------------
# The PyTorch implementation
# --------------------------------------------------------------------------------------------------

# Above this ratio mean^2 / var, a map's moments are recomputed in float64: a summed fp32 mean is a few
# units of its last place off, and E[x^2] - E[x]^2 loses log10(ratio) digits.
_ILL_CONDITIONED = 10.0


def plain_mean(x: Tensor) -> Tensor:
    """The IN mean (N, C) of x in the statistics dtype, from one read of x (the float32 sum, a few units of its
    last place from the exact mean)."""
    return as_dtype(x, stat_dtype(x)).sum((2, 3)) / max(x.shape[2] * x.shape[3], 1)


def plain_moments(x: Tensor, ill_conditioned: float = _ILL_CONDITIONED) -> tuple[Tensor, Tensor]:
    """The IN mean and biased variance (N, C) of x, in the statistics dtype, in plain tensor operations
    (TorchScript compiles it: the threshold is an argument because it reads no global float)."""
    mean, var, _ = plain_moments_and_residual(x, ill_conditioned)
    return mean, var


def plain_moments_and_residual(x: Tensor, ill_conditioned: float = _ILL_CONDITIONED) -> tuple[Tensor, Tensor, Tensor]:
    """``plain_moments`` and the residual of each mean (module docstring): the float64 mean's part that
    rounding to the statistics dtype took off, for the maps recomputed in float64; 0 for the others, whose
    mean is within a few units of its last place of a spread at least a third of it."""
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

    moments = staticmethod(plain_moments)
    moments_and_residual = staticmethod(plain_moments_and_residual)

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


# --------------------------------------------------------------------------------------------------
# The Triton kernels
# --------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _tile_offsets(c, hw, C, HW, CHANNELS_LAST: tl.constexpr):
        # Offsets, within one sample, of the [BLOCK_C, BLOCK_HW] tile of channels c and pixels hw. The
        # layout is a compile-time constant, so the compiler sees the unit stride (pixels in NCHW,
        # channels in channels_last) and vectorizes the loads along it.
        if CHANNELS_LAST:
            return hw[None, :] * C + c[:, None]
        else:
            return c[:, None] * HW + hw[None, :]

    @triton.jit
    def _moments_kernel(
        x_ptr,
        moments_ptr,
        N,
        C,
        HW,
        c_blocks,
        HAS_RESIDUAL: tl.constexpr,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        # One program: the maps of one sample n and BLOCK_C channels, looping over H*W. The moments block's
        # rows: mean, variance, residual (module docstring, "Blocks").
        pid = tl.program_id(0)
        n = pid // c_blocks
        c = (pid % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < C
        x_ptr += n.to(tl.int64) * C * HW  # the sample's base, in int64: the batch may pass 2**31 elements

        # The shift: the mean of each map's first tile, which is then accumulated from registers, so x is
        # still read once (module docstring, "shifted sums"). A map that fits in one tile is thus centred
        # at its own (float32-rounded) mean: the two-pass formula, in one read.
        hw = tl.arange(0, BLOCK_HW)
        mask = c_mask[:, None] & (hw < HW)[None, :]
        x = tl.load(x_ptr + _tile_offsets(c, hw, C, HW, CHANNELS_LAST), mask=mask, other=0.0).to(tl.float32)
        shift = tl.sum(x, axis=1) / tl.minimum(HW, BLOCK_HW)
        # masked lanes must add 0, not 0 - shift
        d = tl.where(mask, x - shift[:, None], 0.0)
        sum_d = d
        sum_d2 = d * d
        for start in range(BLOCK_HW, HW, BLOCK_HW):
            hw = start + tl.arange(0, BLOCK_HW)
            mask = c_mask[:, None] & (hw < HW)[None, :]
            # (widened as it is loaded: a loop-carried variable must keep its type, here float32)
            x = tl.load(x_ptr + _tile_offsets(c, hw, C, HW, CHANNELS_LAST), mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - shift[:, None], 0.0)
            sum_d += d
            sum_d2 += d * d

        mean_d = tl.sum(sum_d, axis=1) / HW
        var = tl.maximum(tl.sum(sum_d2, axis=1) / HW - mean_d * mean_d, 0.0)
        out = n * C + c  # (N, C) blocks are contiguous and small: int32 suffices (module docstring)
        mean = shift + mean_d
        tl.store(moments_ptr + out, mean, mask=c_mask)
        tl.store(moments_ptr + N * C + out, var, mask=c_mask)
        if HAS_RESIDUAL:  # what rounding took off the mean: shift - mean is exact (Sterbenz)
            tl.store(moments_ptr + 2 * N * C + out, (shift - mean) + mean_d, mask=c_mask)

    @triton.jit
    def _centered_dot_and_sum_kernel(
        gy_ptr,
        x_ptr,
        center_ptr,
        sums_ptr,
        N,
        C,
        HW,
        c_blocks,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        # Same program layout as _moments_kernel; grad_y and x share their layout, hence their offsets. The
        # sums block's rows: dot, total.
        pid = tl.program_id(0)
        n = pid // c_blocks
        c = (pid % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < C
        base = n.to(tl.int64) * C * HW
        gy_ptr += base
        x_ptr += base
        center = tl.load(center_ptr + n * C + c, mask=c_mask, other=0.0)

        dot = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        total = tl.zeros([BLOCK_C, BLOCK_HW], dtype=tl.float32)
        for start in range(0, HW, BLOCK_HW):
            hw = start + tl.arange(0, BLOCK_HW)
            mask = c_mask[:, None] & (hw < HW)[None, :]
            offsets = _tile_offsets(c, hw, C, HW, CHANNELS_LAST)
            gy = tl.load(gy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            # masked lanes have gy = 0, so they add nothing to either sum
            dot += gy * (x - center[:, None])
            total += gy

        out = n * C + c
        tl.store(sums_ptr + out, tl.sum(dot, axis=1), mask=c_mask)
        tl.store(sums_ptr + N * C + out, tl.sum(total, axis=1), mask=c_mask)

    @triton.jit
    def _tile_of_program(c_blocks, hw_blocks, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr):
        # The (sample, channels, pixels) of this program's tile, for the elementwise kernels: a 1-D grid
        # (no 65535 limit of grid axes 1 and 2) with the pixel blocks fastest.
        pid = tl.program_id(0)
        hw_block = pid % hw_blocks
        rest = pid // hw_blocks
        n = rest // c_blocks
        c = (rest % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        hw = hw_block * BLOCK_HW + tl.arange(0, BLOCK_HW)
        return n, c, hw

    @triton.jit
    def _scale_shift_kernel(
        x_ptr,
        y_ptr,
        affine_ptr,
        center_ptr,
        N,
        C,
        HW,
        c_blocks,
        hw_blocks,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        # the affine block's rows: scale, shift; the center: row 0 of center_ptr (a moments block's mean)
        n, c, hw = _tile_of_program(c_blocks, hw_blocks, BLOCK_C, BLOCK_HW)
        c_mask = c < C
        mask = c_mask[:, None] & (hw < HW)[None, :]
        base = n.to(tl.int64) * C * HW
        offsets = _tile_offsets(c, hw, C, HW, CHANNELS_LAST)  # y has x's layout: the same offsets

        scale = tl.load(affine_ptr + n * C + c, mask=c_mask, other=0.0)
        shift = tl.load(affine_ptr + N * C + n * C + c, mask=c_mask, other=0.0)
        x = tl.load(x_ptr + base + offsets, mask=mask, other=0.0).to(tl.float32)
        # centring first keeps the digits x * scale would round away when |mean| >> spread
        x -= tl.load(center_ptr + n * C + c, mask=c_mask, other=0.0)[:, None]
        y = x * scale[:, None] + shift[:, None]
        tl.store(y_ptr + base + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _grad_input_kernel(
        gy_ptr,
        x_ptr,
        gx_ptr,
        scale_ptr,
        pq_ptr,
        moments_ptr,
        N,
        C,
        HW,
        c_blocks,
        hw_blocks,
        HAS_RESIDUAL: tl.constexpr,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        # the pq block's rows: p, q; the moments block's: the center (the mean), _, its residual
        n, c, hw = _tile_of_program(c_blocks, hw_blocks, BLOCK_C, BLOCK_HW)
        c_mask = c < C
        mask = c_mask[:, None] & (hw < HW)[None, :]
        base = n.to(tl.int64) * C * HW
        offsets = base + _tile_offsets(c, hw, C, HW, CHANNELS_LAST)  # grad_y, x and grad_x share them

        scale = tl.load(scale_ptr + n * C + c, mask=c_mask, other=0.0)[:, None]
        p = tl.load(pq_ptr + n * C + c, mask=c_mask, other=0.0)[:, None]
        q = tl.load(pq_ptr + N * C + n * C + c, mask=c_mask, other=0.0)[:, None]
        center = tl.load(moments_ptr + n * C + c, mask=c_mask, other=0.0)[:, None]
        gy = tl.load(gy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        centered = x - center
        if HAS_RESIDUAL:
            centered -= tl.load(moments_ptr + 2 * N * C + n * C + c, mask=c_mask, other=0.0)[:, None]
        gx = gy * scale + centered * p + q
        tl.store(gx_ptr + offsets, gx.to(gx_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# The Triton implementation: checks, tile shapes, one launch each
# --------------------------------------------------------------------------------------------------


def _layout(x: Tensor, name: str) -> bool:
    """Checks a full-size input; returns whether it is channels_last (False: NCHW-contiguous)."""
    if x.dim() != 4:
        raise ValueError(f"{name}: expected an (N, C, H, W) tensor, got shape {list(x.shape)}")
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported (float32, float16 or bfloat16)")
    if not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        raise ValueError(
            f"{name}: tensors on {x.device} cannot be run (CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
            "set before importing sn_detection.layers)"
        )
    n, c, h, w = x.shape
    if c * h * w >= 2**31:
        raise ValueError(f"{name}: one sample has {c * h * w} elements; the kernels index a sample in int32")
    if x.is_contiguous():
        return False
    if x.is_contiguous(memory_format=torch.channels_last):
        return True
    raise ValueError(
        f"{name}: strides {x.stride()} are neither NCHW-contiguous nor channels_last; "
        "call .contiguous() (or .contiguous(memory_format=torch.channels_last)) first"
    )


def _tile_shape(c: int, hw: int, channels_last: bool) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_HW): the long side of the tile along memory's contiguous axis (module docstring)."""
    if channels_last:
        block_c = min(next_pow2(c), _CHANNELS_LAST_BLOCK_C)
        return block_c, min(next_pow2(hw), _TILE // block_c)
    block_hw = min(next_pow2(hw), _TILE)
    return min(next_pow2(c), _TILE // block_hw), block_hw


def _output_like(x: Tensor) -> Tensor:
    # x's very strides: x is dense (in one of the two layouts), and empty_like keeps a dense tensor's strides;
    # the kernels address output and input alike
    return torch.empty_like(x)


class TritonPasses:
    """The four passes as Triton kernels over inputs of x's shape and layout, x checked once (``_layout``)
    and the tiles, grids and constants worked out once: a layer's plan keeps one for all its calls with such
    inputs. It holds no tensor. Blocks are float32 tensors of (N, C) rows (module docstring); a mean or a
    scale is read from row 0 of the block given."""

    def __init__(self, x: Tensor):
        if triton is None:
            raise RuntimeError("Triton is not installed: the layers' Triton kernels cannot run")
        self.channels_last = _layout(x, "x")
        n, c, h, w = x.shape
        self.n, self.c, self.hw = n, c, h * w
        self.device = x.device
        self.block_c, self.block_hw = _tile_shape(c, h * w, self.channels_last)
        self.c_blocks, self.hw_blocks = cdiv(c, self.block_c), cdiv(h * w, self.block_hw)
        self.memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        self.empty = n * c == 0 or h * w == 0
        self.vector_shape = (n, c)
        self.reduce_grid = (n * self.c_blocks,)  # the reductions: one program per (sample, channel block)
        self.map_grid = (n * self.c_blocks * self.hw_blocks,)  # the elementwise passes: one per tile
        meta = dict(
            CHANNELS_LAST=self.channels_last, BLOCK_C=self.block_c, BLOCK_HW=self.block_hw, num_warps=_NUM_WARPS
        )
        self.meta = meta
        # each launch's constants by its flag, made once (``launch`` takes them as they are)
        self.residual_meta = {flag: dict(meta, HAS_RESIDUAL=flag) for flag in (False, True)}

    def block(self, x: Tensor, rows: int, extra: int = 0) -> Tensor:
        """A float32 block of ``rows`` (N, C) rows on x's device, plus ``extra`` values after them, to be
        written in full."""
        if not extra:
            return x.new_empty((rows, *self.vector_shape), dtype=torch.float32)
        return x.new_empty(rows * self.n * self.c + extra, dtype=torch.float32)

    def block_of(self, *vectors: Tensor) -> Tensor:
        """The block whose rows are ``vectors``, each checked to be a float32 (N, C) tensor on x's device
        (autograd may hand over an expanded one: made contiguous); one vector is its own block."""
        for v in vectors:
            if not isinstance(v, Tensor) or v.dtype != torch.float32 or v.shape != self.vector_shape:
                got = f"{v.dtype} {list(v.shape)}" if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(f"expected float32 (N, C) = {list(self.vector_shape)} vectors, got {got}")
            if v.device != self.device:
                raise ValueError(f"a vector is on {v.device}, x on {self.device}")
        vectors = [v.contiguous() for v in vectors]
        return vectors[0] if len(vectors) == 1 else torch.stack(vectors)

    def _reduced(self, x: Tensor, rows: int) -> Tensor:
        """A reduction's block: to be written in full, or zeros where the maps are empty (their sums, and so
        their mean and variance, are 0, like plain_moments')."""
        block = self.block(x, rows)
        return block.zero_() if self.empty else block

    def moments(self, x: Tensor) -> Tensor:
        """The moments block (2, N, C): mean, variance."""
        moments = self._reduced(x, 2)
        if not self.empty:
            launch(
                _moments_kernel,
                self.reduce_grid,
                (x, moments, self.n, self.c, self.hw, self.c_blocks),
                self.residual_meta[False],
            )
        return moments

    def moments_and_residual(self, x: Tensor) -> Tensor:
        """The moments block (3, N, C): mean, variance, residual."""
        moments = self._reduced(x, 3)
        if not self.empty:
            launch(
                _moments_kernel,
                self.reduce_grid,
                (x, moments, self.n, self.c, self.hw, self.c_blocks),
                self.residual_meta[True],
            )
        return moments

    def scale_shift(self, x: Tensor, affine: Tensor, moments: Tensor) -> Tensor:
        """(x - mean) * scale + shift, in x's dtype and layout."""
        y = _output_like(x)
        if self.empty:
            return y
        launch(
            _scale_shift_kernel,
            self.map_grid,
            (x, y, affine, moments, self.n, self.c, self.hw, self.c_blocks, self.hw_blocks),
            self.meta,
        )
        return y

    def centered_dot_and_sum(self, grad_y: Tensor, x: Tensor, moments: Tensor) -> Tensor:
        """The sums block (2, N, C): dot, total."""
        sums = self._reduced(x, 2)
        if self.empty:
            return sums
        grad_y = grad_y.contiguous(memory_format=self.memory_format)
        launch(
            _centered_dot_and_sum_kernel,
            self.reduce_grid,
            (grad_y, x, moments, sums, self.n, self.c, self.hw, self.c_blocks),
            self.meta,
        )
        return sums

    def grad_input(
        self, grad_y: Tensor, x: Tensor, affine: Tensor, pq: Tensor, moments: Tensor, residual: bool
    ) -> Tensor:
        """grad_y * scale + (x - mean - residual) * p + q, with the mean (and with ``residual``, its residual)
        from the moments block, in x's dtype and layout."""
        grad_x = _output_like(x)
        if self.empty:
            return grad_x
        grad_y = grad_y.contiguous(memory_format=self.memory_format)
        launch(
            _grad_input_kernel,
            self.map_grid,
            (grad_y, x, grad_x, affine, pq, moments, self.n, self.c, self.hw, self.c_blocks, self.hw_blocks),
            self.residual_meta[residual],
        )
        return grad_x
