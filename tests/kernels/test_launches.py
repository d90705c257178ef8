"""What a training step of each layer asks of the device on the kernel path: at most a handful of kernel
launches (``moment_normalizer``) and no host synchronisation, counted by ``launch_counts`` as a GPU profiler
would count them.

A launch count is a property of the code, not a timing: on a GPU each launch costs microseconds of host
time, so these counts are what keeps the layers from being host-bound there.
"""

import os

import pytest
import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 on the CPU", allow_module_level=True)
if INTERPRET and int(triton.__version__.split(".")[0]) < 3:
    pytest.skip(f"the interpreter of Triton {triton.__version__} cannot run these kernels", allow_module_level=True)

from sn_detection.layers import NORM_NAMES, build_norm  # noqa: E402  (after the skips)
from sn_detection.layers.launch_counts import count_dispatch, count_training_step  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# launches per training forward + backward, gradients set to None first (zero_grad's default)
TARGETS = {"SN": 12, "SyncSN": 12, "SSN": 12, "SyncSSN": 12, "MGN": 12, "BNSR": 12, "MN": 14, "DN": 20, "PONO": 4}


def features(layout=torch.contiguous_format, n=2):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, 3, 5, generator=generator)
    grad_y = torch.randn(x.shape, generator=generator)
    return x.to(DEVICE).contiguous(memory_format=layout), grad_y.to(DEVICE).contiguous(memory_format=layout)


# allocations per training step: each is a call into the allocator, host time on a GPU (the (N, C) vectors,
# the parameters' gradients, the output and grad_x)
ALLOCATIONS = {"SN": 10, "SyncSN": 10, "SSN": 10, "SyncSSN": 10, "MGN": 10, "MN": 10, "DN": 10, "BNSR": 9, "PONO": 6}


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_training_step_launches_at_most_its_target(name, layout):
    counts = count_training_step(build_norm(name, 64).to(DEVICE), *features(layout))
    assert counts.launches <= TARGETS[name], counts.operations
    assert counts.allocations <= ALLOCATIONS[name], counts


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_later_calls_launch_and_allocate_as_the_first(name):
    # the plan of the first call is kept (``base.NormBase.call_plan``): later calls run the same kernels
    layer = build_norm(name, 64).to(DEVICE)
    first, later = (count_training_step(layer, *features()) for _ in range(2))
    assert later.operations == first.operations and later.allocations == first.allocations


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", NORM_NAMES)
def test_no_layer_waits_for_the_device(name, n, training):
    # not in a training step (forward and backward), nor in inference: a CUDA graph can capture either
    layer = build_norm(name, 64).to(DEVICE).train(training)
    x, grad_y = features(n=n)
    step = (
        count_training_step(layer, x, grad_y)
        if training
        else count_dispatch(lambda: layer(x.requires_grad_()).backward(grad_y))
    )
    with torch.no_grad():
        inference = count_dispatch(lambda: layer(x))
    assert step.syncs == 0 and inference.syncs == 0, (step.operations, inference.operations)


def test_skipped_launches_run_no_kernel_and_end_with_the_block():
    from sn_detection.layers.kernel_launch import skipped_launches

    def triton_launches(counts):
        return sum(number for name, number in counts.operations.items() if name.startswith("triton:"))

    x, grad_y = features()
    layer = build_norm("SN", 64).to(DEVICE)
    with skipped_launches():
        assert triton_launches(count_training_step(layer, x, grad_y)) == 0
    assert triton_launches(count_training_step(layer, x, grad_y)) == 6


def test_the_tool_times_every_layers_host_work_without_detectron2(tmp_path):
    """The launch count's tool runs where detectron2 is absent (the kernel-test environment has none), and
    --host-time gives every layer a training-step and an evaluation-forward time and a ratio to torch's
    GroupNorm; --json goes into a folder the tool makes."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(repo, "tools", "count_launches.py"),
            "--host-time",
            "--rounds",
            "1",
            "--json",
            str(tmp_path / "out" / "counts.json"),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["layer"]: row for row in json.loads((tmp_path / "out" / "counts.json").read_text())}
    for key in ("host_time", "host_time_eval"):
        assert rows["torch BN"][key] is None and rows["torch GN(32)"][key]["ratio"] == 1.0
        for name in NORM_NAMES:
            assert rows[name][key]["seconds"] > 0, rows[name]
    for name in NORM_NAMES:
        assert f"\n{name} " in result.stdout
