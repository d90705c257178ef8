"""``kernels``: once Triton's JIT has run a kernel for a specialization, later launches with the same
launch key go straight to that compiled kernel, with the same results bit for bit.

Anywhere (with a Triton version of ``TRITON_VERSIONS``):

- the launch key tells apart whatever Triton's own specialization does (its native ``specialize_impl``);
- Triton's real JIT (argument binding, specialization, its kernel cache) over a stand-in for the GPU, whose
  compiled kernels record what their launcher is called with: every launch, direct or not, gets the
  compiled kernel and the launcher arguments that the JIT gives the same call, across alignments, ints
  equal to 1 or a multiple of 16, dtypes, grids, constexprs, options and defaults.

Under the interpreter (TRITON_INTERPRET=1): every launch takes the ordinary path. On a CUDA GPU: the
direct path is taken from the second launch on, every layer gives the same bits both ways, a new
specialization is a miss that gets its own compiled kernel, launch hooks see direct launches, and a Triton
version outside ``TRITON_VERSIONS`` takes the ordinary path.
"""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl
from stand_in_gpu import stand_in_jit

from sn_detection.benchmarks.launch_counts import recorded_kernels
from sn_detection.layers import NORM_NAMES, build_norm, kernels
from sn_detection.layers.kernels import counts, launch_key, ordinary_launches

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
READ_VERSION = triton.__version__ in kernels.TRITON_VERSIONS
needs_cuda = pytest.mark.skipif(not CUDA, reason="the direct launch exists on CUDA only (without the interpreter)")


def _scaled_copy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 3):
    # a kernel of this file only, so that its launch keys are new to this process (EXTRA: a default)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * scale, mask=mask)


_scaled_copy_kernel = triton.jit(_scaled_copy)


def scaled_copy(x, n, block):
    """y = 2 x on the first n elements of x (the rest of y NaN), through ``kernels.launch``; each test
    takes a block size of its own, so that its launch keys are its own."""
    y = torch.full_like(x, float("nan"))
    kernels.launch(_scaled_copy_kernel, (kernels.cdiv(n, block),), (x, y, n, 2.0), {"BLOCK": block})
    return y


def assert_copied(y, x, n, label=None):
    expected = torch.full_like(x, float("nan"))
    expected[:n] = x[:n] * 2
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True, msg=label)


def launched(function):
    """``function()``'s result and its (direct, ordinary) launch counts."""
    direct, ordinary = counts.direct, counts.ordinary
    result = function()
    return result, (counts.direct - direct, counts.ordinary - ordinary)


# --------------------------------------------------------------------------------------------------
# The launch key, anywhere
# --------------------------------------------------------------------------------------------------


def sample_arguments():
    base = torch.zeros(256)
    tensors = [base, base[1:], base[4:], base.half(), base.half()[1:], base.half()[8:], base.bfloat16(), base.double()]
    tensors += [torch.nn.Parameter(base.clone()), torch.zeros(3, 5, dtype=torch.float32)]
    ints = [
        0,
        1,
        2,
        3,
        15,
        16,
        17,
        32,
        -1,
        -16,
        -17,
        2**31 - 16,
        2**31 - 1,
        2**31,
        2**31 + 1,
        -(2**31),
        -(2**31) - 16,
        2**63 - 16,
        2**63 - 1,
        2**63,
        2**63 + 16,
        2**64 - 1,
    ]
    return tensors + ints + [0.0, 1.0, 0.5, -3.5, float("nan"), True, False, None]


@pytest.mark.skipif(not READ_VERSION, reason=f"Triton {triton.__version__}'s specialization was not read")
def test_the_key_tells_apart_whatever_tritons_specialization_does():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = sample_arguments()

    def triton_key(value):  # (type, specialization) as the JIT computes it for a plain parameter
        return native_specialize_impl(BaseBackend, value, False, True, True)

    for a in values:
        for b in values:
            if launch_key((a,), {}) == launch_key((b,), {}):
                assert triton_key(a) == triton_key(b), (a, b)
    # and no finer than needed where it matters: new tensors of a dtype, ints of one kind
    assert launch_key((torch.zeros(8), torch.ones(3)), {}) == launch_key((torch.ones(5), torch.zeros(40)), {})
    assert launch_key((3, 17, 32), {}) == launch_key((5, 33, 48), {})


def test_the_key_holds_alignment_int_specialization_and_dtype():
    x = torch.zeros(64)
    assert launch_key((x,), {}) != launch_key((x[1:],), {})  # 4 bytes further: not a multiple of 16
    assert launch_key((x,), {}) == launch_key((x[4:],), {})  # 16 bytes further
    assert launch_key((x,), {}) != launch_key((x.half(),), {})
    assert launch_key((2,), {}) != launch_key((1,), {})  # 1 is compiled in as a constant
    assert launch_key((2,), {}) != launch_key((16,), {})  # a multiple of 16
    assert launch_key((16,), {}) != launch_key((2**31,), {})  # i32 and i64
    assert launch_key((2**63 - 16,), {}) != launch_key((2**63,), {})  # i64 and u64
    assert launch_key((2,), {}) != launch_key((2.0,), {}) != launch_key((True,), {}) != launch_key((None,), {})


def test_the_key_holds_keyword_values_with_their_types():
    x = torch.zeros(64)
    assert launch_key((x,), {"BLOCK": 64}) != launch_key((x,), {"BLOCK": 128})
    assert launch_key((x,), {"FLAG": 1}) != launch_key((x,), {"FLAG": True}) != launch_key((x,), {"FLAG": 1.0})
    assert launch_key((x,), {"num_warps": 4}) != launch_key((x,), {"num_warps": 8})
    # where the positional arguments end is part of the key
    assert launch_key((x, 2), {"B": 1}) != launch_key((x,), {"B": 1})


def test_arguments_of_other_types_have_no_key():
    class Number(int):
        pass

    assert launch_key((object(),), {}) is None
    assert launch_key(((1, 2),), {}) is None  # tuples: not read
    assert launch_key((Number(3),), {}) is None


# --------------------------------------------------------------------------------------------------
# Triton's JIT over a stand-in for the GPU, anywhere
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def stand_in_gpu():
    """A fresh JITFunction of ``_scaled_copy`` over a stand-in for the GPU (``stand_in_gpu.stand_in_jit``) and
    the list of its launcher calls, (kernel number, arguments)."""
    with stand_in_jit(_scaled_copy) as (kernel, launches):
        yield kernel, launches


def stand_in_calls():
    """Calls of ``_scaled_copy``, each a specialization of its own."""
    buffer, y = torch.zeros(300), torch.zeros(300)
    aligned, half = buffer[:256], buffer.half()
    return [
        ((2,), (aligned, y, 200, 2.0), {"BLOCK": 128}),
        ((2,), (buffer[1:257], y, 200, 2.0), {"BLOCK": 128}),  # x not 16-byte aligned
        ((1,), (aligned, y, 1, 2.0), {"BLOCK": 128}),  # n = 1
        ((2,), (aligned, y, 256, 2.0), {"BLOCK": 128}),  # n a multiple of 16
        ((2,), (aligned, y, 2**31 + 3, 2.0), {"BLOCK": 128}),  # n an i64
        ((2,), (half[:256], half[256:], 200, 2.0), {"BLOCK": 128}),  # fp16
        ((2,), (half[1:257], half[256:], 200, 2.0), {"BLOCK": 128}),  # fp16, x not aligned
        ((4,), (aligned, y, 200, 2.0), {"BLOCK": 64}),  # a constexpr
        ((1, 2), (aligned, y, 200, 2.0), {"BLOCK": 128, "num_warps": 8}),  # a 2-D grid, an option
        ((2, 1, 3), (aligned, y, 200, 2.0), {"BLOCK": 128, "EXTRA": 5}),  # a default given
        ((2,), (aligned, y, 200, 2.0), {"BLOCK": 128, "EXTRA": True}),  # of another type
    ]


def launched_on_stand_in(kernel, launches, calls):
    """(kernel number, launcher arguments) of each call, launched through ``kernels.launch``."""
    start = len(launches)
    for grid, args, meta in calls:
        kernels.launch(kernel, grid, args, meta)
    return launches[start:]


def comparable(arguments):
    # tensors by identity; the launch metadata by what a hook reads of it
    return [id(a) if isinstance(a, torch.Tensor) else a.get() if hasattr(a, "get") else a for a in arguments]


@pytest.mark.skipif(not READ_VERSION, reason=f"Triton {triton.__version__} takes the ordinary path only")
def test_each_launch_gets_the_jits_compiled_kernel_and_launcher_arguments(stand_in_gpu):
    kernel, launches = stand_in_gpu
    calls = stand_in_calls()
    sequence = calls * 2 + calls[::-1]
    with ordinary_launches():
        expected = launched_on_stand_in(kernel, launches, sequence)
    got, (direct, ordinary) = launched(lambda: launched_on_stand_in(kernel, launches, sequence))
    assert (direct, ordinary) == (len(sequence) - len(calls), len(calls))  # each key missed once
    assert len({number for number, _ in expected}) == len(calls)  # the JIT compiled each call apart
    for call, (number, arguments), (expected_number, expected_arguments) in zip(sequence, got, expected):
        assert number == expected_number, call
        # the JIT passes the launch metadata and its hook chains; with no hook registered the direct path
        # passes None for the three: the launcher calls no hook either way
        assert comparable(arguments[:6] + arguments[9:]) == comparable(expected_arguments[:6] + expected_arguments[9:])
        if arguments[6] is not None:
            assert comparable(arguments[6:9]) == comparable(expected_arguments[6:9])
        else:
            assert not expected_arguments[7].calls and not expected_arguments[8].calls


@pytest.mark.skipif(not READ_VERSION, reason=f"Triton {triton.__version__} takes the ordinary path only")
def test_with_a_launch_hook_the_direct_path_passes_what_the_jit_passes(stand_in_gpu):
    from triton import knobs

    kernel, launches = stand_in_gpu
    calls = stand_in_calls()[:3]

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        with ordinary_launches():
            expected = launched_on_stand_in(kernel, launches, calls)
        launched_on_stand_in(kernel, launches, calls)  # recorded
        got, (direct, _) = launched(lambda: launched_on_stand_in(kernel, launches, calls))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert direct == len(calls)
    assert [(number, comparable(arguments)) for number, arguments in got] == [
        (number, comparable(arguments)) for number, arguments in expected
    ]
    assert got[0][1][6].get()["name"] == "kernel 0" and got[0][1][7] is knobs.runtime.launch_enter_hook


@pytest.mark.skipif(not READ_VERSION, reason=f"Triton {triton.__version__} takes the ordinary path only")
def test_calls_the_key_does_not_cover_take_the_ordinary_path_every_time(stand_in_gpu):
    kernel, launches = stand_in_gpu
    x, y = torch.zeros(256), torch.zeros(256)
    calls = [
        ((2,), (x, y, 200, 2.0, 128), {}),  # a constexpr given by position: its value is not in the key
        ((2,), (x,), {"y_ptr": y, "n": 200, "scale": 2.0, "BLOCK": 128}),  # a tensor given by keyword
        ([2], (x, y, 200, 2.0), {"BLOCK": 128}),  # a grid that is no tuple
        ((2,), (x, y, 200, (2.0, 3.0)), {"BLOCK": 128}),  # an argument of a type not read (a tuple)
    ]
    for call in calls:
        _, launches_made = launched(lambda: launched_on_stand_in(kernel, launches, [call] * 3))
        assert launches_made == (0, 3), call


# --------------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not INTERPRET, reason="runs Triton's interpreter (TRITON_INTERPRET=1)")
def test_the_interpreter_takes_the_ordinary_path():
    x = torch.randn(100)
    for _ in range(2):
        y, launches = launched(lambda: scaled_copy(x, 70, block=32))
        assert launches == (0, 1)
        assert_copied(y, x, 70)
    layer = build_norm("SN", 16)
    x = torch.randn(2, 16, 3, 5, requires_grad=True)
    with recorded_kernels() as names:
        _, (direct, ordinary) = launched(lambda: [layer(x).backward(torch.ones_like(x)) for _ in range(2)])
    assert direct == 0 and ordinary == len(names) > 0


# --------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.skipif(not READ_VERSION, reason=f"Triton {triton.__version__} takes the ordinary path only")
def test_later_launches_go_straight_to_the_compiled_kernel():
    x = torch.randn(1000, device="cuda")
    for expected_launches in [(0, 1), (1, 0), (1, 0)]:
        y, launches = launched(lambda: scaled_copy(x, 900, block=64))
        assert launches == expected_launches
        assert_copied(y, x, 900)
    with ordinary_launches():
        y, launches = launched(lambda: scaled_copy(x, 900, block=64))
    assert launches == (0, 1)
    assert_copied(y, x, 900)
    assert launched(lambda: scaled_copy(x, 900, block=64))[1] == (1, 0)  # the block's end restored the direct path


@needs_cuda
@pytest.mark.skipif(not READ_VERSION, reason=f"Triton {triton.__version__} takes the ordinary path only")
def test_a_new_specialization_is_a_miss_with_its_own_compiled_kernel():
    buffer = torch.randn(4096 + 8, device="cuda")
    cases = {  # (x, n): each a specialization of its own
        "aligned, n = 1000": (buffer[:4096], 1000),
        "one element further (not 16-byte aligned)": (buffer[1:4097], 1000),
        "n = 1 (a constant)": (buffer[:4096], 1),
        "n a multiple of 16": (buffer[:4096], 1024),
        "fp16": (buffer[:4096].half(), 1000),
        "fp16 one element further": (buffer.half()[1:4097], 1000),
    }
    for label, (x, n) in cases.items():
        for expected_launches in [(0, 1), (1, 0)]:  # a miss (the JIT compiles or finds it), then the direct path
            y, launches = launched(lambda: scaled_copy(x, n, block=128))
            assert launches == expected_launches, label
            assert_copied(y, x, n, label)
    # in any order, each key finds its own kernel: n = 1's would copy one element, an aligned one could fault
    for label, (x, n) in list(cases.items())[::-1] * 2:
        y, launches = launched(lambda: scaled_copy(x, n, block=128))
        assert launches == (1, 0), label
        assert_copied(y, x, n, label)


def training_step(layer, x, grad_y):
    """Everything a training forward + backward and an evaluation forward produce."""
    x = x.detach().clone().requires_grad_()
    y = layer.train()(x)
    y.backward(grad_y)
    with torch.no_grad():
        evaluation = layer.eval()(x)
    grads = [p.grad for p in layer.parameters() if p.grad is not None]
    return [y, x.grad, *grads, *layer.buffers(), evaluation]


@needs_cuda
@pytest.mark.skipif(not READ_VERSION, reason=f"Triton {triton.__version__} takes the ordinary path only")
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", NORM_NAMES)
def test_every_layer_gives_the_same_bits_both_ways(name, dtype, layout):
    torch.manual_seed(0)
    layer = build_norm(name, 64).cuda()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    x = (torch.randn(2, 64, 12, 20, device="cuda") * 2 + 0.5).to(dtype).contiguous(memory_format=layout)
    grad_y = torch.randn_like(x)
    with ordinary_launches():
        expected = training_step(copy.deepcopy(layer), x, grad_y)
    training_step(copy.deepcopy(layer), x, grad_y)  # records the keys of this step
    with recorded_kernels() as names:
        got, launches = launched(lambda: training_step(copy.deepcopy(layer), x, grad_y))
    if not names:
        pytest.skip(f"{name} launches no Triton kernel")
    assert launches == (len(names), 0)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


@needs_cuda
@pytest.mark.skipif(not READ_VERSION, reason="the launch hooks of the Triton versions read")
def test_launch_hooks_see_direct_launches():
    from triton import knobs

    x = torch.randn(1000, device="cuda")
    scaled_copy(x, 500, block=256)  # recorded
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        _, launches = launched(lambda: scaled_copy(x, 500, block=256))
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert launches == (1, 0)
    assert len(seen) == 1 and seen[0].get()["name"].startswith("_scaled_copy")  # the compiled entry's name


@needs_cuda
def test_a_triton_version_outside_the_list_takes_the_ordinary_path():
    script = textwrap.dedent("""
        import json, torch, triton
        triton.__version__ = "3.7.0"  # one whose internals were not read
        from sn_detection.layers import build_norm, kernels
        layer = build_norm("SN", 64).cuda()
        x = torch.randn(2, 64, 12, 20, device="cuda", requires_grad=True)
        for _ in range(3):
            layer(x).backward(torch.ones_like(x))
        torch.cuda.synchronize()
        print(json.dumps([kernels.counts.direct, kernels.counts.ordinary]))
    """)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    direct, ordinary = json.loads(result.stdout.strip().splitlines()[-1])
    assert direct == 0 and ordinary >= 3 * 6
