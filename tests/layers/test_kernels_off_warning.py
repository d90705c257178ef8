"""A CUDA input in a process without Triton 3 runs the layers' PyTorch path, and the first layer to plan a
call on one says so, once per process, naming the cause and the fix (``kernels.warn_if_kernels_off``).

No GPU here: a CPU tensor that reports ``is_cuda`` stands for a CUDA input, which is all the layers read
of it while they decide their path (tests/kernels/test_cuda_kernels_off_warning.py repeats the check on a GPU)."""

import types
import warnings

import pytest
import torch

from sn_detection.layers import NORM_NAMES, build_norm, kernels

PLANNED = [name for name in NORM_NAMES if name != "GN"]  # GN is torch's GroupNorm: no kernels, no plans


class CudaLooking(torch.Tensor):
    """A CPU tensor that reports being on CUDA."""

    @property
    def is_cuda(self):
        return True


def cuda_looking(*shape):
    return torch.randn(*shape).as_subclass(CudaLooking)


@pytest.fixture
def triton_2(monkeypatch):
    """A process with Triton 2.3.1 (the reference stack's) that has not warned yet."""
    monkeypatch.setattr(kernels, "triton", types.SimpleNamespace(__version__="2.3.1"))
    monkeypatch.setattr(kernels, "_TRITON", False)
    monkeypatch.setattr(kernels, "_warned_kernels_off", False)


def warned_by(run):
    """The KernelsOffWarnings ``run()`` raised, with Python's own once-per-location filter off."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, kernels.KernelsOffWarning)]


def run_every_layer(make_input):
    """Every planned layer, training and evaluating, on three input signatures, each three times."""
    for name in PLANNED:
        layer = build_norm(name, 8)
        for training in (True, False):
            layer.train(training)
            for shape in ((2, 8, 3, 4), (1, 8, 5, 5), (3, 8, 2, 2)):
                for _ in range(3):
                    layer(make_input(*shape))


def test_cuda_inputs_without_triton_3_warn_once_across_calls_and_layers(triton_2):
    messages = warned_by(lambda: run_every_layer(cuda_looking))
    assert len(messages) == 1, messages
    message = messages[0]
    assert "Triton 2.3.1 is installed" in message and "need Triton 3 or newer" in message
    assert "plain PyTorch path" in message
    assert "torch >= 2.4" in message and "pip install 'triton>=3'" in message
    assert warned_by(lambda: run_every_layer(cuda_looking)) == []  # once per process, not per test or layer


def test_the_warning_names_a_missing_triton(triton_2, monkeypatch):
    monkeypatch.setattr(kernels, "triton", None)
    messages = warned_by(lambda: build_norm("SN", 8)(cuda_looking(2, 8, 3, 4)))
    assert len(messages) == 1 and "Triton is not installed" in messages[0], messages


def test_cpu_inputs_do_not_warn(triton_2):
    assert warned_by(lambda: run_every_layer(torch.randn)) == []
    assert warned_by(lambda: build_norm("SN", 8)(cuda_looking(2, 8, 3, 4)))  # the same process still can


def test_cuda_inputs_with_triton_3_do_not_warn(triton_2, monkeypatch):
    x = cuda_looking(2, 8, 3, 4)
    monkeypatch.setattr(kernels, "_TRITON", True)  # a layer would launch its kernels: the check alone runs
    assert warned_by(lambda: kernels.warn_if_kernels_off(x)) == []
    monkeypatch.setattr(kernels, "_TRITON", False)
    assert len(warned_by(lambda: kernels.warn_if_kernels_off(x))) == 1


def test_the_check_runs_on_a_new_input_signature_only(triton_2, monkeypatch):
    checked = []
    monkeypatch.setattr(kernels, "warn_if_kernels_off", lambda x: checked.append(tuple(x.shape)))
    layer = build_norm("SN", 8)
    for _ in range(5):
        layer(cuda_looking(2, 8, 3, 4))
    layer(cuda_looking(3, 8, 3, 4))
    assert checked == [(2, 8, 3, 4), (3, 8, 3, 4)]
