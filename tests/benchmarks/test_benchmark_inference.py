"""tools/benchmark_inference.py times onnxruntime on the device it times PyTorch on: the CPU provider on the
CPU, the CUDA provider with MODEL.DEVICE cuda; an onnxruntime without the CUDA provider is refused before
any model is built, rather than timed on the CPU beside models timed on the GPU."""

import onnxruntime
import pytest
import torch

from sn_detection.benchmarks.inference import main, onnx_providers

HAS_CUDA_PROVIDER = "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def test_the_cpu_is_timed_with_the_cpu_provider():
    assert onnx_providers(torch.device("cpu")) == ["CPUExecutionProvider"]


@pytest.mark.skipif(not HAS_CUDA_PROVIDER, reason="this onnxruntime has no CUDA provider")
def test_a_cuda_device_is_timed_with_the_cuda_provider():  # onnxruntime-gpu
    assert onnx_providers(torch.device("cuda")) == ["CUDAExecutionProvider"]


@pytest.mark.skipif(HAS_CUDA_PROVIDER, reason="this onnxruntime has the CUDA provider (onnxruntime-gpu)")
def test_onnx_on_cuda_without_the_cuda_provider_is_refused_before_any_model_is_built(monkeypatch):
    built = []
    monkeypatch.setattr("sn_detection.benchmarks.inference.trained_like", lambda *args: built.append(args))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else the config falls back to the CPU
    with pytest.raises(RuntimeError, match="CUDAExecutionProvider .*onnxruntime-gpu"):
        main(["--parts", "onnx", "--norms", "GN", "MODEL.DEVICE", "cuda"])
    assert built == []
