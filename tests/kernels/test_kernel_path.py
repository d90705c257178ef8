"""The layers on the Triton path: every full-size pass of SN, SyncSN, DN, MN, MGN (and BNSR) goes through
the kernels, and gives the values and gradients of the PyTorch fast path and of the plain-autograd
reference, in fp32, fp16 and bf16, NCHW and channels_last.

Runs where tests/kernels/test_map_passes.py runs (a CUDA GPU, or the CPU under Triton's interpreter in
the kernel-test environment); skipped elsewhere.
"""

import copy
import functools
import os

import pytest
import torch

from sn_detection.layers import build_norm, kernels, map_passes, moment_normalizer
from sn_detection.layers.moment_normalizer import reference_normalize_by_moments

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
FAST_PATH_LAYERS = ["SN", "SyncSN", "DN", "MN", "MGN"]
KERNELS = ("moments", "scale_shift", "centered_dot_and_sum", "grad_input")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def perturbed(name, dtype=torch.float32):
    torch.manual_seed(0)
    layer = build_norm(name, 16).to(DEVICE)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return layer.train()


def run(layer, x, grad_y, forward=None):
    x = x.clone().requires_grad_()
    y = layer(x) if forward is None else forward(layer, x)
    y.backward(grad_y)
    grads = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return y.detach(), grads, {name: b.clone() for name, b in layer.named_buffers()}


def reference(layer, x):
    affine = functools.partial(layer.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])
    return reference_normalize_by_moments(x, affine)


def assert_same(actual, expected, tolerance):
    torch.testing.assert_close(actual[0].float(), expected[0].float(), rtol=tolerance, atol=tolerance)
    for key, grad in expected[1].items():
        torch.testing.assert_close(actual[1][key].float(), grad.float(), rtol=tolerance, atol=tolerance, msg=key)
    for key, buffer in expected[2].items():
        torch.testing.assert_close(actual[2][key], buffer, rtol=tolerance, atol=tolerance, msg=key)


@pytest.fixture
def calls(monkeypatch):
    """Each Triton pass's calls (``kernels.TritonPasses``): the dtype of the full-size tensor each one read first."""
    reads = {kernel: [] for kernel in KERNELS}
    for kernel in KERNELS:
        original = getattr(kernels.TritonPasses, kernel)

        def recorded(self, tensor, *args, kernel=kernel, original=original, **kwargs):
            reads[kernel].append(tensor.dtype)
            return original(self, tensor, *args, **kwargs)

        monkeypatch.setattr(kernels.TritonPasses, kernel, recorded)
    return reads


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", FAST_PATH_LAYERS)
def test_the_kernel_path_gives_the_fast_paths_and_the_references_values(name, layout, calls, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 16, 5, 7, generator=generator) * 1.5 + 0.7).to(DEVICE).contiguous(memory_format=layout)
    grad_y = torch.randn(x.shape, generator=generator).to(DEVICE).contiguous(memory_format=layout)
    layer = perturbed(name)
    on_kernels = run(copy.deepcopy(layer), x, grad_y)
    assert all(calls[kernel] for kernel in KERNELS), calls

    assert_same(on_kernels, run(copy.deepcopy(layer), x, grad_y, reference), TOLERANCE[torch.float32])
    monkeypatch.setattr(kernels, "_TRITON", False)  # the PyTorch fast path
    before = {kernel: len(reads) for kernel, reads in calls.items()}
    assert_same(on_kernels, run(copy.deepcopy(layer), x, grad_y), TOLERANCE[torch.float32])
    assert {kernel: len(reads) for kernel, reads in calls.items()} == before


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", FAST_PATH_LAYERS + ["BNSR"])
def test_half_precision_inputs_are_read_directly_and_match_the_fp32_computation(name, dtype, calls):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, 4, 6, generator=generator).to(DEVICE)
    grad_y = torch.randn(x.shape, generator=generator).to(DEVICE)
    layer = perturbed(name)
    half = run(copy.deepcopy(layer), x.to(dtype), grad_y.to(dtype))
    # the half-precision input reached the kernels as it is, not as a float32 copy; BNSR's later passes
    # read its float32 intermediates
    assert calls["moments"] and calls["moments"][0] == dtype, calls
    if name in FAST_PATH_LAYERS:
        assert all(calls[kernel] and set(calls[kernel]) == {dtype} for kernel in KERNELS), calls
    full = run(copy.deepcopy(layer), x.to(dtype).float(), grad_y.to(dtype).float())
    assert half[0].dtype == dtype and half[1]["x"].dtype == dtype
    assert_same(half, full, TOLERANCE[dtype])


def test_vectors_from_outside_a_plan_are_checked_before_the_kernels_read_them():
    # a layer's plan passes its own float32 blocks; the autograd path makes blocks of its vectors with
    # ``block_of``, which checks them
    x = torch.randn(2, 3, 4, 5).to(DEVICE)
    vector, wide = torch.ones(2, 3, device=DEVICE), torch.ones(2, 3, dtype=torch.float64, device=DEVICE)
    with torch.no_grad():
        over = moment_normalizer.passes_for(x)
        assert isinstance(over, kernels.TritonPasses)
        with pytest.raises(ValueError, match="float32"):
            over.block_of(vector, wide)
        with pytest.raises(ValueError, match="float32"):
            over.block_of(vector[:, :2])
        center = torch.ones(3, device=DEVICE).expand(2, 3)  # stride 0 along N, as autograd may hand over
        y = over.scale_shift(x, over.block_of(2 * vector, vector), over.block_of(center))
        torch.testing.assert_close(y, (x - 1) * 2 + 1)
    assert moment_normalizer.passes_for(x) is map_passes.TorchPasses  # autograd records the passes
