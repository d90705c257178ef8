"""The one base of every layer (base.NormBase): the state dicts and identities that checkpoints hold, written
out literally so that a checkpoint saved by any version with these expectations keeps loading, and the
constructor checks every layer shares."""

import re

import pytest
import torch
from torch import nn

from sn_detection.layers import (
    IDENTITY_KEY,
    NORM_CLASSES,
    NORM_NAMES,
    NormBase,
    RunningMoments,
    build_norm,
)
from sn_detection.layers.options import POSITIVE

F32, I64 = torch.float32, torch.int64

# (norm, channels, options, identity, state-dict version, [(key, shape, dtype)] in state-dict order, the
# identity after them and before any submodule's tensors)
SAVED = [
    (
        "SN",
        64,
        {},
        "SwitchableNorm2d(eps=1e-05, use_bn=True)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("mean_weight", (3,), F32),
            ("var_weight", (3,), F32),
            ("running_mean", (64,), F32),
            ("running_var", (64,), F32),
            ("num_batches_tracked", (), I64),
        ],
    ),
    (
        "SN",
        64,
        {"use_bn": False, "eps": 0.001},
        "SwitchableNorm2d(eps=0.001, use_bn=False)",
        2,
        [("weight", (64,), F32), ("bias", (64,), F32), ("mean_weight", (2,), F32), ("var_weight", (2,), F32)],
    ),
    (
        "SyncSN",
        64,
        {},
        "SwitchableNorm2d(eps=1e-05, use_bn=True)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("mean_weight", (3,), F32),
            ("var_weight", (3,), F32),
            ("running_mean", (64,), F32),
            ("running_var", (64,), F32),
            ("num_batches_tracked", (), I64),
        ],
    ),
    (
        "SSN",
        64,
        {},
        "SparseSwitchableNorm2d(eps=1e-05, use_bn=True)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("mean_weight", (3,), F32),
            ("var_weight", (3,), F32),
            ("running_mean", (64,), F32),
            ("running_var", (64,), F32),
            ("num_batches_tracked", (), I64),
            ("radius", (), F32),
            ("mean_fixed", (), I64),
            ("var_fixed", (), I64),
            ("mean_fixed_at", (), I64),
            ("var_fixed_at", (), I64),
            ("iteration", (), I64),
        ],
    ),
    (
        "SSN",
        64,
        {"use_bn": False},
        "SparseSwitchableNorm2d(eps=1e-05, use_bn=False)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("mean_weight", (2,), F32),
            ("var_weight", (2,), F32),
            ("radius", (), F32),
            ("mean_fixed", (), I64),
            ("var_fixed", (), I64),
            ("mean_fixed_at", (), I64),
            ("var_fixed_at", (), I64),
            ("iteration", (), I64),
        ],
    ),
    (
        "SyncSSN",
        64,
        {"momentum": None},
        "SparseSwitchableNorm2d(eps=1e-05, use_bn=True)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("mean_weight", (3,), F32),
            ("var_weight", (3,), F32),
            ("running_mean", (64,), F32),
            ("running_var", (64,), F32),
            ("num_batches_tracked", (), I64),
            ("radius", (), F32),
            ("mean_fixed", (), I64),
            ("var_fixed", (), I64),
            ("mean_fixed_at", (), I64),
            ("var_fixed_at", (), I64),
            ("iteration", (), I64),
        ],
    ),
    (
        "DN",
        96,
        {},
        "DynamicNorm2d(eps=1e-05)",
        2,
        [
            ("weight", (96,), F32),
            ("bias", (96,), F32),
            ("channel_gates", (6,), F32),
            ("batch_gate", (), F32),
            ("running_mean", (96,), F32),
            ("running_var", (96,), F32),
            ("num_batches_tracked", (), I64),
        ],
    ),
    (
        "DN",
        64,
        {"init_groups": 64, "init_batch_pool": True, "eps": 0.0001},
        "DynamicNorm2d(eps=0.0001)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("channel_gates", (6,), F32),
            ("batch_gate", (), F32),
            ("running_mean", (64,), F32),
            ("running_var", (64,), F32),
            ("num_batches_tracked", (), I64),
        ],
    ),
    ("GN", 64, {}, "GroupNorm2d(eps=1e-05, num_groups=32)", 1, [("weight", (64,), F32), ("bias", (64,), F32)]),
    (
        "GN",
        96,
        {"num_groups": 3, "eps": 0.001},
        "GroupNorm2d(eps=0.001, num_groups=3)",
        1,
        [("weight", (96,), F32), ("bias", (96,), F32)],
    ),
    (
        "MGN",
        64,
        {},
        "ModeGroupNorm2d(eps=1e-05, num_modes=2)",
        1,
        [("weight", (64,), F32), ("bias", (64,), F32), ("gate.weight", (2, 1), F32), ("gate.bias", (2,), F32)],
    ),
    (
        "MGN",
        64,
        {"num_modes": 3},
        "ModeGroupNorm2d(eps=1e-05, num_modes=3)",
        1,
        [("weight", (64,), F32), ("bias", (64,), F32), ("gate.weight", (3, 1), F32), ("gate.bias", (3,), F32)],
    ),
    (
        "MN",
        64,
        {},
        "ModeNorm2d(eps=1e-05, num_modes=2)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("running_mean", (2, 64), F32),
            ("running_var", (2, 64), F32),
            ("num_batches_tracked", (), I64),
            ("gate.weight", (2, 64), F32),
            ("gate.bias", (2,), F32),
        ],
    ),
    (
        "MN",
        64,
        {"num_modes": 3, "momentum": 0.05},
        "ModeNorm2d(eps=1e-05, num_modes=3)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("running_mean", (3, 64), F32),
            ("running_var", (3, 64), F32),
            ("num_batches_tracked", (), I64),
            ("gate.weight", (3, 64), F32),
            ("gate.bias", (3,), F32),
        ],
    ),
    (
        "BNSR",
        64,
        {},
        "SkewnessReducedBatchNorm2d(eps=1e-05, p=1.01)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("running_mean", (64,), F32),
            ("running_var", (64,), F32),
            ("num_batches_tracked", (), I64),
        ],
    ),
    (
        "BNSR",
        64,
        {"p": 1.05},
        "SkewnessReducedBatchNorm2d(eps=1e-05, p=1.05)",
        2,
        [
            ("weight", (64,), F32),
            ("bias", (64,), F32),
            ("running_mean", (64,), F32),
            ("running_var", (64,), F32),
            ("num_batches_tracked", (), I64),
        ],
    ),
    ("PONO", 64, {}, "PositionalNorm2d(eps=1e-05)", 1, [("weight", (64,), F32), ("bias", (64,), F32)]),
]

# the sum of every initial tensor after torch.manual_seed(0) (the gates of MN and MGN are torch's random
# Linear initialisation; everything else is deterministic)
TRACKED = {"running_mean": 0, "num_batches_tracked": 0}
# SSN's radius and its weights not fixed
FREE = {"radius": 0, "mean_fixed": -1, "var_fixed": -1, "mean_fixed_at": -1, "var_fixed_at": -1, "iteration": -1}
INITIAL_SUMS = [
    {"weight": 64, "bias": 0, "mean_weight": 3, "var_weight": 3, "running_var": 64, **TRACKED},
    {"weight": 64, "bias": 0, "mean_weight": 2, "var_weight": 2},
    {"weight": 64, "bias": 0, "mean_weight": 3, "var_weight": 3, "running_var": 64, **TRACKED},
    {"weight": 64, "bias": 0, "mean_weight": 3, "var_weight": 3, "running_var": 64, **TRACKED, **FREE},
    {"weight": 64, "bias": 0, "mean_weight": 2, "var_weight": 2, **FREE},
    {"weight": 64, "bias": 0, "mean_weight": 3, "var_weight": 3, "running_var": 64, **TRACKED, **FREE},
    {"weight": 96, "bias": 0, "channel_gates": -4, "batch_gate": -1, "running_var": 96, **TRACKED},
    {"weight": 64, "bias": 0, "channel_gates": -6, "batch_gate": 1, "running_var": 64, **TRACKED},
    {"weight": 64, "bias": 0},
    {"weight": 96, "bias": 0},
    {"weight": 64, "bias": 0, "gate.weight": -0.116997, "gate.bias": 0.773076},
    {"weight": 64, "bias": 0, "gate.weight": 0.684332, "gate.bias": -0.234166},
    {"weight": 64, "bias": 0, "running_var": 128, **TRACKED, "gate.weight": -0.720631, "gate.bias": -0.14345},
    {"weight": 64, "bias": 0, "running_var": 192, **TRACKED, "gate.weight": 0.649121, "gate.bias": 0.093935},
    {"weight": 64, "bias": 0, "running_var": 64, **TRACKED},
    {"weight": 64, "bias": 0, "running_var": 64, **TRACKED},
    {"weight": 64, "bias": 0},
]

CASES = [pytest.param(*case, sums, id=f"{case[0]}-{i}") for i, (case, sums) in enumerate(zip(SAVED, INITIAL_SUMS))]


def test_the_expectations_cover_every_norm():
    assert {case[0] for case in SAVED} == set(NORM_NAMES)


def identity_tensor(identity):
    """The identity as every version saves it: UTF-8, zero-padded to 256 bytes, uint8."""
    data = identity.encode().ljust(256, b"\0")
    return torch.tensor(list(data), dtype=torch.uint8)


@pytest.mark.parametrize("name, channels, options, identity, version, entries, sums", CASES)
def test_state_dict_and_identity_are_those_checkpoints_hold(name, channels, options, identity, version, entries, sums):
    torch.manual_seed(0)
    layer = build_norm(name, channels, **options)
    state = layer.state_dict()

    assert layer.norm_identity() == identity
    own = [key for key, _, _ in entries if "." not in key]
    children = [key for key, _, _ in entries if "." in key]
    assert list(state) == [*own, IDENTITY_KEY, *children]
    assert [(key, tuple(value.shape), value.dtype) for key, value in state.items() if key != IDENTITY_KEY] == entries
    assert torch.equal(state[IDENTITY_KEY], identity_tensor(identity))
    assert state._metadata[""]["version"] == version
    for key, expected in sums.items():
        assert float(state[key].double().sum()) == pytest.approx(expected, abs=1e-5), key


@pytest.mark.parametrize("name, channels, options, identity, version, entries, sums", CASES)
def test_a_saved_state_dict_loads(name, channels, options, identity, version, entries, sums):
    """A state dict written as checkpoints hold it (the literal expectations above) loads strictly, every
    value arriving; one of another identity is refused."""
    generator = torch.Generator().manual_seed(1)
    saved = {}
    for key, shape, dtype in entries:
        if dtype == I64:
            saved[key] = torch.randint(0, 5, shape, generator=generator, dtype=dtype)
        else:
            saved[key] = torch.rand(shape, generator=generator, dtype=dtype) + 0.5
    saved[IDENTITY_KEY] = identity_tensor(identity)
    layer = build_norm(name, channels, **options)
    layer.load_state_dict(saved)  # strict
    state = layer.state_dict()
    for key, _, _ in entries:
        assert torch.equal(state[key], saved[key]), key

    saved[IDENTITY_KEY] = identity_tensor(identity.replace("eps=", "eps=7"))
    refused = f"the layer is {re.escape(identity)}, but the state dict was saved by"
    with pytest.raises(RuntimeError, match=refused):
        build_norm(name, channels, **options).load_state_dict(saved)


@pytest.mark.parametrize("cls", NORM_CLASSES, ids=lambda cls: cls.__name__)
def test_every_layer_has_the_base_and_at_most_two_bases(cls):
    assert issubclass(cls, NormBase)
    assert len(cls.__bases__) <= 2


def test_running_statistics_extend_the_base():
    assert issubclass(RunningMoments, NormBase)


@pytest.mark.parametrize("name", NORM_NAMES)
@pytest.mark.parametrize("num_channels", [0, -3, 1.5, True, "8", None])
def test_a_bad_channel_count_is_named(name, num_channels):
    with pytest.raises(ValueError, match=f"num_channels must be a positive int, got {num_channels!r}"):
        build_norm(name, num_channels)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("SN", {"eps": 0}, "SwitchableNorm2d: eps=0 is invalid: it must be a number > 0"),
        ("SyncSN", {"momentum": 1.5}, r"SyncSwitchableNorm2d: momentum=1.5 is invalid: it must be a number in \[0, 1"),
        ("SN", {"use_bn": 1}, "SwitchableNorm2d: use_bn=1 is invalid: it must be True or False"),
        ("SSN", {"momentum": -0.1}, r"SparseSwitchableNorm2d: momentum=-0.1 is invalid: it must be a number in \[0, 1"),
        ("SyncSSN", {"use_bn": None}, "SyncSparseSwitchableNorm2d: use_bn=None is invalid: it must be True or False"),
        ("GN", {"num_groups": 2.0}, "GroupNorm2d: num_groups=2.0 is invalid: it must be an int >= 1"),
        ("GN", {"num_groups": 3}, "GroupNorm2d: num_channels=8 is not divisible by num_groups=3"),
        ("DN", {"init_groups": 3}, r"init_groups=3 cannot be expressed .* valid choices: \[1, 2, 4, 8\]"),
        ("MN", {"num_modes": 0}, "ModeNorm2d: num_modes=0 is invalid: it must be an int >= 1"),
        ("MGN", {"eps": float("nan")}, "ModeGroupNorm2d: eps=nan is invalid: it must be a number > 0"),
        ("BNSR", {"p": -1}, "SkewnessReducedBatchNorm2d: p=-1 is invalid: it must be a number > 0"),
        ("PONO", {"eps": "1e-5"}, "PositionalNorm2d: eps='1e-5' is invalid: it must be a number > 0"),
    ],
)
def test_a_bad_option_is_named_with_its_valid_values(name, options, message):
    with pytest.raises(ValueError, match=message):
        build_norm(name, 8, **options)


def test_the_base_refuses_an_option_without_a_rule():
    class Norm(NormBase):
        option_rules = {"eps": POSITIVE}

        def __init__(self, num_channels, *, eps=1e-5):
            super().__init__(num_channels, eps=eps, momentum=0.1)

    with pytest.raises(ValueError, match=r"Norm: unknown option 'momentum'; the options are \['eps'\]"):
        Norm(4)


def test_a_layer_whose_rules_miss_a_constructor_option_is_refused_when_defined():
    with pytest.raises(TypeError, match=r"Norm: option_rules \['eps'\] do not match .* \['eps', 'momentum'\]"):

        class Norm(NormBase):
            option_rules = {"eps": POSITIVE}

            def __init__(self, num_channels, *, eps=1e-5, momentum=0.1):
                super().__init__(num_channels, eps=eps)


def test_a_minimal_layer_gets_affine_identity_repr_and_freezing_from_the_base():
    class Norm(NormBase):
        option_rules = {"eps": POSITIVE}

        def __init__(self, num_channels, *, eps=1e-5):
            super().__init__(num_channels, eps=eps)
            self.reset_parameters()

    layer = Norm(3, eps=0.5)
    assert torch.equal(layer.weight, torch.ones(3)) and torch.equal(layer.bias, torch.zeros(3))
    assert layer.norm_identity() == "Norm(eps=0.5)"
    assert repr(layer) == "Norm(3, eps=0.5)"
    assert list(layer.state_dict()) == ["weight", "bias", IDENTITY_KEY]
    assert not layer.freeze().train().training and layer.frozen
    assert isinstance(layer, nn.Module)


@pytest.mark.parametrize("name", NORM_NAMES)
def test_every_layer_freezes_and_stays_in_evaluation(name):
    layer = build_norm(name, 32).freeze().train()
    assert layer.frozen and not layer.training
    layer.requires_grad_(True)
    assert not layer.frozen and layer.train().training


@pytest.mark.parametrize("name, channels, options, identity, version, entries, sums", CASES)
def test_the_parameter_tuple_is_the_layers_parameters(name, channels, options, identity, version, entries, sums):
    """What a layer call hands its autograd node; MGN's and MN's gates are a submodule's parameters."""
    layer = build_norm(name, channels, **options)
    assert layer.parameter_tuple() == tuple(layer.parameters()) and layer.parameter_tuple()
    layer.weight = None  # a parameter set to None is no parameter, in either
    assert layer.parameter_tuple() == tuple(layer.parameters())
