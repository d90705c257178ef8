"""What a training step and an inference forward of each layer ask of the device on the kernel path: exactly
the Triton launches and allocations the docs state (``launch_counts.KERNEL_PATH_COUNTS``, the one place they
are written), no other launch, and no host synchronisation, counted by ``launch_counts`` as a GPU profiler
would count them.

A launch count is a property of the code, not a timing: on a GPU each launch costs microseconds of host
time, so these counts are what keeps the layers from being host-bound there. A change that adds one fails
here until the docs and ``KERNEL_PATH_COUNTS`` say so.
"""

import os

import pytest
import torch

from sn_detection.benchmarks.launch_counts import (
    KERNEL_PATH_COUNTS,
    count_dispatch,
    count_training_step,
    triton_launches,
)
from sn_detection.layers import NORM_NAMES, build_norm

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


def features(layout=torch.contiguous_format, n=2):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, 3, 5, generator=generator)
    grad_y = torch.randn(x.shape, generator=generator)
    return x.to(DEVICE).contiguous(memory_format=layout), grad_y.to(DEVICE).contiguous(memory_format=layout)


def test_every_layer_with_kernels_has_documented_counts():
    assert set(KERNEL_PATH_COUNTS) == set(NORM_NAMES) - {"GN"}  # GN is torch's GroupNorm


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", sorted(KERNEL_PATH_COUNTS))
def test_a_training_step_launches_and_allocates_exactly_the_documented_counts(name, layout, n):
    # each launch a Triton kernel (the (N, C) allocations are no launches): the docs' "Triton kernel launches"
    counts = count_training_step(build_norm(name, 64).to(DEVICE), *features(layout, n))
    documented = KERNEL_PATH_COUNTS[name]
    assert triton_launches(counts) == counts.launches == documented.training, counts.operations
    assert counts.allocations == documented.allocations, counts


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", sorted(KERNEL_PATH_COUNTS))
def test_an_inference_forward_launches_exactly_the_documented_count(name, layout):
    layer = build_norm(name, 64).to(DEVICE).eval()
    x, _ = features(layout)
    with torch.no_grad():
        counts = count_dispatch(lambda: layer(x))
    assert triton_launches(counts) == counts.launches == KERNEL_PATH_COUNTS[name].inference, counts.operations


@pytest.mark.parametrize("name", sorted(KERNEL_PATH_COUNTS))
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
    from sn_detection.layers.kernels import skipped_launches

    x, grad_y = features()
    layer = build_norm("SN", 64).to(DEVICE)
    with skipped_launches():
        assert triton_launches(count_training_step(layer, x, grad_y)) == 0
    assert triton_launches(count_training_step(layer, x, grad_y)) == KERNEL_PATH_COUNTS["SN"].training


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
