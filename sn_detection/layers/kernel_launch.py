"""Running this package's Triton kernels: whether Triton is here, and the one way every kernel is launched.

``launch(kernel, grid, args, meta)`` is ``kernel[grid](*args, **meta)``; every Triton kernel of the package
(``map_passes`` and the layers' ``*_kernels``) is launched through it, so that the contexts below see them
all:

- ``observed_launches(observer)``: every launch within the block runs inside ``observer(kernel, args, meta)``,
  a context manager factory (``sn_detection.benchmarks.launch_counts`` counts kernels and leaves out the
  interpreter's own ATen work with one; the compile test records signatures). Blocks nest: every observer
  entered sees every launch.
- ``skipped_launches()``: within the block no kernel runs and no observer sees one; the kernels' outputs keep
  whatever their memory held. It times the host's work around the kernels (``tools/count_launches.py
  --host-time``).
- ``ordinary_launches()``: within the block every launch takes Triton's ordinary path (below).

Outside them a launch costs one test of a module variable that only they set.

Two switches turn the Triton path off for a whole process, to debug it on a GPU. Each is an environment
variable read once, when this package's layers are imported (``environment_switch``): 1 or unset is on, 0
off, anything else an error at import naming the variable and its values. Reading them at import, not per
call plan, gives a process one setting: the layers' call plans, made and kept on first calls
(``base.NormBase.call_plan``), never mix the two. To change one, start a new process.

- ``SN_DETECTION_KERNELS=0`` (``map_passes``): CUDA tensors take the layers' PyTorch path, no Triton kernel
  (as on a machine without Triton 3, without its warning);
- ``SN_DETECTION_DIRECT_LAUNCH=0`` (here): every launch takes Triton's ordinary path, as within an
  ``ordinary_launches()`` block for the whole process (``direct_launch()`` says which is in effect).

Importing this module never fails: without Triton, ``available()`` is False (and ``triton``, ``tl`` are None).
Without a GPU, Triton's interpreter runs the kernels on the CPU (numpy, slow: tests only) when
TRITON_INTERPRET=1 is set *before the kernels are defined* (``triton.jit`` decides at decoration time), which
``interpreting()`` records at import.

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
the interpreter (TRITON_INTERPRET=1, whose kernels are
no ``JITFunction``); a kernel with pre-run hooks, or a custom pipeline hook
(``knobs.runtime.add_stages_inspection_hook``); a grid that is not a tuple; an argument without a key, a
positional argument for a constexpr parameter, a keyword value of another type than bool, int, float, str
and None; a kernel with a global rebound since it was recorded (the JIT compares the values and raises its
error where they changed; the kernels' globals are constexprs, never changed in place). A JIT that
returns no ``CompiledKernel`` (an asynchronous compile) is asked again on the next call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import NamedTuple

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the callers check available() and keep their PyTorch paths
    triton = None
    tl = None

__all__ = [
    "TRITON_VERSIONS",
    "LaunchCounts",
    "available",
    "cdiv",
    "counts",
    "direct_launch",
    "environment_switch",
    "interpreting",
    "launch",
    "launch_key",
    "next_pow2",
    "observed_launches",
    "ordinary_launches",
    "skipped_launches",
    "tl",
    "triton",
    "version_supported",
]

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
