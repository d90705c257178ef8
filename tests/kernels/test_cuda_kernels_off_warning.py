"""On a GPU, the layers' warning about a missing Triton 3 (``kernels.warn_if_kernels_off``) on real CUDA
tensors: silent where the kernels run, once where Triton 3 is taken away (tests/layers/test_kernels_off_warning.py
checks the rest on the CPU)."""

import warnings

import pytest
import torch

from sn_detection.layers import NORM_NAMES, build_norm, kernels

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

PLANNED = [name for name in NORM_NAMES if name != "GN"]  # GN is torch's GroupNorm: no kernels, no plans


def kernels_off_warnings():
    """KernelsOffWarnings of every planned layer's training step on two CUDA input signatures."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in PLANNED:
            layer = build_norm(name, 8).cuda()
            for shape in ((2, 8, 3, 4), (3, 8, 5, 5)):
                layer(torch.randn(shape, device="cuda")).sum().backward()
    return [w for w in caught if issubclass(w.category, kernels.KernelsOffWarning)]


def test_cuda_inputs_warn_once_only_without_triton_3(monkeypatch):
    monkeypatch.setattr(kernels, "_warned_kernels_off", False)  # another test may have warned in this process
    assert kernels.kernel_path(torch.empty(2, 8, 3, 4, device="cuda")), "the GPU checks need Triton 3 or newer"
    assert kernels_off_warnings() == []
    monkeypatch.setattr(kernels, "_TRITON", False)
    assert len(kernels_off_warnings()) == 1
