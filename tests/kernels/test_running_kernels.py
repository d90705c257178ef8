"""The running-statistics rule in the kernels (``kernels``' running update) against the torch path's
(``running.update_running_moments``) and torch's BatchNorm2d: every layer with running statistics, with a
momentum and with ``momentum=None`` (the cumulative average), on shapes that take several programs (each
program takes a ticket for the cumulative average's count).

Runs where tests/kernels/test_map_passes.py runs (a CUDA GPU, or the CPU under Triton's interpreter).
"""

import copy
import functools
import os
from unittest import mock

import pytest
import torch

from sn_detection.benchmarks.launch_counts import recorded_kernels
from sn_detection.layers import build_norm, switchable, switchable_kernels
from sn_detection.layers.moment_normalizer import reference_normalize_by_moments

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
# the kernel that moves each layer's running statistics; (N, C, H, W) with several programs in it
RUNNING_KERNEL = {
    "SN": ("_forward_kernel", (3, 130, 2, 3)),
    "SyncSN": ("_forward_kernel", (3, 130, 2, 3)),
    "DN": ("_forward_kernel", (20, 130, 1, 2)),
    "MN": ("_mn_forward_kernel", (3, 130, 2, 3)),
    "BNSR": ("_batch_statistics_kernel", (3, 130, 2, 3)),
}


def batches(shape, count=3):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(shape, generator=generator) * (1 + k) + k).to(DEVICE) for k in range(count)]


def autograd_path(layer, x):
    """The layer through its tensor-operation path, which moves the running statistics by the torch rule."""
    if hasattr(layer, "scale_and_shift"):
        affine = functools.partial(layer.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])
        return reference_normalize_by_moments(x, affine)
    return layer.plain_forward(x)


@pytest.mark.parametrize("momentum", [0.3, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("name", sorted(RUNNING_KERNEL))
def test_the_kernels_move_the_running_statistics_as_the_torch_path(name, momentum):
    kernel, shape = RUNNING_KERNEL[name]
    torch.manual_seed(0)
    layer = build_norm(name, shape[1], momentum=momentum).to(DEVICE).train()
    reference = build_norm("SN" if name == "SyncSN" else name, shape[1], momentum=momentum).to(DEVICE).train()
    reference.load_state_dict(copy.deepcopy(layer.state_dict()))
    # SyncSN's pooled kernels: one process stands in for several, its sums all-reduced with nobody
    with (
        mock.patch.object(switchable, "_several_processes", lambda: name == "SyncSN"),
        mock.patch.object(switchable_kernels.dist, "all_reduce", lambda tensor: None),
    ):
        for x in batches(shape):
            with recorded_kernels() as kernels:
                layer(x).sum().backward()
            assert kernel in kernels
            autograd_path(reference, x).sum().backward()
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(layer, key), getattr(reference, key), rtol=2e-5, atol=2e-5, msg=key)


def test_bnsr_at_p1_with_momentum_none_is_batch_norms_cumulative_average():
    _, shape = RUNNING_KERNEL["BNSR"]
    layer = build_norm("BNSR", shape[1], p=1.0, momentum=None).to(DEVICE).train()
    bn = torch.nn.BatchNorm2d(shape[1], momentum=None).to(DEVICE).train()
    for x in batches(shape, count=4):
        torch.testing.assert_close(layer(x), bn(x), rtol=1e-4, atol=1e-4)
    assert layer.num_batches_tracked == bn.num_batches_tracked == 4
    torch.testing.assert_close(layer.running_mean, bn.running_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.running_var, bn.running_var, rtol=1e-5, atol=1e-5)
