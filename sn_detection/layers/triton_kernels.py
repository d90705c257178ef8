"""Triton kernels for the per-(n, c) passes of the moment-based normalizers (``statistics``).

SN, SyncSN, DN, MN and MGN touch the full-size (N, C, H, W) tensors only in four places; everything in
between is small (N, C) tensor code. Each of the four is one kernel launch here:

- ``moments(x)``: the IN mean and biased variance of every (n, c) map, in one read of x
  (``MapPasses.moments_and_residual`` also gives each mean's residual: ``passes``).
- ``scale_shift(x, scale, shift[, center])``: y = (x - center) * scale + shift with per-map vectors.
- ``centered_dot_and_sum(grad_y, x, center)``: sum(grad_y * (x - center)) and sum(grad_y) per map, in one
  read of (grad_y, x).
- ``grad_input(grad_y, x, scale, p, q, center)``: grad_x = grad_y * scale + (x - center) * p + q, one read
  of (grad_y, x) and one write (``MapPasses.grad_input`` takes center's residual too).

Types. x and grad_y may be float32, float16 or bfloat16; every per-map vector is a float32 (N, C) tensor.
Loads are widened to float32 and all arithmetic and accumulation is float32; full-size outputs are
rounded once to x's dtype. Anything else (float64, other vector dtypes or shapes) raises ValueError, the
caller's cue to fall back to its PyTorch path.

Layouts. NCHW-contiguous (the H*W elements of a map contiguous) and channels_last (the C channels of one
pixel contiguous); a full-size output has its input's layout, grad_y must have x's, and any other strides
raise ValueError (the caller may ``.contiguous()`` and retry). A tensor that is both (C == 1 or
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

Indexing. Offsets inside a sample are int32 (the wrappers require C*H*W < 2**31); the sample's base
offset is int64, so a batch may exceed 2**31 elements.

Numerics of ``moments`` (shifted sums). E[x^2] - E[x]^2 in float32 loses log10(m^2 / s^2) digits for a map
of mean m and spread s. The kernel instead sums d = x - k for a per-map shift k and returns
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
the map's mean, and so are ``scale_shift`` and ``grad_input`` given a center: x * scale alone would round
to the size of m / s (``statistics`` centres its output at the IN mean for this reason).

Launching. On a GPU the tensors must be CUDA tensors. Without a GPU, Triton's interpreter runs the same
kernels on the CPU (numpy, slow: tests only) when TRITON_INTERPRET=1 is set *before this module is
imported* (``triton.jit`` decides at decoration time); CPU tensors are then accepted. CPU tensors
without the interpreter raise ValueError. Importing this module never fails: without Triton,
``available()`` is False and every function raises RuntimeError.
"""

import os

import torch
from torch import Tensor

from . import compiled_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller checks available() and keeps its PyTorch path
    triton = None
    tl = None

__all__ = [
    "available", "cdiv", "checked_vectors", "interpreting", "launch", "next_pow2", "MapPasses", "moments", "scale_shift",
    "centered_dot_and_sum", "grad_input",
]  # fmt: skip

# triton.jit reads TRITON_INTERPRET when the kernels below are decorated, i.e. at import: the same moment
# is recorded here, to tell whether CPU tensors can be run.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 2048  # elements per [BLOCK_C, BLOCK_HW] tile: 16 per thread and accumulator at 4 warps
_CHANNELS_LAST_BLOCK_C = 32
_NUM_WARPS = 4


def available() -> bool:
    """Whether Triton imports, i.e. the kernels can be launched (on CUDA tensors, or on CPU tensors under
    TRITON_INTERPRET=1)."""
    return triton is not None


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when this module was imported),
    which takes CPU tensors."""
    return _INTERPRET


# --------------------------------------------------------------------------------------------------
# Kernels
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
        x_ptr, moments_ptr, N, C, HW, c_blocks,
        HAS_RESIDUAL: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr,
    ):
        # One program: the maps of one sample n and BLOCK_C channels, looping over H*W. The moments block's
        # rows: mean, variance, residual (``MapPasses``).
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
        out = n * C + c  # (N, C) blocks are contiguous and small: int32 suffices (MapPasses)
        mean = shift + mean_d
        tl.store(moments_ptr + out, mean, mask=c_mask)
        tl.store(moments_ptr + N * C + out, var, mask=c_mask)
        if HAS_RESIDUAL:  # what rounding took off the mean: shift - mean is exact (Sterbenz)
            tl.store(moments_ptr + 2 * N * C + out, (shift - mean) + mean_d, mask=c_mask)

    @triton.jit
    def _centered_dot_and_sum_kernel(
        gy_ptr, x_ptr, center_ptr, sums_ptr, N, C, HW, c_blocks,
        CHANNELS_LAST: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr,
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
        x_ptr, y_ptr, affine_ptr, center_ptr, N, C, HW, c_blocks, hw_blocks,
        HAS_CENTER: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr,
    ):
        # the affine block's rows: scale, shift
        n, c, hw = _tile_of_program(c_blocks, hw_blocks, BLOCK_C, BLOCK_HW)
        c_mask = c < C
        mask = c_mask[:, None] & (hw < HW)[None, :]
        base = n.to(tl.int64) * C * HW
        offsets = _tile_offsets(c, hw, C, HW, CHANNELS_LAST)  # y has x's layout: the same offsets

        scale = tl.load(affine_ptr + n * C + c, mask=c_mask, other=0.0)
        shift = tl.load(affine_ptr + N * C + n * C + c, mask=c_mask, other=0.0)
        x = tl.load(x_ptr + base + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_CENTER:
            # centring first keeps the digits x * scale would round away when |mean| >> spread
            x -= tl.load(center_ptr + n * C + c, mask=c_mask, other=0.0)[:, None]
        y = x * scale[:, None] + shift[:, None]
        tl.store(y_ptr + base + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _grad_input_kernel(
        gy_ptr, x_ptr, gx_ptr, scale_ptr, pq_ptr, moments_ptr, N, C, HW, c_blocks, hw_blocks,
        HAS_RESIDUAL: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr,
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
# Wrappers: checks, tile shapes, one launch each
# --------------------------------------------------------------------------------------------------


# Called around every kernel launch, when set (``launches.count_dispatch``, the compile test): a context
# manager factory taking the kernel, its positional arguments and its keyword (meta) arguments.
launch_observer = None
# Set by ``launches.skipped_launches`` only: no kernel runs, so that the host's work around them can be timed.
skip_launches = False


def launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``, seen by ``launch_observer``: every kernel of the package is launched
    here, so that a launch count sees them all. ``args`` and ``meta`` come as a tuple and a dict, which
    plans make once (``meta``, the constexprs and options, is only read). Once a kernel has run for a
    specialization, later calls launch its compiled kernel directly (``compiled_launch``)."""
    if skip_launches:
        return
    if launch_observer is None:
        compiled_launch.launch(kernel, grid, args, meta)
        return
    with launch_observer(kernel, args, meta):
        compiled_launch.launch(kernel, grid, args, meta)


def next_pow2(value: int) -> int:
    """The smallest power of two >= value (1 for 0)."""
    return 1 << max(value - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, in plain Python (``triton.cdiv`` goes through the JIT's call machinery)."""
    return -(-a // b)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed: sn_detection.layers.triton_kernels is unavailable")


def _layout(x: Tensor, name: str) -> bool:
    """Checks a full-size input; returns whether it is channels_last (False: NCHW-contiguous)."""
    if x.dim() != 4:
        raise ValueError(f"{name}: expected an (N, C, H, W) tensor, got shape {list(x.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported (float32, float16 or bfloat16)")
    if not (x.is_cuda or (_INTERPRET and x.device.type == "cpu")):
        raise ValueError(
            f"{name}: tensors on {x.device} cannot be run (CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
            "set before importing sn_detection.layers.triton_kernels)"
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


def _check_same_layout(grad_y: Tensor, x: Tensor) -> bool:
    channels_last = _layout(x, "x")
    _layout(grad_y, "grad_y")
    if grad_y.shape != x.shape or grad_y.device != x.device:
        raise ValueError(f"grad_y {list(grad_y.shape)} on {grad_y.device} does not match x {list(x.shape)} on {x.device}")
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    if not grad_y.is_contiguous(memory_format=memory_format):
        raise ValueError(
            f"grad_y must have x's memory layout ({'channels_last' if channels_last else 'NCHW-contiguous'}); "
            f"got strides {grad_y.stride()} for x's {x.stride()}"
        )
    return channels_last


def _map_vector(v: Tensor, x: Tensor, name: str) -> Tensor:
    """A per-map vector, checked to be float32 (N, C) on x's device, made contiguous (it is small)."""
    if not isinstance(v, Tensor) or v.dtype != torch.float32 or tuple(v.shape) != tuple(x.shape[:2]):
        got = f"{v.dtype} {list(v.shape)}" if isinstance(v, Tensor) else type(v).__name__
        raise ValueError(f"{name}: expected a float32 tensor of shape {list(x.shape[:2])}, got {got}")
    if v.device != x.device:
        raise ValueError(f"{name} is on {v.device}, x on {x.device}")
    return v.contiguous()


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


def checked_vectors(*vectors: Tensor) -> list[Tensor]:
    """(N, C) vectors from outside a layer's plan (autograd may hand over an expanded one), made contiguous;
    refused unless float32, which the kernels read them as."""
    if any(v.dtype != torch.float32 for v in vectors):
        raise ValueError(f"the per-map vectors must be float32, got {[v.dtype for v in vectors]}")
    return [v.contiguous() for v in vectors]


class MapPasses:
    """The four passes over inputs of x's shape and layout, x checked once (``_layout``) and the tiles,
    grids and constants worked out once: a layer's plan keeps one for all its calls with such inputs
    (``fused``). It holds no tensor.

    Per-map statistics travel in blocks: one contiguous float32 tensor whose rows of N * C values (n-major)
    are (N, C) vectors, which the kernels address at row * N * C: one allocation and one kernel argument
    where separate tensors would cost one of each per vector, which is host time on a GPU. The blocks
    (rows in order; a layer's kernels may append statistics of their own after them):

    - moments: the mean, the variance and, from ``moments_and_residual``, each mean's residual;
    - affine: the output's scale and shift, y = (x - center) * scale + shift;
    - sums: the backward's dot = sum grad_y (x - center) and total = sum grad_y;
    - pq: the backward's p and q, grad_x = grad_y * scale + (x - center - residual) * p + q.

    A center or a scale is read from row 0 of whatever tensor is given (a block, or an (N, C) vector).
    The blocks are the layer's own float32 ones (the module's functions and ``passes`` make blocks of
    outside vectors, checked: ``checked_vectors``); grad_y is taken in x's layout (made so if needed: autograd
    may hand over another)."""

    def __init__(self, x: Tensor):
        _require_triton()
        self.channels_last = _layout(x, "x")
        n, c, h, w = x.shape
        self.n, self.c, self.hw = n, c, h * w
        self.block_c, self.block_hw = _tile_shape(c, h * w, self.channels_last)
        self.c_blocks, self.hw_blocks = cdiv(c, self.block_c), cdiv(h * w, self.block_hw)
        self.memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        self.empty = n * c == 0 or h * w == 0
        self.vector_shape = (n, c)
        self.reduce_grid = (n * self.c_blocks,)  # the reductions: one program per (sample, channel block)
        self.map_grid = (n * self.c_blocks * self.hw_blocks,)  # the elementwise passes: one per tile
        meta = dict(CHANNELS_LAST=self.channels_last, BLOCK_C=self.block_c, BLOCK_HW=self.block_hw,
                    num_warps=_NUM_WARPS)  # fmt: skip
        self.meta = meta
        # each launch's constants by its flag, made once (``launch`` takes them as they are)
        self.moments_meta = {flag: dict(meta, HAS_RESIDUAL=flag) for flag in (False, True)}
        self.scale_shift_meta = {flag: dict(meta, HAS_CENTER=flag) for flag in (False, True)}
        self.grad_input_meta = {flag: dict(meta, HAS_RESIDUAL=flag) for flag in (False, True)}

    def block(self, x: Tensor, rows: int, extra: int = 0) -> Tensor:
        """A float32 block of ``rows`` (N, C) rows on x's device, plus ``extra`` values after them, to be
        written in full."""
        if not extra:
            return x.new_empty((rows, *self.vector_shape), dtype=torch.float32)
        return x.new_empty(rows * self.n * self.c + extra, dtype=torch.float32)

    def _reduced(self, x: Tensor, rows: int) -> Tensor:
        """A reduction's block: to be written in full, or zeros where the maps are empty (their sums, and so
        their mean and variance, are 0, like passes.torch_moments')."""
        block = self.block(x, rows)
        return block.zero_() if self.empty else block

    def moments(self, x: Tensor) -> Tensor:
        """The moments block (2, N, C): mean, variance."""
        moments = self._reduced(x, 2)
        if not self.empty:
            launch(_moments_kernel, self.reduce_grid, (x, moments, self.n, self.c, self.hw, self.c_blocks),
                   self.moments_meta[False])  # fmt: skip
        return moments

    def moments_and_residual(self, x: Tensor) -> Tensor:
        """The moments block (3, N, C): mean, variance, residual."""
        moments = self._reduced(x, 3)
        if not self.empty:
            launch(_moments_kernel, self.reduce_grid, (x, moments, self.n, self.c, self.hw, self.c_blocks),
                   self.moments_meta[True])  # fmt: skip
        return moments

    def scale_shift(self, x: Tensor, affine: Tensor, center: Tensor | None = None) -> Tensor:
        """(x - center) * scale + shift (x * scale + shift without a center), in x's dtype and layout."""
        y = _output_like(x)
        if self.empty:
            return y
        has_center = center is not None
        launch(_scale_shift_kernel, self.map_grid,
            (x, y, affine, center if has_center else affine, self.n, self.c, self.hw, self.c_blocks, self.hw_blocks),
            self.scale_shift_meta[has_center],
        )  # fmt: skip
        return y

    def centered_dot_and_sum(self, grad_y: Tensor, x: Tensor, center: Tensor) -> Tensor:
        """The sums block (2, N, C): dot, total."""
        sums = self._reduced(x, 2)
        if self.empty:
            return sums
        grad_y = grad_y.contiguous(memory_format=self.memory_format)
        launch(_centered_dot_and_sum_kernel, self.reduce_grid,
            (grad_y, x, center, sums, self.n, self.c, self.hw, self.c_blocks), self.meta,
        )  # fmt: skip
        return sums

    def grad_input(self, grad_y: Tensor, x: Tensor, scale: Tensor, pq: Tensor, moments: Tensor, residual: bool) -> Tensor:
        """grad_y * scale + (x - mean - residual) * p + q, with the mean (and with ``residual``, its residual)
        from the moments block, in x's dtype and layout."""
        grad_x = _output_like(x)
        if self.empty:
            return grad_x
        grad_y = grad_y.contiguous(memory_format=self.memory_format)
        launch(_grad_input_kernel, self.map_grid,
            (grad_y, x, grad_x, scale, pq, moments, self.n, self.c, self.hw, self.c_blocks, self.hw_blocks),
            self.grad_input_meta[residual],
        )  # fmt: skip
        return grad_x


def moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """IN mean and biased variance over H*W of each (n, c) map of x: two float32 (N, C) tensors, in one
    read of x, by shifted sums (accurate whatever the mean-to-spread ratio: module docstring)."""
    mean, var = MapPasses(x).moments(x).unbind(0)
    return mean, var


def scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor | None = None) -> Tensor:
    """y = x * scale + shift, or (x - center) * scale + shift when ``center`` is given, with float32 (N, C)
    per-map vectors; computed in float32, returned in x's dtype and memory layout."""
    over = MapPasses(x)
    affine = torch.stack([_map_vector(scale, x, "scale"), _map_vector(shift, x, "shift")])
    center = _map_vector(center, x, "center") if center is not None else None
    return over.scale_shift(x, affine, center)


def centered_dot_and_sum(grad_y: Tensor, x: Tensor, center: Tensor) -> tuple[Tensor, Tensor]:
    """dot = sum over H*W of grad_y * (x - center) and total = sum over H*W of grad_y, each float32 (N, C),
    in one read of (grad_y, x)."""
    _require_triton()
    _check_same_layout(grad_y, x)
    dot, total = MapPasses(x).centered_dot_and_sum(grad_y, x, _map_vector(center, x, "center")).unbind(0)
    return dot, total


def grad_input(grad_y: Tensor, x: Tensor, scale: Tensor, p: Tensor, q: Tensor, center: Tensor) -> Tensor:
    """grad_x = grad_y * scale + (x - center) * p + q with float32 (N, C) per-map vectors; computed in
    float32, returned in x's dtype and memory layout; one read of (grad_y, x), one write."""
    _require_triton()
    _check_same_layout(grad_y, x)
    scale, center = _map_vector(scale, x, "scale"), _map_vector(center, x, "center")
    pq = torch.stack([_map_vector(p, x, "p"), _map_vector(q, x, "q")])
    return MapPasses(x).grad_input(grad_y, x, scale, pq, center, residual=False)
