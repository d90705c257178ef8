"""The shared kernel library: what every layer's Triton kernels stand on. A layer's kernel module (``*_kernels``:
its kernels and their host code) calls into it, and nothing else of the package does on the kernel path:

- start-up: whether Triton is here (``available``), whether its interpreter runs the kernels on the CPU
  (``interpreting``), the two switches read at import (``environment_switch``), and which tensors the kernels
  take (``kernel_path``), with the warning where CUDA tensors cannot have them (``warn_if_kernels_off``);
- launching: ``launch``, the one way every kernel of the package is launched, and the contexts that observe
  or skip the launches;
- the four full-size passes every moment-based layer shares, and BNSR the first (``TritonPasses``), with the
  tiles and layout checks the layers' own full-size kernels use too;
- the running update: the running-statistics rule as Triton helpers (``running_factor``,
  ``store_running_moments``), which a layer's statistics kernel calls for its own buffers, and
  ``written_in_place``, which tells autograd a kernel wrote them.

Start-up. Importing this module never fails: without Triton, ``available()`` is False (and ``triton``, ``tl``
are None). Without a GPU, Triton's interpreter runs the kernels on the CPU (numpy, slow: tests only) when
TRITON_INTERPRET=1 is set *before the kernels are defined* (``triton.jit`` decides at decoration time), which
``interpreting()`` records at import.

The kernel path: CUDA tensors with Triton 3 or newer, and, for CPU tensors, Triton's interpreter
(``TRITON_INTERPRET=1``, tests only); float32, float16 or bfloat16, NCHW-contiguous or channels_last.
Elsewhere (float64, other layouts) a layer's PyTorch path runs (``map_passes`` holds its passes). Where Triton
is missing or older than 3, CUDA tensors take the PyTorch path too, and the first layer to plan a call on one
says so, once per process (``warn_if_kernels_off``).

Two switches turn the Triton path off for a whole process, to debug it on a GPU. Each is an environment
variable read once, when this package's layers are imported (``environment_switch``): 1 or unset is on, 0
off, anything else an error at import naming the variable and its values. Reading them at import, not per
call plan, gives a process one setting: the layers' call plans, made and kept on first calls
(``base.NormBase.call_plan``), never mix the two. To change one, start a new process.

- ``SN_DETECTION_KERNELS=0``: CUDA tensors take the layers' PyTorch path, no Triton kernel (as on a machine
  without Triton 3, without its warning);
- ``SN_DETECTION_DIRECT_LAUNCH=0``: every launch takes Triton's ordinary path, as within an
  ``ordinary_launches()`` block for the whole process (``direct_launch()`` says which is in effect).

Launching. ``launch(kernel, grid, args, meta)`` is ``kernel[grid](*args, **meta)``; every Triton kernel of the
package is launched through it, so that the contexts below see them all:

- ``observed_launches(observer)``: every launch within the block runs inside ``observer(kernel, args, meta)``,
  a context manager factory (``sn_detection.benchmarks.launch_counts`` counts kernels and leaves out the
  interpreter's own ATen work with one; the compile test records signatures). Blocks nest: every observer
  entered sees every launch.
- ``skipped_launches()``: within the block no kernel runs and no observer sees one; the kernels' outputs keep
  whatever their memory held. It times the host's work around the kernels (``tools/count_launches.py
  --host-time``).
- ``ordinary_launches()``: within the block every launch takes Triton's ordinary path (below).

Outside them a launch costs one test of a module variable that only they set.

Launching the compiled handle. ``kernel[grid](*args, **meta)`` goes through Triton's JIT on every call: it
binds the arguments, computes their specialization, turns it and the options into a cache key, looks the
compiled kernel up and builds its launch metadata, which costs several times the launch itself. ``launch``
does the same launch with less: the first call for a launch key takes that ordinary path, which compiles
(or finds) the kernel and returns it, and the key is recorded with that ``CompiledKernel``; later calls with
the same key call its launcher as ``JITFunction.run`` does after its lookup: the current device's current
stream, the launch metadata and the enter and exit hooks of ``triton.knobs.runtime`` (neither, where no hook
is registered: the launcher then calls none, as with empty chains), every parameter's value in signature
order, constexprs included.

The launch key holds all that decides which compiled kernel Triton's JIT picks (its specialization, read
in ``JITFunction.run``, ``create_function_from_signature`` and the native ``specialize_impl``), or more:

- each positional argument: a tensor's dtype and whether its data pointer is a multiple of 16 (Triton
  compiles a divisibility-by-16 assumption into the kernel); an int's width (i32, i64 or u64), whether it
  is 1 (compiled in as a constant) and whether it is a multiple of 16; a bool, a float (passed as fp32,
  never specialized on its value) or None; any other type has no key (``launch_key``);
- the keyword arguments (constexprs such as block sizes and flags, and options such as ``num_warps``,
  ``num_stages``, ``enable_fp_fusion``), by name, type and value (True, 1 and 1.0 are different keys);
- the kernel, the current device, and the global knobs the JIT adds to its options
  (``knobs.runtime.debug``, ``knobs.compilation.instrumentation_mode``).

A key must never be coarser than Triton's specialization (a launch would run a kernel compiled for other
arguments); one that distinguishes more only costs an extra trip through the ordinary path. The stream is
no part of a specialization: it is read on every launch, as the JIT reads it.

All of this is Triton-internal, and was read for Triton 3.6.0 and 3.8.0 (``TRITON_VERSIONS``). These take
the ordinary path, every time: any other version; a process started with ``SN_DETECTION_DIRECT_LAUNCH=0``;
the interpreter (TRITON_INTERPRET=1, whose kernels are no ``JITFunction``); a kernel with pre-run hooks, or a
custom pipeline hook (``knobs.runtime.add_stages_inspection_hook``); a grid that is not a tuple; an argument
without a key, a positional argument for a constexpr parameter, a keyword value of another type than bool,
int, float, str and None; a kernel with a global rebound since it was recorded (the JIT compares the values
and raises its error where they changed; the kernels' globals are constexprs, never changed in place). A JIT
that returns no ``CompiledKernel`` (an asynchronous compile) is asked again on the next call.

The four passes (``TritonPasses``), over full-size (N, C, H, W) tensors, one kernel each; everything between
them is a layer's small (N, C) code:

- ``moments(x, residual)``: the IN mean and biased variance of every (n, c) map, and with ``residual`` each
  mean's residual (below);
- ``scale_shift(x, affine, moments)``: (x - mean) * scale + shift per map;
- ``centered_dot_and_sum(grad_y, x, moments)``: sum(grad_y * (x - mean)) and sum(grad_y) per map;
- ``grad_input(grad_y, x, affine, pq, moments, residual)``: grad_y * scale + (x - mean - residual) * p + q
  (without ``residual``: x - mean).

``map_passes.TorchPasses`` is the same API in PyTorch operations, the PyTorch path's.

Blocks. Per-map statistics travel between the passes in blocks whose rows are (N, C) vectors, row 0 first: a
moments block (mean, variance, residual), an affine block (scale, shift), a sums block (dot, total), a pq
block (p, q). ``TritonPasses`` makes each block one contiguous float32 tensor whose rows of N * C values
(n-major) the kernels address at row * N * C: one allocation and one kernel argument where separate tensors
would cost one of each per vector, which is host time on a GPU (a layer's kernels may append statistics of
their own after the rows: ``TritonPasses.block``). Blocks of vectors from outside a plan are made by
``block_of``. Full-size outputs have x's dtype and memory layout.

The residual. A map whose mean is 1e4 times its spread loses digits of its spread to rounding its mean m to
float32 (m = mean + residual). The backward's p term is the derivative of the variance, 2 (x - m) / HW, taken
at the exact mean, and ``grad_input`` with the residual keeps it there.

The Triton passes read fp16 / bf16 inputs directly (no fp32 copy); loads are widened to float32 and all
arithmetic and accumulation is float32; full-size outputs are rounded once to x's dtype. ``TritonPasses(x)``
refuses (ValueError) any x off the kernel path, and ``block_of`` any vector that is not a float32 (N, C)
tensor on x's device. grad_y is taken in x's layout (made so if needed: autograd may hand over another). A
tensor that is both NCHW-contiguous and channels_last (C == 1 or H*W == 1) is treated as NCHW.

Tiling. Every kernel works on tiles [BLOCK_C, BLOCK_HW] of one sample whose long axis is memory's contiguous
one, so that a warp's loads are coalesced:

- NCHW: BLOCK_HW = min(next_pow2(H*W), 2048) pixels, and as many channels as fill a tile of 2048 elements
  (small maps are packed several to a tile);
- channels_last: BLOCK_C = min(next_pow2(C), 32) channels by BLOCK_HW = 2048 / BLOCK_C pixels.

The two reductions (``moments``, ``centered_dot_and_sum``) run one program per (sample, channel block), which
loops over H*W tile by tile into a [BLOCK_C, BLOCK_HW] float32 tile of partial sums, reduced across the tile
once at the end (a tree of log2(BLOCK_HW) additions after H*W / BLOCK_HW terms each, rather than one running
sum). No atomics: one program owns each map, so the reductions are deterministic. The elementwise kernels run
one program per tile. All kernels use 4 warps.

Indexing. Offsets inside a sample are int32 (``TritonPasses`` requires C*H*W < 2**31); the sample's base
offset is int64, so a batch may exceed 2**31 elements.

Numerics of ``moments`` (shifted sums). E[x^2] - E[x]^2 in float32 loses log10(m^2 / s^2) digits for a map of
mean m and spread s. The kernel instead sums d = x - k for a per-map shift k and returns mean = k + E[d],
var = E[d^2] - E[d]^2 (at least 0), with k the float32 mean of the map's first tile (reduced from the same
registers that then enter the sums, so x is still read once):

1. d is exact: when |m| >> s the elements and k lie within a factor 2 of each other, and the float32
   difference of two such numbers is exact (Sterbenz's lemma).
2. d is of the size of the spread, and the final subtraction cancels only E[d]^2 = (m - k)^2, not m^2:
   nothing for a map within one tile (k is its own mean), next to nothing when the first tile is
   representative (m - k ~ s / sqrt(BLOCK_HW)); a single element as k would be off by a few spreads.
3. The mean is k plus a small correction E[d], whose rounding is relative to s, not m. Rounding k + E[d] to
   one float32 still moves it by up to half a unit of m's last place; the residual (k - mean) + E[d] is what
   it moved, exact to float32 relative to s.

So the variance keeps about as many digits as a two-pass (or Welford) float32 computation, whatever m / s, in
one read of x. ``centered_dot_and_sum``'s x - center is exact for the same reason when center is the map's
mean, and so are ``scale_shift`` and ``grad_input``: x * scale alone would round to the size of m / s
(``moment_normalizer`` centres its output at the IN mean for this reason).

The running update. ``running``'s rule (momentum or the cumulative average, the mean where a row has values,
the variance where it has more than one, Bessel's correction, MN's mixture), for the statistics kernels that
move a layer's running statistics (SN, DN, MN, BNSR): no launch of its own. A kernel's programs (a 1-D grid)
each call ``running_factor`` once, which counts the batch in ``num_batches_tracked`` and gives the factor,
then ``store_running_moments`` for the rows and channels they own. ``momentum=None`` reaches the kernels as
None, which Triton compiles as a constant: the cumulative average's factor is 1 / num_batches_tracked,
counting this batch, which every program needs while one of them counts the batch. Programs may run in any
order and cannot wait for each other, so each takes a ticket, one atomic add of 2^32 to the counter: the low
32 bits of what it reads are the batches counted before (every program reads the same), the high bits how
many programs took a ticket before it, and the last program takes the tickets back and counts the batch.
(With a number, program 0 counts the batch.)
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the callers check available() and keep their PyTorch paths
    triton = None
    tl = None


# --------------------------------------------------------------------------------------------------
# Start-up and launching
# --------------------------------------------------------------------------------------------------

# triton.jit reads TRITON_INTERPRET when a kernel is decorated, i.e. when the module defining it is imported;
# those modules import this one first, so this is what their kernels saw
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

TRITON_VERSIONS = ("3.6.0", "3.8.0")  # whose JITFunction.run, CompiledKernel and CUDA launcher were read
_VERSION_READ = triton is not None and triton.__version__ in TRITON_VERSIONS
DIRECT_LAUNCH_VARIABLE = "SN_DETECTION_DIRECT_LAUNCH"


def environment_switch(name: str, off: str, on: str) -> bool:
    """The on/off environment variable ``name`` (module docstring): True where it is unset, empty or 1, False
    where it is 0; any other value raises a ValueError naming the variable and what 0 (``off``) and 1 (``on``)
    do."""
    value = os.environ.get(name, "").strip()
    if value in ("", "1"):
        return True
    if value == "0":
        return False
    raise ValueError(f"{name}={value!r} is invalid: set it to 0 ({off}) or 1 ({on}; the default), or leave it unset")


# the direct launch, unless the switch turns it off (read once: module docstring)
_DIRECT = (
    environment_switch(
        DIRECT_LAUNCH_VARIABLE,
        off="every kernel through Triton's ordinary launch",
        on="compiled kernels launched directly where Triton's version is one read",
    )
    and _VERSION_READ
)
if _VERSION_READ:  # other versions touch none of Triton's internals
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel
    from triton.knobs import HookChain
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

# An int argument's specialization: its width, and whether it is a multiple of 16. (1 is its own key.)
_INT32, _INT32_D, _INT64, _INT64_D, _UINT64, _UINT64_D, _ONE = "i32", "i32:D", "i64", "i64:D", "u64", "u64:D", "1"
_PLAIN_TYPES = (bool, int, float, str, type(None))
_MISSING = object()


class LaunchCounts:
    """Launches since import: ``direct`` through a recorded compiled kernel, ``ordinary`` through
    ``kernel[grid](...)``."""

    __slots__ = ("direct", "ordinary")

    def __init__(self):
        self.direct = 0
        self.ordinary = 0


class _Recorded(NamedTuple):
    """What a direct launch needs besides the call's own arguments."""

    run: object  # CompiledKernel.run, the CUDA launcher
    function: int  # the loaded kernel's handle
    packed_metadata: tuple
    launch_metadata: object  # CompiledKernel.launch_metadata, the enter and exit hooks' argument
    rest: tuple  # the values of the parameters after the positional arguments: keywords and defaults
    global_objects: tuple  # (name, object, namespace) of every global the kernel reads, as recorded
    kernel: object  # holds the kernel, whose id is in the key


counts = LaunchCounts()
# launch key -> _Recorded, or None for a key that always takes the ordinary path
_recorded: dict = {}
_bypass = False  # set by ordinary_launches only
# What launch() does instead of launching directly: None (launch), _SKIP (nothing) or _observed, which the
# contexts derive from the two below (so that a launch outside them tests one variable)
_SKIP = object()
_intercept = None
_skipping = 0  # skipped_launches blocks entered and not left
_observers: list = []  # the observers of observed_launches blocks, the first entered first


def available() -> bool:
    """Whether Triton imports, i.e. the kernels can be launched (on CUDA tensors, or on CPU tensors under
    TRITON_INTERPRET=1)."""
    return triton is not None


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when this module was imported),
    which takes CPU tensors."""
    return _INTERPRET


def next_pow2(value: int) -> int:
    """The smallest power of two >= value (1 for 0)."""
    return 1 << max(value - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, in plain Python (``triton.cdiv`` goes through the JIT's call machinery)."""
    return -(-a // b)


def direct_launch() -> bool:
    """Whether a launch whose key was recorded goes straight to its compiled kernel (outside an
    ``ordinary_launches`` block): this process's Triton is one whose internals were read, and
    ``SN_DETECTION_DIRECT_LAUNCH`` is not 0."""
    return _DIRECT


def version_supported() -> bool:
    """Whether this process's Triton is one whose internals were read (``TRITON_VERSIONS``); with any other,
    every launch takes the ordinary path."""
    return _VERSION_READ


def _wide_int_key(value: int) -> str:
    aligned = not value & 15
    if value < 2**63:
        return _INT64_D if aligned else _INT64
    return _UINT64_D if aligned else _UINT64  # beyond 2**64 the JIT raises OverflowError


def launch_key(args: tuple, meta: dict) -> tuple | None:
    """What of ``kernel[grid](*args, **meta)`` Triton specializes a compiled kernel on (module docstring),
    as one flat hashable tuple; None where an argument's type is not one of those read.

    The tuple reads unambiguously from the left: a tensor gives its dtype and then its alignment (a bool), an
    int a string, a float, bool or None its type; then each keyword's (name, value) and each value's type."""
    key = []
    append = key.append  # (the host's time per launch is what this module is for)
    for value in args:
        kind = type(value)
        if kind is int:
            if value == 1:
                append(_ONE)
            elif -(2**31) <= value < 2**31:
                append(_INT32 if value & 15 else _INT32_D)
            else:
                append(_wide_int_key(value))
        elif kind is float or kind is bool or value is None:
            append(kind)
        elif isinstance(value, Tensor):
            append(value.dtype)
            append(not value.data_ptr() & 15)
        else:
            return None
    return (*key, *meta.items(), *map(type, meta.values()))


def _record(kernel, compiled, args: tuple, meta: dict):
    """The _Recorded of a call that the JIT launched with ``compiled``; None where calls of this shape
    cannot be launched directly, _MISSING where the JIT gave no CompiledKernel (an asynchronous compile)."""
    if type(compiled) is not CompiledKernel:
        return _MISSING
    parameters = list(kernel.signature.parameters.values())
    if (
        len(args) > len(parameters)
        or any(parameter.is_constexpr for parameter in kernel.params[: len(args)])  # its value: not in the key
        or any(parameter.kind is not parameter.POSITIONAL_OR_KEYWORD for parameter in parameters)
        or not all(isinstance(value, _PLAIN_TYPES) for value in meta.values())
    ):
        return None
    rest = tuple(meta[p.name] if p.name in meta else p.default for p in parameters[len(args) :])
    used = kernel.used_global_vals.items()  # {(name, id of namespace): (value as compiled, namespace)}
    global_objects = tuple((name, namespace.get(name, _MISSING), namespace) for (name, _), (_, namespace) in used)
    return _Recorded(
        compiled.run,
        compiled.function,
        compiled.packed_metadata,
        compiled.launch_metadata,
        rest,
        global_objects,
        kernel,
    )


def _ordinary(kernel, grid, args: tuple, meta: dict):
    counts.ordinary += 1
    return kernel[grid](*args, **meta)


def launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``, as the contexts in effect have it (module docstring). ``args`` and
    ``meta`` come as a tuple and a dict, which plans make once (``meta``, the constexprs and options, is only
    read)."""
    intercept = _intercept
    if intercept is None:
        _launch(kernel, grid, args, meta)
    elif intercept is not _SKIP:  # skipped: no call at all, so that the host's time around the kernels is timed
        intercept(kernel, grid, args, meta)


def _launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``, through the compiled kernel recorded for its launch key where there
    is one (module docstring)."""
    if not _DIRECT or _bypass or type(kernel) is not JITFunction or type(grid) is not tuple:
        _ordinary(kernel, grid, args, meta)
        return
    runtime = knobs.runtime
    key = launch_key(args, meta)
    if key is None or kernel.pre_run_hooks or runtime.add_stages_inspection_hook is not None:
        _ordinary(kernel, grid, args, meta)
        return
    active = driver.active
    device = active.get_current_device()
    key = (id(kernel), device, kernel.debug, runtime.debug, knobs.compilation.instrumentation_mode, key)
    try:
        recorded = _recorded.get(key, _MISSING)
    except TypeError:  # an unhashable keyword value
        recorded = None
    if recorded is _MISSING:
        recorded = _record(kernel, _ordinary(kernel, grid, args, meta), args, meta)
        if recorded is not _MISSING:
            _recorded[key] = recorded
        return
    if recorded is None:
        _ordinary(kernel, grid, args, meta)
        return
    for name, value, namespace in recorded.global_objects:
        if namespace.get(name, _MISSING) is not value:  # rebound: the JIT compares values, and raises if changed
            _ordinary(kernel, grid, args, meta)
            return
    run, function, packed_metadata, launch_metadata, rest, _, _ = recorded
    values = args + rest
    stream = active.get_current_stream(device)
    enter_hook, exit_hook = runtime.launch_enter_hook, runtime.launch_exit_hook
    if type(enter_hook) is HookChain and type(exit_hook) is HookChain and not enter_hook.calls and not exit_hook.calls:
        metadata = enter_hook = exit_hook = None  # no hook listens (the usual case): the launcher calls none
    else:
        metadata = launch_metadata(grid, stream, *values)
    size = len(grid)
    counts.direct += 1
    run(
        grid[0],
        grid[1] if size > 1 else 1,
        grid[2] if size > 2 else 1,
        stream,
        function,
        packed_metadata,
        metadata,
        enter_hook,
        exit_hook,
        *values,
    )


def _observed(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    with contextlib.ExitStack() as stack:
        for observer in tuple(_observers):
            stack.enter_context(observer(kernel, args, meta))
        _launch(kernel, grid, args, meta)


def _set_intercept() -> None:
    global _intercept
    _intercept = _SKIP if _skipping else _observed if _observers else None


# observer(kernel, args, meta): a context manager around the launch of kernel with its positional and keyword
# arguments
LaunchObserver = Callable[[object, tuple, dict], AbstractContextManager]


@contextlib.contextmanager
def observed_launches(observer: LaunchObserver) -> Iterator[None]:
    """Within the block every kernel launch runs inside ``observer(kernel, args, meta)``, after (inside) the
    observers of the blocks entered before (module docstring)."""
    _observers.append(observer)
    _set_intercept()
    try:
        yield
    finally:
        _observers.remove(observer)
        _set_intercept()


@contextlib.contextmanager
def skipped_launches() -> Iterator[None]:
    """Within the block no kernel runs and no observer sees one (``launch`` returns at once): the kernels'
    outputs keep whatever their memory held."""
    global _skipping
    _skipping += 1
    _set_intercept()
    try:
        yield
    finally:
        _skipping -= 1
        _set_intercept()


@contextlib.contextmanager
def ordinary_launches() -> Iterator[None]:
    """Within the block every launch takes Triton's ordinary path, ``kernel[grid](*args, **meta)``, and
    nothing is recorded (to compare or time the two paths)."""
    global _bypass
    previous, _bypass = _bypass, True
    try:
        yield
    finally:
        _bypass = previous


# --------------------------------------------------------------------------------------------------
# The kernel path: which tensors the kernels take
# --------------------------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _triton_version_ok() -> bool:
    if not available():
        return False
    major = int(triton.__version__.split(".")[0])
    return major >= 3  # the kernels are written and tested for Triton 3


_TRITON = _triton_version_ok()
KERNELS_VARIABLE = "SN_DETECTION_KERNELS"
# whether the kernels are wanted at all (read once: module docstring)
_KERNELS_WANTED = environment_switch(
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
    found = f"{triton.__version__} is installed" if available() else "is not installed"
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


# --------------------------------------------------------------------------------------------------
# The four passes: Triton kernels
# --------------------------------------------------------------------------------------------------

_TILE = 2048  # elements per [BLOCK_C, BLOCK_HW] tile: 16 per thread and accumulator at 4 warps
_CHANNELS_LAST_BLOCK_C = 32
_NUM_WARPS = 4

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
# The four passes: checks, tile shapes, one launch each
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
        their mean and variance, are 0, like ``map_passes.plain_moments``')."""
        block = self.block(x, rows)
        return block.zero_() if self.empty else block

    def moments(self, x: Tensor, residual: bool = False) -> Tensor:
        """The moments block: mean, variance and, with ``residual``, each mean's residual ((3, N, C), else
        (2, N, C))."""
        moments = self._reduced(x, 3 if residual else 2)
        if not self.empty:
            launch(
                _moments_kernel,
                self.reduce_grid,
                (x, moments, self.n, self.c, self.hw, self.c_blocks),
                self.residual_meta[residual],
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


# --------------------------------------------------------------------------------------------------
# The running update
# --------------------------------------------------------------------------------------------------

if triton is not None:
    _TICKET = tl.constexpr(1 << 32)

    @triton.jit
    def running_factor(tracked_ptr, momentum, counted):
        # the factor of this batch (module docstring), called once by every program of the grid; ``counted``:
        # 1 if the batch had values, else 0
        if momentum is None:
            ticket = tl.atomic_add(tracked_ptr, _TICKET)
            programs_before = ticket // _TICKET
            if programs_before == tl.num_programs(0) - 1:
                tl.atomic_add(tracked_ptr, counted - (programs_before + 1) * _TICKET)
            factor = 1.0 / tl.maximum(ticket % _TICKET + counted, 1).to(tl.float32)
        else:
            if tl.program_id(0) == 0:
                tl.store(tracked_ptr, tl.load(tracked_ptr) + counted)
            factor = momentum
        return factor

    @triton.jit
    def store_running_moments(
        running_mean_ptr,
        running_var_ptr,
        offsets,
        mask,
        mean,
        var,
        count,
        factor,
        step,
        UNBIASED: tl.constexpr,
        MIXTURE: tl.constexpr,
    ):
        # The running statistics at ``offsets`` (where ``mask``) moved towards a batch's ``mean`` and biased
        # ``var`` of ``count`` values per row (a scalar, or broadcast to the offsets), in mean's dtype, as
        # ``running.update_running_moments``. ``step``: mean - running_mean where the caller pools it more
        # accurately than that difference of two rounded means (MN), else None.
        old_mean = tl.load(running_mean_ptr + offsets, mask=mask, other=0.0).to(mean.dtype)
        old_var = tl.load(running_var_ptr + offsets, mask=mask, other=0.0).to(mean.dtype)
        if step is None:
            delta = mean - old_mean
        else:
            delta = step
        if UNBIASED:
            var = var * (count / tl.maximum(count - 1, 1))
        new_var = old_var + factor * (var - old_var)
        if MIXTURE:
            new_var += factor * (1 - factor) * delta * delta
            var_seen = count > 0
        else:
            var_seen = count > 1
        # tl.where rather than a narrower mask: the count may be a loaded scalar, which the interpreter does
        # not combine with a mask
        tl.store(running_mean_ptr + offsets, tl.where(count > 0, old_mean + factor * delta, old_mean), mask=mask)
        tl.store(running_var_ptr + offsets, tl.where(var_seen, new_var, old_var), mask=mask)


def written_in_place(*tensors: Tensor) -> None:
    """Tell autograd that a kernel wrote ``tensors`` (running statistics) in place, as an in-place ATen
    operation would: a tensor saved for a backward and changed since then is then refused, not misused."""
    torch.autograd.graph.increment_version(tensors)
