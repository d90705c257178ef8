"""Every kernel of the package, as the layers launch it, compiled by Triton for an H100 / H200 (sm_90)
without a GPU: the interpreter runs kernels as Python and misses what only the compiler checks (types of
loop-carried values, power-of-two ranges, constexpr specializations of integers equal to 1).

The layers run here under the interpreter, in training and evaluation, with and without gradients (for x
too), fp32 / fp16 / bf16, NCHW and channels_last, on shapes that take different tile sizes; each launch's
signature is recorded where ``kernels.observed_launches`` sees it, and a subprocess without the
interpreter compiles every distinct one.
"""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET:
    pytest.skip("on a GPU the other tests compile and run the kernels", allow_module_level=True)

from sn_detection.layers import NORM_NAMES, build_norm, norm_options, switchable, switchable_kernels  # noqa: E402
from sn_detection.layers.kernels import observed_launches  # noqa: E402  (after the skip)

_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float64: "*fp64",
    torch.int64: "*i64",
}


def signature(kernel, args, meta):
    """What Triton's JIT compiles for these arguments: pointer and scalar types, None, integers equal to 1
    and the keyword arguments as constants."""
    names = kernel.arg_names
    types, constants = {}, {name: value for name, value in meta.items() if name in names}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            types[name] = _TYPES[value.dtype]
        elif value is None or isinstance(value, bool) or (isinstance(value, int) and value == 1):
            constants[name] = value
        elif isinstance(value, int):
            types[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            types[name] = "fp32"
    return {
        "module": kernel.fn.__module__,
        "kernel": kernel.fn.__name__,
        "options": {"num_warps": meta.get("num_warps", 4), "enable_fp_fusion": meta.get("enable_fp_fusion", True)},
        "signature": {name: "constexpr" if name in constants else types[name] for name in names},
        "constants": constants,
    }


def recorded_launches():
    seen = {}

    def observe(kernel, args, meta):
        record = signature(kernel, args, meta)
        seen[json.dumps(record, sort_keys=True)] = record
        return contextlib.nullcontext()

    with observed_launches(observe):
        # SyncSN's and SyncSSN's kernels for several processes too: one process stands in for them (its sums
        # all-reduced with nobody)
        with (
            mock.patch.object(switchable, "_several_processes", lambda: True),
            mock.patch.object(switchable_kernels.dist, "all_reduce", lambda tensor: None),
        ):
            for name in ("SyncSN", "SyncSSN"):
                for layout in (torch.contiguous_format, torch.channels_last):
                    x = torch.randn(2, 24, 3, 5).contiguous(memory_format=layout).requires_grad_()
                    layer = build_norm(name, 24)
                    layer(x).backward(torch.ones_like(x))
                build_norm(name, 24, momentum=None)(x).backward(torch.ones_like(x))
        for name in NORM_NAMES:
            big = (2, 2048, 1, 1) if name == "DN" else (70, 96, 1, 1)  # DN: several channel chunks
            for dtype, layout, shape, modes in (
                (torch.float32, torch.contiguous_format, (2, 64, 3, 5), (True, False)),
                (torch.float16, torch.channels_last, (1, 24, 1, 1), (True, False)),
                (torch.bfloat16, torch.contiguous_format, big, (True,)),
                (torch.float32, torch.contiguous_format, (2, 1, 3, 4), (True,)),  # one channel: a constant
            ):
                for training in modes:
                    torch.manual_seed(0)
                    options = {"num_groups": min(8, shape[1])} if "num_groups" in norm_options(name) else {}
                    layer = build_norm(name, shape[1], **options).train(training)
                    x = torch.randn(shape).to(dtype).contiguous(memory_format=layout)
                    with torch.no_grad():  # inference
                        layer(x)
                    layer(x).backward(torch.ones_like(x))  # no gradient for x: a frozen stem's input
                    x.requires_grad_()
                    layer(x).backward(torch.ones_like(x))
            if "momentum" in norm_options(name):  # the cumulative average: momentum None, a constant
                x = torch.randn(2, 64, 3, 5, requires_grad=True)
                build_norm(name, 64, momentum=None)(x).backward(torch.ones_like(x))
    return list(seen.values())


_COMPILE = textwrap.dedent("""
    import concurrent.futures, importlib, json, os, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_one(record):
        kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
        source = ASTSource(fn=kernel, signature=record["signature"], constexprs=record["constants"])
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=record["options"])
        assert compiled.asm["cubin"], record

    if __name__ == "__main__":
        with concurrent.futures.ProcessPoolExecutor(os.cpu_count()) as pool:
            list(pool.map(compile_one, json.load(sys.stdin)))
""")


def test_every_kernel_compiles_for_sm90_as_the_layers_launch_it():
    launches = recorded_launches()
    kernels = {record["kernel"] for record in launches}
    assert {"_moments_kernel", "_scale_shift_kernel", "_centered_dot_and_sum_kernel", "_grad_input_kernel"} <= kernels
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        input=json.dumps(launches),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0 and "No module named 'triton.backends" in result.stderr:
        pytest.skip("this Triton has no CUDA compiler backend")
    assert result.returncode == 0, result.stderr[-4000:]
