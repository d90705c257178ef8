"""Triton's real JIT (argument binding, specialization, its kernel cache) over a stand-in for the GPU, on any
machine with a Triton of ``kernels.TRITON_VERSIONS``: its compiled kernels record what their launcher is
called with instead of launching, so that which path ``kernels.launch`` takes, and what it hands the
launcher, can be observed without a GPU (tests/kernels)."""

import contextlib

import triton
import triton.language as tl


def scaled_copy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    """y = scale x on the first n elements (EXTRA: a constexpr with a default)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * scale, mask=mask)


class _StandInDriver:
    """The current device and stream and the target (an H100's), which is all the JIT asks of its driver
    before it compiles."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 4242

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def stand_in_jit(function=scaled_copy):
    """Within the block: a fresh ``JITFunction`` of ``function`` (not the interpreter's, whatever
    TRITON_INTERPRET says) whose compiled kernels, numbered in order of compilation, record each launcher
    call as (kernel number, arguments) in the list given with it, ``(kernel, launches)``."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    launches, compiled = [], []

    def compile(src, target=None, options=None, **_):
        kernel = CompiledKernel.__new__(CompiledKernel)  # what the JIT uses of one, without a compiler
        number = len(compiled)
        kernel.src, kernel.name, kernel.module, kernel.function = src, f"kernel {number}", object(), 1000 + number
        kernel.packed_metadata = ("packed", number)
        kernel._run = lambda *arguments: launches.append((number, arguments))
        compiled.append(kernel)
        return kernel

    active, real_compile = driver._active, triton.compiler.compile
    driver._active, triton.compiler.compile = _StandInDriver(), compile
    try:
        yield JITFunction(function), launches
    finally:
        driver._active, triton.compiler.compile = active, real_compile
        for kernel in compiled:
            kernel.module = None  # nothing loaded: nothing for CompiledKernel.__del__ to unload
