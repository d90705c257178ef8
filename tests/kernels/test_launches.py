"""What a training step of each layer asks of the device on the kernel path: at most a handful of kernel
launches (``fused``) and no host synchronisation, counted by ``launches`` as a GPU profiler would count them.

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
from sn_detection.layers.launches import count_dispatch, count_training_step  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# launches per training forward + backward, gradients set to None first (zero_grad's default)
TARGETS = {"SN": 12, "SyncSN": 12, "MGN": 12, "BNSR": 12, "MN": 14, "DN": 20, "PONO": 4}


def features(layout=torch.contiguous_format, n=2):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, 3, 5, generator=generator)
    grad_y = torch.randn(x.shape, generator=generator)
    return x.to(DEVICE).contiguous(memory_format=layout), grad_y.to(DEVICE).contiguous(memory_format=layout)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_training_step_launches_at_most_its_target(name, layout):
    counts = count_training_step(build_norm(name, 64).to(DEVICE), *features(layout))
    assert counts.launches <= TARGETS[name], counts.operations


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", NORM_NAMES)
def test_no_layer_waits_for_the_device(name, n, training):
    # not in a training step (forward and backward), nor in inference: a CUDA graph can capture either
    layer = build_norm(name, 64).to(DEVICE).train(training)
    x, grad_y = features(n=n)
    step = count_training_step(layer, x, grad_y) if training else count_dispatch(lambda: layer(x.requires_grad_()).backward(grad_y))
    with torch.no_grad():
        inference = count_dispatch(lambda: layer(x))
    assert step.syncs == 0 and inference.syncs == 0, (step.operations, inference.operations)
