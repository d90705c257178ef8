"""DynamicNorm2d against the poster's matrix form: U mu V with U, V built explicitly from the gates."""

import functools

import pytest
import torch
import torch.nn.functional as F
from low_precision import assert_float32_computation_rounded_once

from sn_detection.layers.dynamic import DynamicGrouping, DynamicNorm2d

EPS = 1e-5
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def averaging(size, dtype=torch.float64):
    return torch.full((size, size), 1.0 / size, dtype=dtype)


def gated_factor(gate, size):
    """g * 11^T / size + (1 - g) * I for a real (0-d tensor) or boolean gate."""
    gate = torch.as_tensor(gate, dtype=torch.float64)
    return gate * averaging(size) + (1 - gate) * torch.eye(size, dtype=torch.float64)


def explicit_v(num_channels, channel_gates):
    """V as the Kronecker product of its factors, coarsest first. `channel_gates` are ordered as the
    layer documents: the odd factor r (when r > 1), then the channel bits, least significant first."""
    levels = (num_channels & -num_channels).bit_length() - 1
    odd = num_channels >> levels
    odd_gate = channel_gates[0] if odd > 1 else 0.0
    bit_gates = list(channel_gates[1:] if odd > 1 else channel_gates)
    factors = [gated_factor(g, 2) for g in reversed(bit_gates)] + [gated_factor(odd_gate, odd)]
    return functools.reduce(torch.kron, factors)


def explicit_u(batch_size, batch_gate):
    return gated_factor(batch_gate, batch_size)


def naive_dn(x, u, v, weight, bias, running=None, batch_gate=None):
    """The poster's formula on float64: mu_hat = U mu V, var_hat = U E[x^2] V - mu_hat^2. At test time
    (`running` given) U mu and U E[x^2] come from the running statistics wherever the batch gate is on."""
    x = x.double()
    mu = x.mean((2, 3))
    second = x.square().mean((2, 3))
    if running is None:
        u_mu, u_second = u @ mu, u @ second
    else:
        running_mean, running_var = (r.double() for r in running)
        u_mu = batch_gate * running_mean + (1 - batch_gate) * mu
        u_second = batch_gate * (running_var + running_mean.square()) + (1 - batch_gate) * second
    mu_hat = u_mu @ v
    var_hat = u_second @ v - mu_hat.square()
    normalized = (x - mu_hat[:, :, None, None]) / torch.sqrt(var_hat[:, :, None, None] + EPS)
    return weight.double()[:, None, None] * normalized + bias.double()[:, None, None]


def hard_gates(layer):
    return (layer.channel_gates.detach() > 0).double(), float(layer.batch_gate.detach() > 0)


def random_layer(num_channels, generator, dtype=torch.float64, gates_on=None, **options):
    """A layer with random affine parameters; `gates_on` (booleans, layer order) sets the channel gates."""
    layer = DynamicNorm2d(num_channels, **options).to(dtype)
    with torch.no_grad():
        if gates_on is not None:
            layer.channel_gates.copy_(torch.tensor([1.0 if on else -1.0 for on in gates_on]))
        layer.weight.copy_(1 + 0.5 * torch.randn(num_channels, generator=generator))
        layer.bias.copy_(torch.randn(num_channels, generator=generator))
    return layer


def random_input(shape, generator, dtype=torch.float64):
    # Per-channel offsets and scales, so that pooling over different sets visibly changes the result.
    offsets = 3 * torch.randn(1, shape[1], 1, 1, generator=generator)
    scales = torch.rand(1, shape[1], 1, 1, generator=generator) + 0.5
    return (offsets + scales * torch.randn(shape, generator=generator)).to(dtype)


def batch_moments(x):
    """BN's batch statistics with the biased variance."""
    x = x.double()
    return x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)


# Channel gate patterns in layer order: for 8 = 2^3 the bits; for 12 = 2^2 * 3 the factor 3, then the bits.
GATE_PATTERNS = [
    (8, [True, False, True]),
    (8, [False, True, True]),
    (12, [True, False, True]),
    (12, [False, True, False]),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("num_channels, gates_on", GATE_PATTERNS)
@pytest.mark.parametrize("batch_pool", [False, True])
def test_matches_explicit_matrices_in_train_and_eval(dtype, num_channels, gates_on, batch_pool):
    generator = torch.Generator().manual_seed(num_channels + 7 * batch_pool)
    layer = random_layer(num_channels, generator, dtype, gates_on, init_batch_pool=batch_pool)
    channel_gates, batch_gate = hard_gates(layer)
    v = explicit_v(num_channels, channel_gates)
    running_mean = torch.zeros(num_channels, dtype=torch.float64)
    running_var = torch.ones(num_channels, dtype=torch.float64)
    for batch_size in (3, 1, 4):
        x = random_input((batch_size, num_channels, 4, 5), generator, dtype)
        expected = naive_dn(x, explicit_u(batch_size, batch_gate), v, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x).double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        mean, var = batch_moments(x)
        running_mean = 0.9 * running_mean + 0.1 * mean
        running_var = 0.9 * running_var + 0.1 * var
    torch.testing.assert_close(layer.running_mean.double(), running_mean, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    torch.testing.assert_close(layer.running_var.double(), running_var, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])

    layer.eval()
    x = random_input((3, num_channels, 4, 5), generator, dtype)
    expected = naive_dn(x, None, v, layer.weight, layer.bias, (running_mean, running_var), batch_gate)
    torch.testing.assert_close(layer(x).double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_paper_variance_formula_survives_large_means_in_float32():
    # E[x^2] - E[x]^2 in fp32 loses everything when the mean is 1e4 times the spread; DN must not.
    generator = torch.Generator().manual_seed(0)
    x = 1e3 + 0.1 * torch.randn(4, 8, 6, 6, generator=generator)
    layer = random_layer(8, generator, torch.float32, [True, False, True], init_batch_pool=True)
    channel_gates, batch_gate = hard_gates(layer)
    expected = naive_dn(x, explicit_u(4, batch_gate), explicit_v(8, channel_gates), layer.weight, layer.bias)
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("num_channels", [16, 24])
def test_reduces_to_instance_norm(num_channels):
    x = random_input((3, num_channels, 5, 4), torch.Generator().manual_seed(1), torch.float32)
    layer = DynamicNorm2d(num_channels, init_groups=num_channels)
    assert layer.selected_grouping() == DynamicGrouping(num_channels, 1, True, False)
    for mode in (True, False):
        layer.train(mode)
        torch.testing.assert_close(layer(x), F.instance_norm(x, eps=EPS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_channels", [16, 24])
def test_reduces_to_batch_norm_in_train_and_eval(num_channels):
    generator = torch.Generator().manual_seed(2)
    layer = random_layer(num_channels, generator, torch.float32, init_groups=num_channels, init_batch_pool=True)
    with torch.no_grad():
        layer.channel_gates.fill_(-1.0)
    assert layer.selected_grouping() == DynamicGrouping(num_channels, 1, True, True)
    bn_mean = torch.zeros(num_channels)
    bn_var = torch.ones(num_channels)
    for batch_size in (4, 2, 5):
        x = random_input((batch_size, num_channels, 3, 3), generator, torch.float32)
        expected = F.batch_norm(x, bn_mean, bn_var, layer.weight, layer.bias, training=True, eps=EPS)
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.running_mean, bn_mean)

    layer.eval()
    x = random_input((3, num_channels, 3, 3), generator, torch.float32)
    expected = F.batch_norm(x, layer.running_mean, layer.running_var, layer.weight, layer.bias, eps=EPS)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "num_channels, groups", [(16, 1), (16, 2), (16, 4), (16, 8), (16, 16), (24, 1), (24, 2), (24, 4), (24, 8), (6, 2)]
)
def test_reduces_to_group_norm_and_layer_norm(num_channels, groups):
    generator = torch.Generator().manual_seed(groups)
    layer = random_layer(num_channels, generator, torch.float32, init_groups=groups)
    with torch.no_grad():
        layer.channel_gates.copy_(DynamicNorm2d(num_channels, init_groups=groups).channel_gates)
    assert layer.selected_grouping() == DynamicGrouping(groups, num_channels // groups, True, False)
    x = random_input((2, num_channels, 4, 4), generator, torch.float32)
    expected = F.group_norm(x, groups, layer.weight, layer.bias, eps=EPS)
    for mode in (True, False):
        layer.train(mode)
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


def test_default_grouping_is_gn32_or_the_largest_power_of_two_dividing_c():
    assert DynamicNorm2d(256).selected_grouping() == DynamicGrouping(32, 8, True, False)
    assert DynamicNorm2d(16).selected_grouping() == DynamicGrouping(16, 1, True, False)
    assert DynamicNorm2d(24).selected_grouping() == DynamicGrouping(8, 3, True, False)
    assert DynamicNorm2d(3).selected_grouping() == DynamicGrouping(1, 3, True, False)
    assert DynamicNorm2d(1).selected_grouping() == DynamicGrouping(1, 1, True, False)


def test_odd_factor_gate_and_strided_groupings():
    # C = 12 = 2^2 * 3: gates [r = 3, bit 0, bit 1]; bit 0 without r pools channels c and c + 3.
    layer = DynamicNorm2d(12)
    assert layer.channel_gates.shape == (3,)
    with torch.no_grad():
        layer.channel_gates.copy_(torch.tensor([-1.0, 1.0, -1.0]))
    assert layer.selected_grouping() == DynamicGrouping(6, 2, False, False)
    x = random_input((2, 12, 3, 3), torch.Generator().manual_seed(3), torch.float32)
    # Strided pairs {0, 3}, {1, 4}, {2, 5}, ... become contiguous after a channel permutation.
    order = torch.tensor([0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11])
    expected = F.group_norm(x[:, order], 6, eps=EPS)[:, torch.argsort(order)]
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(init_groups=3), r"valid choices: \[1, 2, 4, 12\]"),
        (dict(init_groups=32), r"valid choices: \[1, 2, 4, 12\]"),
        (dict(eps=0.0), "eps"),
        (dict(momentum=1.5), "momentum"),
        (dict(init_batch_pool="yes"), "init_batch_pool"),
    ],
)
def test_invalid_options_raise_value_error(options, message):
    with pytest.raises(ValueError, match=message):
        DynamicNorm2d(12, **options)


def test_invalid_channels_and_input_shape_raise_value_error():
    with pytest.raises(ValueError, match="num_channels"):
        DynamicNorm2d(0)
    with pytest.raises(ValueError, match=r"\(N, 4, H, W\)"):
        DynamicNorm2d(4)(torch.randn(2, 3, 2, 2))


@pytest.mark.parametrize("training", [True, False])
def test_gradcheck_with_fixed_gates(training):
    generator = torch.Generator().manual_seed(4)
    layer = random_layer(6, generator, gates_on=[False, True], init_batch_pool=True)
    with torch.no_grad():
        layer.running_mean.copy_(torch.randn(6, generator=generator, dtype=torch.float64))
        layer.running_var.uniform_(0.5, 2.0, generator=generator)
    layer.train(training)
    x = random_input((3, 6, 2, 3), generator).requires_grad_()
    weight = layer.weight.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()

    def forward(x, weight, bias):
        return torch.func.functional_call(layer, {"weight": weight, "bias": bias}, (x,))

    assert torch.autograd.gradcheck(forward, (x, weight, bias))


@pytest.mark.parametrize("num_channels, gates_on", GATE_PATTERNS)
@pytest.mark.parametrize("batch_pool", [False, True])
def test_straight_through_gradient_is_the_relaxed_kronecker_derivative(num_channels, gates_on, batch_pool):
    # Backward must differentiate the paper's formula with each gate's factor g * 11^T/s + (1 - g) * I
    # as if g were a real number, at the hard gate values.
    generator = torch.Generator().manual_seed(5)
    layer = random_layer(num_channels, generator, gates_on=gates_on, init_batch_pool=batch_pool)
    x = random_input((4, num_channels, 3, 3), generator)
    probe = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    (layer(x) * probe).sum().backward()

    channel_gates, batch_gate = hard_gates(layer)
    channel_gates.requires_grad_()
    batch_gate = torch.tensor(batch_gate, dtype=torch.float64, requires_grad=True)
    v = explicit_v(num_channels, channel_gates)
    relaxed = naive_dn(x, explicit_u(4, batch_gate), v, layer.weight, layer.bias)
    (relaxed * probe).sum().backward()

    assert layer.channel_gates.grad.abs().min() > 0 and layer.batch_gate.grad.abs() > 0
    torch.testing.assert_close(layer.channel_gates.grad, channel_gates.grad)
    torch.testing.assert_close(layer.batch_gate.grad, batch_gate.grad)


def flat_channels(x):
    return x.double().transpose(0, 1).reshape(x.shape[1], -1)


def test_batch_average_equals_statistics_of_all_batches_together():
    generator = torch.Generator().manual_seed(6)
    layer = random_layer(8, generator, torch.float32, init_batch_pool=True)
    batches = [random_input(shape, generator, torch.float32) for shape in [(3, 8, 4, 4), (1, 8, 5, 3), (2, 8, 4, 4)]]
    before = {name: buffer.clone() for name, buffer in layer.named_buffers()}
    layer.start_batch_average()
    for x in batches + [torch.zeros(0, 8, 4, 4)]:
        layer(x)
    for name, buffer in layer.named_buffers():
        torch.testing.assert_close(buffer, before[name], rtol=0, atol=0)
    layer.finish_batch_average()

    pixels = torch.cat([flat_channels(x) for x in batches], dim=1)
    torch.testing.assert_close(layer.running_mean.double(), pixels.mean(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.running_var.double(), pixels.var(1, unbiased=False), rtol=1e-5, atol=1e-6)

    # Afterwards the momentum update is back.
    layer(batches[0])
    mean, _ = batch_moments(batches[0])
    torch.testing.assert_close(layer.running_mean.double(), 0.9 * pixels.mean(1) + 0.1 * mean, rtol=1e-5, atol=1e-6)


def test_batch_average_without_batches_is_an_error():
    layer = DynamicNorm2d(4)
    with pytest.raises(RuntimeError, match="start_batch_average"):
        layer.finish_batch_average()
    layer.start_batch_average()
    layer.eval()(torch.randn(2, 4, 3, 3))
    layer.train()(torch.zeros(0, 4, 3, 3))
    with pytest.raises(RuntimeError, match="batch average has no statistics"):
        layer.finish_batch_average()


def test_eval_output_of_a_sample_does_not_depend_on_its_batch():
    generator = torch.Generator().manual_seed(7)
    layer = random_layer(8, generator, torch.float32, init_batch_pool=True)
    layer(random_input((4, 8, 3, 3), generator, torch.float32))
    layer.eval()
    x = random_input((3, 8, 3, 3), generator, torch.float32)
    torch.testing.assert_close(layer(x)[1:2], layer(x[1:2]))


@pytest.mark.parametrize("batch_pool", [False, True])
def test_empty_batch_gives_empty_output_and_keeps_buffers(batch_pool):
    layer = DynamicNorm2d(8, init_batch_pool=batch_pool)
    before = {name: buffer.clone() for name, buffer in layer.named_buffers()}
    out = layer(torch.randn(0, 8, 5, 5))
    assert out.shape == (0, 8, 5, 5)
    out.sum().backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    for name, buffer in layer.named_buffers():
        torch.testing.assert_close(buffer, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("batch_pool", [False, True])
@pytest.mark.parametrize("shape", [(1, 8, 1, 1), (1, 8, 4, 4), (3, 8, 1, 1)])
def test_single_sample_and_single_pixel_are_finite(batch_pool, shape):
    layer = DynamicNorm2d(8, init_batch_pool=batch_pool, init_groups=8)
    x = torch.randn(shape)
    assert torch.isfinite(layer(x)).all()
    assert torch.isfinite(layer.eval()(x)).all()


def test_low_precision_input_keeps_its_dtype_and_float32_statistics():
    generator = torch.Generator().manual_seed(8)
    layer = random_layer(8, generator, torch.float32, init_batch_pool=True)
    x = random_input((2, 8, 4, 4), generator, torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        assert_float32_computation_rounded_once(layer, x, dtype)


def test_channels_last_gives_the_same_values():
    generator = torch.Generator().manual_seed(9)
    layer = random_layer(8, generator, torch.float32, init_batch_pool=True)
    x = random_input((2, 8, 4, 4), generator, torch.float32)
    torch.testing.assert_close(layer(x.to(memory_format=torch.channels_last)), layer(x))


def test_state_dict_round_trip():
    generator = torch.Generator().manual_seed(10)
    layer = random_layer(12, generator, torch.float32, init_batch_pool=True)
    layer(random_input((4, 12, 3, 3), generator, torch.float32))
    copy = DynamicNorm2d(12)
    copy.load_state_dict(layer.state_dict())
    for (name, mine), (_, theirs) in zip(layer.state_dict().items(), copy.state_dict().items()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
    assert copy.selected_grouping() == layer.selected_grouping()
    x = random_input((2, 12, 3, 3), generator, torch.float32)
    torch.testing.assert_close(copy.eval()(x), layer.eval()(x))
