"""SSN: SparsestMax against a straightforward implementation of its definition (sort, project, circle, edge),
its gradients, the one-hot freeze and its state, and the layer against the SN equation with those weights."""

import copy
import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from sn_detection.layers import SparseSwitchableNorm2d, SyncSparseSwitchableNorm2d, build_norm
from sn_detection.layers.fused import replaying
from sn_detection.layers.moment_normalizer import reference_normalize_by_moments
from sn_detection.layers.sparse_switchable import linear_radius, set_radius, sparsemax, sparsestmax
from sn_detection.layers.switchable_kernels import SwitchableClosedForms

VERTEX = {3: math.sqrt(2 / 3), 2: math.sqrt(1 / 2)}  # the vertices' distance to the simplex's centre


def reference_sparsemax(z):
    """Sparsemax by its definition: sort descending, the largest k with z_(k) > (sum_{j<=k} z_(j) - 1) / k."""
    ordered = sorted(z, reverse=True)
    k = max(k for k in range(1, len(z) + 1) if ordered[k - 1] > (sum(ordered[:k]) - 1) / k)
    tau = (sum(ordered[:k]) - 1) / k
    return [max(v - tau, 0.0) for v in z]


def reference_sparsestmax(z, r):
    """SparsestMax by its definition, in Python floats: the sparsemax; moved out to the circle of radius r
    around the centre if closer; then, if that left the simplex, the point of the edge between its two largest
    entries at distance r (3 entries), clipped to [0, 1]. At the centre itself the point moves towards entry 0;
    among equal entries the earlier one is the larger."""
    k = len(z)
    w = reference_sparsemax(z)
    u = 1 / k
    d = 0.0 if len(set(z)) == 1 else math.sqrt(sum((v - u) ** 2 for v in w))  # equal logits: the centre, unrounded
    if d >= r:
        return w
    direction = [(v - u) / d for v in w] if d > 0 else [(float(i == 0) - u) / math.sqrt((k - 1) / k) for i in range(k)]
    p = [u + r * v for v in direction]
    if min(p) < 0 and k == 3:
        order = sorted(range(k), key=lambda i: (-p[i], i))
        s = math.sqrt(max(2 * r * r - 1 / 3, 0.0))
        p = [0.0] * k
        p[order[0]], p[order[1]] = (1 + s) / 2, (1 - s) / 2
    return [min(max(v, 0.0), 1.0) for v in p]


def random_logits(k, count, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, k, generator=generator, dtype=torch.float64) * scale


def ssn(r, *logits):
    return sparsestmax(torch.tensor(logits, dtype=torch.float64), torch.tensor(r, dtype=torch.float64)).tolist()


@pytest.mark.parametrize("k", [3, 2])
@pytest.mark.parametrize("r", [0.0, 0.1, 0.3, 0.45, 0.6, 0.75, 0.8, 1.0])
def test_sparsestmax_is_its_definition(k, r):
    logits = torch.cat([random_logits(k, 200, seed=k, scale=scale) for scale in (0.1, 0.5, 2.0)])
    got = sparsestmax(logits, torch.tensor(r, dtype=torch.float64))
    expected = torch.tensor([reference_sparsestmax(row.tolist(), r) for row in logits], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(logits), dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", [3, 2])
def test_radius_zero_is_sparsemax(k):
    logits = random_logits(k, 300, seed=5)
    expected = torch.tensor([reference_sparsemax(row.tolist()) for row in logits], dtype=torch.float64)
    torch.testing.assert_close(sparsemax(logits), expected, rtol=0, atol=1e-12)
    assert sparsestmax(logits, torch.tensor(0.0, dtype=torch.float64)).equal(sparsemax(logits))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [3, 2])
def test_from_the_vertices_distance_on_every_result_is_one_hot(k, dtype):
    logits = torch.cat([random_logits(k, 300, seed=7).to(dtype), torch.ones(1, k, dtype=dtype)])
    top = torch.nn.functional.one_hot(logits.argmax(-1), k).to(dtype)  # argmax: the first of equal ones
    for r in (VERTEX[k], VERTEX[k] + 1e-6, 0.9, 1.0):
        assert sparsestmax(logits, torch.tensor(r, dtype=dtype)).equal(top), r
    below = sparsestmax(logits, torch.tensor(VERTEX[k] - 1e-2, dtype=dtype))
    assert (below.amax(-1) < 1).sum() > 100  # not before: the threshold is the vertices' distance


def test_three_choices_leave_the_circle_for_an_edge_at_distance_r():
    # z = (0.4, 0.3, 0.1): sparsemax (0.4667, 0.3667, 0.1667) at 0.2625 from the centre; at r = 0.5 the
    # circle's point has a negative entry, so the result is on the IN-LN edge at distance 0.5
    result = ssn(0.5, 0.4, 0.3, 0.1)
    s = math.sqrt(2 * 0.25 - 1 / 3)
    assert result == pytest.approx([(1 + s) / 2, (1 - s) / 2, 0.0], abs=1e-12)
    assert math.dist(result, [1 / 3] * 3) == pytest.approx(0.5, abs=1e-12)
    # at r = 0.3 the circle's point stays in the simplex: (w - u) rescaled to length 0.3
    w = reference_sparsemax([0.4, 0.3, 0.1])
    scale = 0.3 / math.dist(w, [1 / 3] * 3)
    assert ssn(0.3, 0.4, 0.3, 0.1) == pytest.approx([1 / 3 + scale * (v - 1 / 3) for v in w], abs=1e-12)


def test_equal_logits_move_towards_in_and_ties_at_the_edge_go_to_the_earlier_branch():
    assert ssn(0.0, 2.0, 2.0, 2.0) == [1 / 3, 1 / 3, 1 / 3]  # exactly the centre
    r = 0.3
    towards_in = [1 / 3 + r * (float(i == 0) - 1 / 3) / math.sqrt(2 / 3) for i in range(3)]
    assert ssn(r, 2.0, 2.0, 2.0) == pytest.approx(towards_in, abs=1e-12)
    towards_in = [1 / 3 + 0.6 * (float(i == 0) - 1 / 3) / math.sqrt(2 / 3) for i in range(3)]
    assert ssn(0.6, 2.0, 2.0, 2.0) == pytest.approx(towards_in, abs=1e-12)  # towards a vertex: inside until it
    assert ssn(VERTEX[3], 2.0, 2.0, 2.0) == [1.0, 0.0, 0.0]
    # LN and BN tied for the largest: the edge point's larger end goes to LN, the earlier of the two (two
    # entries tied for the smallest put the circle's point on the line to the vertex, which it leaves only there)
    s = math.sqrt(2 * 0.6**2 - 1 / 3)
    assert ssn(0.6, 0.0, 1.0, 1.0) == pytest.approx([0.0, (1 + s) / 2, (1 - s) / 2], abs=1e-12)
    assert ssn(0.6, 1.0, 0.0, 1.0) == pytest.approx([(1 + s) / 2, 0.0, (1 - s) / 2], abs=1e-12)


def test_two_choices_have_the_centre_one_half():
    assert ssn(0.0, 0.7, 0.7) == [0.5, 0.5]
    assert ssn(0.0, 0.3, 0.1) == pytest.approx([0.6, 0.4], abs=1e-12)
    # 0.1 from the centre: pushed out to r = 0.4, i.e. 0.4 / sqrt(2) along each axis
    assert ssn(0.4, 0.3, 0.1) == pytest.approx([0.5 + 0.4 / math.sqrt(2), 0.5 - 0.4 / math.sqrt(2)], abs=1e-12)
    assert ssn(0.4, 0.1, 0.3) == pytest.approx([0.5 - 0.4 / math.sqrt(2), 0.5 + 0.4 / math.sqrt(2)], abs=1e-12)
    assert ssn(0.4, 0.7, 0.7) == pytest.approx([0.5 + 0.4 / math.sqrt(2), 0.5 - 0.4 / math.sqrt(2)], abs=1e-12)


@pytest.mark.parametrize("k", [3, 2])
@pytest.mark.parametrize("r", [0.0, 0.2, 0.35, 0.5, 0.65])
def test_gradcheck(k, r):
    radius = torch.tensor(r, dtype=torch.float64)
    for row in random_logits(k, 12, seed=11):
        assert torch.autograd.gradcheck(lambda z: sparsestmax(z, radius), (row.clone().requires_grad_(),))


def test_gradients_are_finite_at_ties_and_zero_where_the_result_does_not_move():
    for logits, r in [([1.0, 1.0, 1.0], 0.3), ([1.0, 1.0, 1.0], 0.0), ([0.4, 0.3, 0.1], 0.5), ([1.0, 1.0], 0.2)]:
        z = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
        y = sparsestmax(z, torch.tensor(r, dtype=torch.float64))
        (grad,) = torch.autograd.grad(y, z, torch.arange(1.0, len(logits) + 1, dtype=torch.float64))
        assert torch.isfinite(grad).all()
        if r > 0:  # the centre's fixed direction, and the edge point, depend on the radius alone
            assert grad.abs().max() == 0, (logits, r)
        else:  # at r = 0 the sparsemax's gradient: g minus its mean over the support
            assert grad.tolist() == pytest.approx([-1.0, 0.0, 1.0])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="SparsestMax takes 2 or 3 logits"):
        sparsestmax(torch.zeros(4), torch.tensor(0.0))
    layer = SparseSwitchableNorm2d(4)
    with pytest.raises(ValueError, match="SparseSwitchableNorm2d: radius=-0.5 is invalid: it must be a number >= 0"):
        layer.set_radius(-0.5)


# the layer ---------------------------------------------------------------------------------------------


def layer_with(logits, radius=0.0, use_bn=True, dtype=torch.float64, channels=5, seed=0):
    layer = SparseSwitchableNorm2d(channels, use_bn=use_bn).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(channels, generator=generator, dtype=dtype) + 0.5)
        layer.bias.copy_(torch.randn(channels, generator=generator, dtype=dtype))
        layer.mean_weight.copy_(torch.tensor(logits[0], dtype=dtype))
        layer.var_weight.copy_(torch.tensor(logits[1], dtype=dtype))
    layer.set_radius(radius, iteration=7)
    return layer


def features(shape=(3, 5, 4, 6), dtype=torch.float64, seed=1):
    generator = torch.Generator().manual_seed(seed)
    offset = torch.randn(shape[1], 1, 1, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator, dtype=dtype) * 2 + offset


def naive_layer(layer, x):
    """The SN equation with the weights of the definition, each statistic from its own pixels (training)."""
    k = len(layer.mean_weight)
    a = reference_sparsestmax(layer.mean_weight.tolist(), layer.radius.item())
    b = reference_sparsestmax(layer.var_weight.tolist(), layer.radius.item())
    dims = [(2, 3), (1, 2, 3), (0, 2, 3)][:k]
    means = [x.mean(d, keepdim=True) for d in dims]
    variances = [x.var(d, keepdim=True, unbiased=False) for d in dims]
    mean = sum(w * m for w, m in zip(a, means))
    var = sum(w * v for w, v in zip(b, variances))
    return (x - mean) / torch.sqrt(var + layer.eps) * layer.weight[:, None, None] + layer.bias[:, None, None]


LOGITS = [
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),
    ([0.9, 1.3, 0.8], [1.2, 0.7, 1.1]),
    ([0.4, 0.3, 0.1], [0.1, 0.5, 0.45]),
]


@pytest.mark.parametrize("use_bn", [True, False])
@pytest.mark.parametrize("radius", [0.0, 0.3, 0.55])
@pytest.mark.parametrize("logits", LOGITS)
def test_training_matches_the_equation(logits, radius, use_bn):
    k = 3 if use_bn else 2
    layer = layer_with([row[:k] for row in logits], radius, use_bn)
    x = features()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), naive_layer(layer, x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("use_bn", [True, False])
@pytest.mark.parametrize("radius", [0.0, 0.3, 0.55])
def test_layer_gradcheck(radius, use_bn):
    k = 3 if use_bn else 2
    layer = layer_with([[0.9, 1.3, 0.8][:k], [1.2, 0.7, 1.1][:k]], radius, use_bn, channels=3)
    names = [name for name, _ in layer.named_parameters()]

    def output(x, *parameters):
        return functional_call(layer, dict(zip(names, parameters)), (x,))

    x = features((2, 3, 3, 2)).requires_grad_()
    parameters = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    assert torch.autograd.gradcheck(output, (x, *parameters))


def run(layer, x, grad_y, forward=None):
    x = x.detach().clone().requires_grad_()
    y = layer(x) if forward is None else forward(layer, x)
    y.backward(grad_y)
    grads = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return y.detach(), grads, {name: b.clone() for name, b in layer.named_buffers()}


def reference_path(layer, x):
    affine = functools.partial(layer.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])
    return reference_normalize_by_moments(x, affine)


def assert_same(got, expected, tolerance):
    torch.testing.assert_close(got[0], expected[0], rtol=tolerance, atol=tolerance)
    for key, want in expected[1].items():
        have = got[1][key]
        have = torch.zeros_like(want) if have is None and want is not None else have  # unused: no gradient
        want = torch.zeros_like(have) if want is None else want
        torch.testing.assert_close(have, want, rtol=tolerance, atol=tolerance, msg=key)
    for key, want in expected[2].items():
        torch.testing.assert_close(got[2][key], want, rtol=tolerance, atol=tolerance, msg=key)


STATES = {
    "free-sparsemax": (LOGITS[1], 0.0, (-1, -1)),
    "free-circle": (LOGITS[2], 0.3, (-1, -1)),
    "free-edge": (LOGITS[2], 0.6, (-1, -1)),
    "mean-fixed": (LOGITS[1], 0.3, (2, -1)),
    "both-fixed": (LOGITS[1], 0.3, (1, 2)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("state", STATES)
def test_the_closed_forms_give_the_reference_paths_values(state, training, dtype):
    logits, radius, fixed = STATES[state]
    layer = layer_with(logits, radius, dtype=dtype).train(training)
    layer.mean_fixed.fill_(fixed[0])
    layer.var_fixed.fill_(fixed[1])
    layer.running_mean.uniform_(-1, 1)
    layer.running_var.uniform_(0.5, 2)
    x = features(dtype=dtype)
    grad_y = features(dtype=dtype, seed=9)
    closed = run(copy.deepcopy(layer), x, grad_y)
    plan = layer.call_plan(x)
    # both fixed: the torch path; evaluation off the kernel path: normalize_by_moments (``moment_normalizer``)
    assert isinstance(plan, SwitchableClosedForms) == (training and state != "both-fixed")
    assert_same(closed, run(copy.deepcopy(layer), x, grad_y, reference_path), 1e-10 if dtype == torch.float64 else 2e-5)
    if fixed[0] >= 0 or state == "free-edge":  # fixed, or on the edge point, which depends on the radius alone
        assert not closed[1]["mean_weight"].any()
    else:
        assert closed[1]["mean_weight"].abs().max() > 1e-6


@pytest.mark.parametrize(
    "branch, reference",
    [
        (0, lambda x, w, b: F.instance_norm(x, weight=w, bias=b)),
        (1, lambda x, w, b: F.group_norm(x, 1, w, b)),
        (2, lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)),
    ],
    ids=["IN", "LN", "BN"],
)
def test_a_fixed_layer_computes_only_its_normalizer(branch, reference, monkeypatch):
    layer = layer_with(LOGITS[1], 0.2)
    layer.mean_fixed.fill_(branch)
    layer.var_fixed.fill_(branch)
    assert layer.used_branches() == [k == branch for k in range(3)]
    calls = []
    from sn_detection.layers import switchable

    original = switchable.layer_moments
    monkeypatch.setattr(switchable, "layer_moments", lambda *a: calls.append(1) or original(*a))
    x = features()
    running = layer.running_mean.clone()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(x, layer.weight, layer.bias), rtol=0, atol=1e-10)
    assert bool(calls) == (branch == 1)  # LN's statistics only for an LN layer
    assert layer.running_mean.equal(running) == (branch != 2)  # BN's running statistics only for a BN layer


def test_one_hot_weights_are_fixed_with_their_iteration_and_get_no_gradient():
    # mean logits whose sparsemax is one-hot already; variance logits one-hot from r = 0.6 (the edge's clip)
    layer = layer_with([[3.0, 0.2, 0.1], [0.4, 0.3, 0.1]], radius=0.3).train()
    layer.set_radius(0.3, iteration=40)
    x, grad_y = features(), features(seed=2)
    layer(x).backward(grad_y)
    assert (layer.mean_fixed.item(), layer.mean_fixed_at.item()) == (0, 40)
    assert (layer.var_fixed.item(), layer.var_fixed_at.item()) == (-1, -1)
    assert not layer.mean_weight.grad.any() and layer.var_weight.grad.abs().max() > 0
    layer.set_radius(0.9, iteration=41)
    layer.zero_grad()
    layer(x).backward(grad_y)
    assert (layer.var_fixed.item(), layer.var_fixed_at.item()) == (0, 41)
    assert not layer.var_weight.grad.any()
    # fixed for good: logits that move, or a smaller radius, leave the choice
    with torch.no_grad():
        layer.mean_weight.copy_(torch.tensor([0.0, 5.0, 0.0]))
    layer.set_radius(0.0, iteration=42)
    mean_weights, var_weights = layer.branch_weights(torch.float64)
    assert mean_weights.tolist() == var_weights.tolist() == [1.0, 0.0, 0.0]
    assert layer.mean_fixed_at.item() == 40


def test_evaluation_frozen_layers_and_replays_fix_nothing():
    layer = layer_with([[3.0, 0.2, 0.1], [3.0, 0.2, 0.1]], radius=0.3)
    layer.eval()(features())
    copy.deepcopy(layer).freeze()(features())
    with replaying():
        layer.train()(features())
    assert layer.mean_fixed.item() == layer.var_fixed.item() == -1
    layer(features())
    assert layer.mean_fixed.item() == layer.var_fixed.item() == 0


def test_the_state_dict_keeps_the_radius_and_the_fixed_choices():
    layer = layer_with([[3.0, 0.2, 0.1], [0.4, 0.3, 0.1]], radius=0.3).train()
    layer.set_radius(0.45, iteration=12)
    layer(features())
    saved = copy.deepcopy(layer.state_dict())
    assert saved["radius"].item() == pytest.approx(0.45)
    assert (saved["mean_fixed"].item(), saved["mean_fixed_at"].item(), saved["var_fixed"].item()) == (0, 12, -1)
    assert saved["iteration"].item() == 12
    resumed = SparseSwitchableNorm2d(5).double()
    x = features(seed=4)
    resumed.eval()(x)  # a plan made before loading is not kept
    resumed.load_state_dict(saved)
    assert resumed.chosen_branches() is None and resumed.mean_fixed.item() == 0
    torch.testing.assert_close(resumed.eval()(x), layer.eval()(x), rtol=0, atol=0)


def test_the_schedule_sets_every_layer():
    model = torch.nn.Sequential(build_norm("SSN", 4), build_norm("SN", 4), build_norm("SyncSSN", 4, use_bn=False))
    assert set_radius(model, linear_radius(250, 1000), iteration=250) == 2
    assert [m.radius.item() for m in (model[0], model[2])] == [0.25, 0.25]
    assert [m.iteration.item() for m in (model[0], model[2])] == [250, 250]
    assert linear_radius(0, 1000) == 0.0 and linear_radius(1000, 1000) == 1.0 and linear_radius(999, 1000) == 0.999
    assert linear_radius(5, 10, start=0.2, end=0.8) == pytest.approx(0.5)
    assert isinstance(model[2], SyncSparseSwitchableNorm2d) and model[2].mean_weight.shape == (2,)


def test_a_fixed_layer_traces_without_reading_its_choices():
    # a trace must not bake in a host read of the fixed branches: it computes the mixture with one-hot weights
    layer = layer_with(LOGITS[1], 0.3, dtype=torch.float32).eval()
    layer.mean_fixed.fill_(2)
    layer.var_fixed.fill_(0)
    x = features(dtype=torch.float32)
    with warnings.catch_warnings(), torch.no_grad():  # inference, as detectron2's export traces
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the input checks' shapes
        traced = torch.jit.trace(layer, (x,), check_trace=False)
        torch.testing.assert_close(traced(x), layer(x))
        layer.mean_fixed.fill_(1)  # the traced graph reads the buffers, as the eager layer does
        torch.testing.assert_close(traced(x), layer(x))


def test_an_empty_batch_fixes_one_hot_weights_as_any_training_forward():
    """The choice depends on the logits and the radius, not on the data: SyncSSN's processes agree even when
    one of them has no image."""
    layer = layer_with([[3.0, 0.2, 0.1], [0.4, 0.3, 0.1]], radius=0.3).train()
    running = layer.running_mean.clone()
    assert layer(features((0, 5, 4, 6))).shape == (0, 5, 4, 6)
    assert (layer.mean_fixed.item(), layer.mean_fixed_at.item(), layer.var_fixed.item()) == (0, 7, -1)
    assert layer.running_mean.equal(running) and layer.num_batches_tracked.item() == 0
