"""MN's and MGN's fused (N, C) kernels (``sn_detection.layers.mode_kernels``): output, every gradient and
every buffer equal the autograd oracle (``reference_normalize_by_moments`` through the layer's own
``scale_and_shift``) in fp32, fp16 and bf16, NCHW and channels_last, training and evaluation, over odd
shapes (one sample, 1x1 maps, channels not a power of two, more samples than one tile), 1 to 5 and 16
modes, nearly unused and unused modes, and channel means 1e4 times their spread (against float64); a
training step stays within its launch budget without a host synchronisation; and, off a GPU, the kernels
compile for an H100.

Runs where tests/kernels/test_map_passes.py runs (a CUDA GPU, or the CPU under Triton's interpreter in
the kernel-test environment); skipped elsewhere.
"""

import copy
import functools
import os

import pytest
import torch

from sn_detection.benchmarks.launch_counts import count_training_step, recorded_kernels
from sn_detection.layers import build_norm, kernels, mode_kernels
from sn_detection.layers.moment_normalizer import reference_normalize_by_moments

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
KERNELS = {"MN": ("_mn_forward_kernel", "_mn_backward_kernel"), "MGN": ("_mgn_forward_kernel", "_mgn_backward_kernel")}
# largest error, relative to the largest value each compared tensor (or the terms it sums) reaches
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def make(name, channels, modes, training, seed=0):
    """A layer with perturbed parameters and, for MN, distinct running statistics per mode."""
    torch.manual_seed(seed)
    layer = build_norm(name, channels, num_modes=modes).to(DEVICE)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
        if name == "MN":
            layer.running_mean.normal_(0.7, 1.0)
            layer.running_var.uniform_(0.5, 3.0)
            layer.num_batches_tracked.fill_(3)
    return layer.train(training)


def inputs(shape, layout=torch.contiguous_format, dtype=torch.float32, seed=1, mean=0.7, spread=1.5):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * spread + mean
    grad_y = torch.randn(shape, generator=generator)
    return (t.to(DEVICE, dtype).contiguous(memory_format=layout) for t in (x, grad_y))


def run_float64(layer, x, grad_y):
    """The oracle in float64 on the same values."""
    return run(copy.deepcopy(layer).double(), x.double(), grad_y.double(), reference)


def reference(layer, x):
    affine = functools.partial(layer.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])
    return reference_normalize_by_moments(x, affine)


def run(layer, x, grad_y, forward=None):
    """Output, gradients (x first, then the parameters) and buffers after one forward and backward."""
    x = x.clone().requires_grad_()
    y = layer(x) if forward is None else forward(layer, x)
    y.backward(grad_y)
    grads = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return y.detach(), grads, {name: b.clone() for name, b in layer.named_buffers()}


def scale_magnitude(layer, x):
    """The largest |scale| of the layer on x: grad_x = grad_y * scale + ... sums terms that large."""
    with torch.no_grad():
        xs = x.double()
        mean, var = xs.mean((2, 3)), xs.var((2, 3), unbiased=False)
        scale, _ = copy.deepcopy(layer).double().scale_and_shift(mean, var, x.shape[2] * x.shape[3])
    return scale.abs().max().item()


def flat(result):
    """{name: tensor} of a ``run`` result: the output, the gradients and the buffers."""
    y, grads, buffers = result
    return {"y": y, **grads, **buffers}


def assert_same(actual, expected, tolerance):
    """Each tensor within ``tolerance`` times its largest value; integer buffers exactly."""
    actual, expected = flat(actual), flat(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and actual[key].shape == value.shape, key
        if value.is_floating_point():
            atol = tolerance * max(value.abs().max().item(), 1e-3)
            torch.testing.assert_close(actual[key].double(), value.double(), rtol=0, atol=atol, msg=key)
        else:
            assert torch.equal(actual[key], value), key


def assert_accurate(actual, oracle, exact, tolerance, x_terms=0.0):
    """``actual`` equals the fp32 ``oracle`` as the oracle equals float64 (``exact``, on the same values):
    each tensor's largest error against float64 is within ``tolerance`` times its largest value, or within 4
    times the oracle's own error (sums whose terms cancel, such as the gates' gradients, carry the rounding
    of the terms). x's gradient sums terms as large as grad_y * scale (``x_terms``), which may cancel to 0;
    a gradient that is 0 but for rounding (the gates' with one sample) is within 1e-6 * ``tolerance``.
    Integer buffers exactly; dtypes as the oracle's."""
    actual, oracle, exact = flat(actual), flat(oracle), flat(exact)
    for key, value in oracle.items():
        assert actual[key].dtype == value.dtype and actual[key].shape == value.shape, key
        if not value.is_floating_point():
            assert torch.equal(actual[key], value), key
            continue
        truth = exact[key].double()
        error = (actual[key].double() - truth).abs().max().item()
        own = (value.double() - truth).abs().max().item()
        size = max(truth.abs().max().item(), x_terms if key == "x" else 0.0, 1.0 if key == "y" else 1e-6)
        assert error <= max(4 * own, tolerance * size), (key, error, own, size)


@pytest.fixture
def launched():
    """The names of the Triton kernels launched while the test runs."""
    with recorded_kernels() as names:
        yield names


def mode_kernels_of(launched):
    """The launches of MN's and MGN's own kernels, the full-size passes left out."""
    return [name for name in launched if name.startswith(("_mn_", "_mgn_"))]


def case_id(value):
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return {torch.contiguous_format: "nchw", torch.channels_last: "channels_last"}.get(value, str(value))


CASES = [  # name, (N, C, H, W), modes, layout
    ("MN", (3, 24, 5, 7), 2, torch.contiguous_format),
    ("MN", (3, 24, 5, 7), 3, torch.channels_last),
    ("MN", (70, 24, 1, 2), 5, torch.contiguous_format),
    ("MN", (2, 96, 3, 3), 1, torch.channels_last),
    ("MN", (1, 8, 1, 1), 2, torch.contiguous_format),
    ("MN", (1, 24, 4, 3), 3, torch.contiguous_format),
    ("MGN", (3, 24, 5, 7), 2, torch.contiguous_format),
    ("MGN", (3, 24, 5, 7), 3, torch.channels_last),
    ("MGN", (70, 24, 1, 2), 5, torch.contiguous_format),
    ("MGN", (2, 96, 3, 3), 1, torch.channels_last),
    ("MGN", (1, 8, 1, 1), 2, torch.contiguous_format),
]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name,shape,modes,layout", CASES, ids=case_id)
def test_fp32_matches_the_autograd_oracle(name, shape, modes, layout, training, launched):
    layer = make(name, shape[1], modes, training)
    x, grad_y = inputs(shape, layout)
    fused = run(copy.deepcopy(layer), x, grad_y)
    assert mode_kernels_of(launched) == list(KERNELS[name]), launched
    expected = run(copy.deepcopy(layer), x, grad_y, reference)
    x_terms = grad_y.abs().max().item() * scale_magnitude(layer, x)
    assert_accurate(fused, expected, run_float64(layer, x, grad_y), TOLERANCE[torch.float32], x_terms)
    assert fused[0].is_contiguous(memory_format=layout) and fused[1]["x"].is_contiguous(memory_format=layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["MN", "MGN"])
def test_half_precision_inputs_match_the_oracle(name, dtype, launched):
    layer = make(name, 24, 3, True)
    x, grad_y = inputs((2, 24, 4, 3), torch.channels_last, dtype)
    fused = run(copy.deepcopy(layer), x, grad_y)
    assert mode_kernels_of(launched) == list(KERNELS[name]), launched
    expected = run(copy.deepcopy(layer), x, grad_y, reference)
    assert fused[0].dtype == dtype and fused[1]["x"].dtype == dtype
    assert_same(fused, expected, TOLERANCE[dtype])


def test_half_precision_parameters_get_gradients_in_their_dtype(launched):
    """model.half(): fp16 parameters and buffers, fp32 statistics; the kernels store in each one's dtype."""
    layer = make("MN", 24, 3, True).half()
    x, grad_y = inputs((2, 24, 4, 3), dtype=torch.float16)
    fused = run(copy.deepcopy(layer), x, grad_y)
    assert mode_kernels_of(launched) == list(KERNELS["MN"]), launched
    expected = run(copy.deepcopy(layer), x, grad_y, reference)
    assert all(g.dtype == torch.float16 for g in fused[1].values())
    assert_same(fused, expected, TOLERANCE[torch.float16])


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_nearly_unused_and_unused_modes(training, launched):
    """MN's mode 1 has total gate weight N_k below the floor (its estimates shrink towards 0, the clamp's
    gradient is 0), mode 2 none at all (gates 0: no running update); the others are ordinary."""
    layer = make("MN", 24, 4, training)
    with torch.no_grad():
        layer.gate.bias[1] -= 20.0  # gates ~1e-9: N_k ~ 3e-9 < 1e-6
        layer.gate.bias[2] -= 300.0  # gates underflow to 0
    x, grad_y = inputs((3, 24, 4, 5))
    fused = run(copy.deepcopy(layer), x, grad_y)
    assert mode_kernels_of(launched) == list(KERNELS["MN"]), launched
    expected = run(copy.deepcopy(layer), x, grad_y, reference)
    x_terms = grad_y.abs().max().item() * scale_magnitude(layer, x)
    assert_accurate(fused, expected, run_float64(layer, x, grad_y), TOLERANCE[torch.float32], x_terms)
    if training:
        assert torch.equal(fused[2]["running_mean"][2], layer.running_mean[2])
        assert not torch.equal(fused[2]["running_mean"][1], layer.running_mean[1])
        assert fused[2]["num_batches_tracked"] == layer.num_batches_tracked + 1


def test_underflowing_mgn_gates_keep_normalized_shares(launched):
    """MGN's mode 1 gets gates that underflow to 0 on every channel: its shares still sum to 1."""
    layer = make("MGN", 24, 3, True)
    with torch.no_grad():
        layer.gate.bias[1] -= 300.0
    x, grad_y = inputs((2, 24, 3, 4))
    fused = run(copy.deepcopy(layer), x, grad_y)
    assert mode_kernels_of(launched) == list(KERNELS["MGN"]), launched
    expected = run(copy.deepcopy(layer), x, grad_y, reference)
    x_terms = grad_y.abs().max().item() * scale_magnitude(layer, x)
    assert_accurate(fused, expected, run_float64(layer, x, grad_y), TOLERANCE[torch.float32], x_terms)


def errors(actual, exact):
    y, grads, buffers = actual
    y64, grads64, buffers64 = exact
    found = {"y": (y.double() - y64).abs().max().item()}
    found.update({key: (grads[key].double() - g).abs().max().item() for key, g in grads64.items()})
    found.update({key: (buffers[key].double() - b.double()).abs().max().item() for key, b in buffers64.items()})
    return found


@pytest.mark.parametrize("gates", ["saturated", "soft"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", ["MN", "MGN"])
def test_large_channel_means_keep_fp32_accuracy(name, training, gates, monkeypatch, launched):
    """Channel means 1e4 times their spread: against float64 on the same values, every output, gradient and
    buffer is within a few times fp32's rounding of the means (1e4 * 2^-24) or within 4 times the existing
    PyTorch path's own error, whichever is larger (the gates of such inputs are functions of 1e4-sized
    means, so the gate weights' gradients, products with those means, are only as precise as those).
    Saturated gates (0 or 1: MN's unused modes are clamped) with the layer's weights, soft ones with the
    gate's weights scaled by 1e-4."""
    layer = make(name, 24, 3, training)
    with torch.no_grad():
        if gates == "soft":
            layer.gate.weight.mul_(1e-4)
        if name == "MN":
            layer.running_mean.add_(1e4)
    x, grad_y = inputs((5, 24, 3, 4), mean=1e4, spread=1.0)
    fused = run(copy.deepcopy(layer), x, grad_y)
    assert mode_kernels_of(launched) == list(KERNELS[name]), launched
    exact = run_float64(layer, x, grad_y)
    monkeypatch.setattr(kernels, "_TRITON", False)  # the PyTorch path, float64 sums and all
    existing = run(copy.deepcopy(layer), x, grad_y)
    fused_errors, existing_errors = errors(fused, exact), errors(existing, exact)
    floor = 1e4 * 2.0**-24 * 4
    for key, error in fused_errors.items():
        assert error <= max(4 * existing_errors[key], floor), (key, error, existing_errors[key])
    # the mode statistics themselves: the running ones to fp32's relative accuracy
    if name == "MN" and training:
        relative = fused_errors["running_var"] / exact[2]["running_var"].abs().max().item()
        assert relative <= 1e-4, relative


@pytest.mark.parametrize("name,limit", [("MN", 14), ("MGN", 12)])
def test_a_training_step_launches_few_kernels_and_never_synchronises(name, limit):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, 6, 6, generator=generator).to(DEVICE)
    counts = count_training_step(build_norm(name, 256).to(DEVICE), x, torch.randn_like(x))
    assert counts.launches <= limit and counts.syncs == 0, counts
    assert all(counts.operations["triton:" + kernel] == 1 for kernel in KERNELS[name]), counts.operations


def test_fallbacks():
    """MN's batch average pools float64 sums in its autograd graph; more than MAX_MODES modes have no kernels."""
    x = torch.randn(2, 8, 3, 3).to(DEVICE)
    layer = build_norm("MN", 8).to(DEVICE).train()
    assert layer.call_plan(x) is not None
    layer.start_batch_average()
    assert layer.call_plan(x) is None
    layer(x)
    layer.finish_batch_average()
    assert layer.call_plan(x) is not None
    for name in ("MN", "MGN"):
        modes = mode_kernels.MAX_MODES
        assert build_norm(name, 8, num_modes=modes).to(DEVICE).call_plan(x) is not None
        assert build_norm(name, 8, num_modes=modes + 1).to(DEVICE).call_plan(x) is None


@pytest.mark.parametrize("name", ["MN", "MGN"])
def test_sixteen_modes(name, launched):
    layer = make(name, 24, 16, True)
    x, grad_y = inputs((6, 24, 2, 3))
    fused = run(copy.deepcopy(layer), x, grad_y)
    assert mode_kernels_of(launched) == list(KERNELS[name]), launched
    expected = run(copy.deepcopy(layer), x, grad_y, reference)
    x_terms = grad_y.abs().max().item() * scale_magnitude(layer, x)
    assert_accurate(fused, expected, run_float64(layer, x, grad_y), TOLERANCE[torch.float32], x_terms)
