"""ModeNorm2d and ModeGroupNorm2d against the paper's Algorithms 1-3 written as explicit loops."""

import pytest
import torch
import torch.nn.functional as F
from low_precision import assert_float32_computation_rounded_once

from sn_detection.layers.mode import ModeGroupNorm2d, ModeNorm2d

EPS = 1e-5
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def naive_mode_estimates(x, gate_weight, gate_bias):
    """Alg. 1: gates g_nk = softmax(Psi(mean_HW x_n)) and per-mode <x>_k, <x^2>_k, with loops over k, c, n."""
    x = x.double()
    batch, channels = x.shape[:2]
    modes = gate_weight.shape[0]
    gate_weight, gate_bias = gate_weight.double(), gate_bias.double()
    gates = torch.stack([torch.softmax(gate_weight @ x[n].mean((1, 2)) + gate_bias, 0) for n in range(batch)])
    mean = torch.zeros(modes, channels, dtype=torch.float64)
    sq_mean = torch.zeros(modes, channels, dtype=torch.float64)
    for k in range(modes):
        weight_k = sum(gates[n, k] for n in range(batch))
        for c in range(channels):
            mean[k, c] = sum(gates[n, k] * x[n, c].mean() for n in range(batch)) / weight_k
            sq_mean[k, c] = sum(gates[n, k] * x[n, c].square().mean() for n in range(batch)) / weight_k
    return gates, mean, sq_mean


def naive_mode_output(x, gates, mean, sq_mean, weight, bias):
    """alpha * sum_k g_nk (x_n - mu_k) / sqrt(sigma_k^2 + eps) + beta, looping over n and k."""
    x = x.double()
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(mean.shape[0]):
            std = torch.sqrt(sq_mean[k] - mean[k].square() + EPS)
            out[n] += gates[n, k] * (x[n] - mean[k][:, None, None]) / std[:, None, None]
    return weight.double()[:, None, None] * out + bias.double()[:, None, None]


def naive_mode_norm_test(x, layer, running_mean, running_sq_mean):
    """Alg. 2: gates from the test sample, estimators from the running averages."""
    gates, _, _ = naive_mode_estimates(x, layer.gate.weight, layer.gate.bias)
    return naive_mode_output(x, gates, running_mean, running_sq_mean, layer.weight, layer.bias)


def naive_mode_group_norm(x, gate_weight, gate_bias, weight, bias):
    """Alg. 3 / Eq. 5, one sample at a time, looping over channels and modes."""
    x = x.double()
    gate_weight, gate_bias = gate_weight.double()[:, 0], gate_bias.double()
    modes = gate_weight.shape[0]
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        channel_means = [x[n, c].mean() for c in range(x.shape[1])]
        gates = [torch.softmax(gate_weight * m + gate_bias, 0) for m in channel_means]
        for k in range(modes):
            weight_k = sum(g[k] for g in gates)
            mean = sum(g[k] * m for g, m in zip(gates, channel_means)) / weight_k
            sq_mean = sum(g[k] * x[n, c].square().mean() for c, g in enumerate(gates)) / weight_k
            out[n] += (x[n] - mean) / torch.sqrt(sq_mean - mean.square() + EPS)
    return weight.double()[:, None, None] * out / modes + bias.double()[:, None, None]


def randomize(layer, generator):
    """Random affine and gate parameters, large enough that the gates clearly differ between inputs."""
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
        layer.weight.add_(1)
    return layer


def multimodal_input(shape, generator, dtype=torch.float64):
    """Samples (or channels) drawn around a few distinct offsets, so that modes mean something."""
    offsets = 2 * torch.randint(-1, 2, (shape[0], shape[1], 1, 1), generator=generator)
    return (offsets + torch.randn(shape, generator=generator)).to(dtype)


def flat_channels(x):
    return x.double().transpose(0, 1).reshape(x.shape[1], -1)


# ---------------------------------------------------------------- MN


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("num_modes", [1, 2, 3])
def test_mode_norm_matches_algorithms_1_and_2(dtype, num_modes):
    generator = torch.Generator().manual_seed(num_modes)
    layer = randomize(ModeNorm2d(5, num_modes=num_modes).to(dtype), generator)
    tolerance = dict(rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    running_mean = torch.zeros(num_modes, 5, dtype=torch.float64)
    running_sq_mean = torch.ones(num_modes, 5, dtype=torch.float64)
    for batch_size in (4, 1, 3):
        x = multimodal_input((batch_size, 5, 3, 4), generator, dtype)
        gates, mean, sq_mean = naive_mode_estimates(x, layer.gate.weight, layer.gate.bias)
        expected = naive_mode_output(x, gates, mean, sq_mean, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x).double(), expected, **tolerance)
        running_mean = 0.9 * running_mean + 0.1 * mean
        running_sq_mean = 0.9 * running_sq_mean + 0.1 * sq_mean
    # the layer keeps Alg. 2's E[x] and E[x^2] as the mean and the variance E[x^2] - E[x]^2
    torch.testing.assert_close(layer.running_mean.double(), running_mean, **tolerance)
    torch.testing.assert_close(layer.running_var.double(), running_sq_mean - running_mean.square(), **tolerance)

    layer.eval()
    x = multimodal_input((3, 5, 3, 4), generator, dtype)
    expected = naive_mode_norm_test(x, layer, running_mean, running_sq_mean)
    torch.testing.assert_close(layer(x).double(), expected, **tolerance)


def test_mode_norm_with_one_mode_is_batch_norm():
    generator = torch.Generator().manual_seed(10)
    layer = randomize(ModeNorm2d(6, num_modes=1), generator)
    bn_mean, bn_var = torch.zeros(6), torch.ones(6)
    for batch_size in (4, 2):
        x = multimodal_input((batch_size, 6, 3, 3), generator, torch.float32)
        expected = F.batch_norm(x, bn_mean, bn_var, layer.weight, layer.bias, training=True, eps=EPS)
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.running_mean[0], bn_mean)

    layer.eval()
    x = multimodal_input((3, 6, 3, 3), generator, torch.float32)
    expected = F.batch_norm(x, layer.running_mean[0], layer.running_var[0], layer.weight, layer.bias, eps=EPS)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


def test_mode_norm_with_one_mode_after_batch_average_is_batch_norm_of_that_batch():
    generator = torch.Generator().manual_seed(11)
    layer = randomize(ModeNorm2d(6, num_modes=1), generator)
    x = multimodal_input((5, 6, 3, 3), generator, torch.float32)
    layer.start_batch_average()
    layer(x)
    layer.finish_batch_average()
    expected = F.batch_norm(x, None, None, layer.weight, layer.bias, training=True, eps=EPS)
    torch.testing.assert_close(layer.eval()(x), expected, rtol=1e-4, atol=1e-4)


def test_mode_norm_batch_average_equals_estimates_of_all_batches_together():
    generator = torch.Generator().manual_seed(12)
    layer = randomize(ModeNorm2d(5, num_modes=3), generator)
    batches = [multimodal_input((batch_size, 5, 4, 4), generator, torch.float32) for batch_size in (3, 1, 4)]
    before = {name: buffer.clone() for name, buffer in layer.named_buffers()}
    layer.start_batch_average()
    for x in batches + [torch.zeros(0, 5, 4, 4)]:
        layer(x)
    for name, buffer in layer.named_buffers():
        torch.testing.assert_close(buffer, before[name], rtol=0, atol=0)
    layer.finish_batch_average()

    _, mean, sq_mean = naive_mode_estimates(torch.cat(batches), layer.gate.weight, layer.gate.bias)
    torch.testing.assert_close(layer.running_mean.double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.running_var.double(), sq_mean - mean.square(), rtol=1e-5, atol=1e-6)


def test_mode_norm_batch_average_weights_batches_by_pixels():
    # Images of different sizes: each sample counts with its gate times its number of pixels.
    generator = torch.Generator().manual_seed(13)
    layer = randomize(ModeNorm2d(4, num_modes=2), generator)
    batches = [multimodal_input(shape, generator, torch.float32) for shape in [(2, 4, 3, 5), (1, 4, 6, 2)]]
    layer.start_batch_average()
    for x in batches:
        layer(x)
    layer.finish_batch_average()

    gates = [naive_mode_estimates(x, layer.gate.weight, layer.gate.bias)[0] for x in batches]
    for k in range(2):
        pixel_gates = torch.cat([g[:, k].repeat_interleave(x[0, 0].numel()) for g, x in zip(gates, batches)])
        values = torch.cat([flat_channels(x) for x in batches], dim=1)
        expected = (values * pixel_gates).sum(1) / pixel_gates.sum()
        torch.testing.assert_close(layer.running_mean[k].double(), expected, rtol=1e-5, atol=1e-6)


def test_mode_norm_batch_average_without_batches_is_an_error():
    layer = ModeNorm2d(4)
    with pytest.raises(RuntimeError, match="start_batch_average"):
        layer.finish_batch_average()
    layer.start_batch_average()
    layer.eval()(torch.randn(2, 4, 3, 3))
    layer.train()(torch.zeros(0, 4, 3, 3))
    with pytest.raises(RuntimeError, match="batch average has no statistics"):
        layer.finish_batch_average()


@pytest.mark.parametrize("training", [True, False])
def test_mode_norm_gradcheck(training):
    generator = torch.Generator().manual_seed(14)
    layer = randomize(ModeNorm2d(4, num_modes=2).double(), generator)
    layer(multimodal_input((6, 4, 3, 3), generator))
    layer.train(training)
    x = multimodal_input((3, 4, 2, 3), generator).requires_grad_()
    names = ["weight", "bias", "gate.weight", "gate.bias"]
    parameters = dict(layer.named_parameters())
    inputs = [x] + [parameters[name].detach().clone().requires_grad_() for name in names]

    def forward(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values)), (x,))

    assert torch.autograd.gradcheck(forward, tuple(inputs))


def test_mode_norm_mode_with_no_samples_stays_finite():
    layer = ModeNorm2d(4, num_modes=2)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.bias.copy_(torch.tensor([0.0, -200.0]))  # softmax underflows: N_2 == 0
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.running_mean).all() and torch.isfinite(layer.running_var).all()


# ---------------------------------------------------------------- MGN


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("num_modes", [1, 2, 3])
def test_mode_group_norm_matches_algorithm_3_in_train_and_eval(dtype, num_modes):
    generator = torch.Generator().manual_seed(20 + num_modes)
    layer = randomize(ModeGroupNorm2d(6, num_modes=num_modes).to(dtype), generator)
    x = multimodal_input((3, 6, 3, 4), generator, dtype)
    expected = naive_mode_group_norm(x, layer.gate.weight, layer.gate.bias, layer.weight, layer.bias)
    for training in (True, False):
        layer.train(training)
        torch.testing.assert_close(layer(x).double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_mode_group_norm_with_one_mode_is_layer_norm():
    generator = torch.Generator().manual_seed(30)
    layer = randomize(ModeGroupNorm2d(6, num_modes=1), generator)
    x = multimodal_input((3, 6, 3, 3), generator, torch.float32)
    expected = F.group_norm(x, 1, layer.weight, layer.bias, eps=EPS)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


def test_mode_group_norm_has_two_k_gate_parameters_and_no_buffers():
    layer = ModeGroupNorm2d(8, num_modes=3)
    assert sum(p.numel() for p in layer.gate.parameters()) == 6
    assert list(layer.buffers()) == []


def test_mode_group_norm_gradcheck():
    generator = torch.Generator().manual_seed(31)
    layer = randomize(ModeGroupNorm2d(4, num_modes=2).double(), generator)
    x = multimodal_input((2, 4, 2, 3), generator).requires_grad_()
    names = ["weight", "bias", "gate.weight", "gate.bias"]
    parameters = dict(layer.named_parameters())
    inputs = [x] + [parameters[name].detach().clone().requires_grad_() for name in names]

    def forward(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values)), (x,))

    assert torch.autograd.gradcheck(forward, tuple(inputs))


# ---------------------------------------------------------------- both

LAYERS = [ModeNorm2d, ModeGroupNorm2d]


@pytest.mark.parametrize("layer_class", LAYERS)
@pytest.mark.parametrize(
    "options, message",
    [(dict(num_modes=0), "num_modes"), (dict(num_modes=1.5), "num_modes"), (dict(eps=-1.0), "eps")],
)
def test_invalid_options_raise_value_error(layer_class, options, message):
    with pytest.raises(ValueError, match=message):
        layer_class(4, **options)


def test_invalid_momentum_channels_and_input_raise_value_error():
    with pytest.raises(ValueError, match="momentum"):
        ModeNorm2d(4, momentum=-0.1)
    for layer_class in LAYERS:
        with pytest.raises(ValueError, match="num_channels"):
            layer_class(0)
        with pytest.raises(ValueError, match=r"\(N, 4, H, W\)"):
            layer_class(4)(torch.randn(2, 4, 3))


@pytest.mark.parametrize("layer_class", LAYERS)
def test_empty_batch_gives_empty_output_and_keeps_buffers(layer_class):
    layer = layer_class(8)
    before = {name: buffer.clone() for name, buffer in layer.named_buffers()}
    for training in (True, False):
        out = layer.train(training)(torch.randn(0, 8, 5, 5))
        assert out.shape == (0, 8, 5, 5)
        out.sum().backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    for name, buffer in layer.named_buffers():
        torch.testing.assert_close(buffer, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("layer_class", LAYERS)
@pytest.mark.parametrize("shape", [(1, 8, 1, 1), (1, 8, 4, 4), (3, 8, 1, 1)])
def test_single_sample_and_single_pixel_are_finite(layer_class, shape):
    layer = randomize(layer_class(8), torch.Generator().manual_seed(40))
    x = torch.randn(shape)
    assert torch.isfinite(layer(x)).all()
    assert torch.isfinite(layer.eval()(x)).all()


@pytest.mark.parametrize("layer_class", LAYERS)
def test_low_precision_input_keeps_its_dtype_and_float32_statistics(layer_class):
    generator = torch.Generator().manual_seed(41)
    layer = randomize(layer_class(8), generator).eval()
    x = multimodal_input((2, 8, 4, 4), generator, torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        assert_float32_computation_rounded_once(layer, x, dtype)


@pytest.mark.parametrize("layer_class", LAYERS)
def test_channels_last_gives_the_same_values(layer_class):
    generator = torch.Generator().manual_seed(42)
    layer = randomize(layer_class(8), generator)
    x = multimodal_input((3, 8, 4, 4), generator, torch.float32)
    torch.testing.assert_close(layer(x.to(memory_format=torch.channels_last)), layer(x))


@pytest.mark.parametrize("layer_class", LAYERS)
def test_state_dict_round_trip(layer_class):
    generator = torch.Generator().manual_seed(43)
    layer = randomize(layer_class(8), generator)
    layer(multimodal_input((4, 8, 3, 3), generator, torch.float32))
    copy = layer_class(8)
    copy.load_state_dict(layer.state_dict())
    for (name, mine), (_, theirs) in zip(layer.state_dict().items(), copy.state_dict().items()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
    x = multimodal_input((2, 8, 3, 3), generator, torch.float32)
    torch.testing.assert_close(copy.eval()(x), layer.eval()(x))
