"""SN importance weights and DN groupings read from layers and from bare state dicts: hand-set logits and
gates come back exactly."""

import pytest
import torch
from torch import nn

from sn_detection.analysis import (
    DynamicChoice,
    ModeGates,
    SwitchableChoice,
    choices_from_state_dict,
    learned_choices,
    mode_layers_in_state_dict,
)
from sn_detection.layers import (
    DynamicNorm2d,
    GroupNorm2d,
    ModeGroupNorm2d,
    ModeNorm2d,
    SwitchableNorm2d,
    SyncSwitchableNorm2d,
)


def set_logits(layer, mean_weights, var_weights):
    """Logits whose softmax is exactly the given weights (log of a distribution, up to a constant)."""
    with torch.no_grad():
        layer.mean_weight.copy_(torch.tensor(mean_weights, dtype=torch.float64).log() + 3.0)
        layer.var_weight.copy_(torch.tensor(var_weights, dtype=torch.float64).log() - 1.0)
    return layer


class Parts(nn.Module):
    """Layers of every kind under detectron2-like names."""

    def __init__(self):
        super().__init__()
        # options other than the defaults the state-dict analysis builds with
        self.stem = set_logits(SwitchableNorm2d(8, eps=1e-3), [0.2, 0.3, 0.5], [0.6, 0.3, 0.1])
        self.head = set_logits(SyncSwitchableNorm2d(8, use_bn=False), [0.25, 0.75], [0.9, 0.1])
        self.dn = DynamicNorm2d(16, eps=1e-4, init_groups=4, init_batch_pool=True)
        self.gn = GroupNorm2d(8, num_groups=4)
        self.bn = nn.BatchNorm2d(8)
        self.mn = ModeNorm2d(8, num_modes=3)
        self.mgn = ModeGroupNorm2d(12, num_modes=2)


def test_sn_weights_are_the_softmax_of_the_logits():
    choices = learned_choices(Parts())
    stem, head = choices[:2]
    assert isinstance(stem, SwitchableChoice) and (stem.layer, stem.channels) == ("stem", 8)
    assert stem.mean_weights == pytest.approx({"IN": 0.2, "LN": 0.3, "BN": 0.5}, abs=1e-6)
    assert stem.var_weights == pytest.approx({"IN": 0.6, "LN": 0.3, "BN": 0.1}, abs=1e-6)
    # SyncSN is SN; without the BN branch there is no BN weight at all
    assert head.layer == "head" and set(head.mean_weights) == {"IN", "LN"}
    assert head.mean_weights == pytest.approx({"IN": 0.25, "LN": 0.75}, abs=1e-6)
    assert head.var_weights == pytest.approx({"IN": 0.9, "LN": 0.1}, abs=1e-6)


def test_initial_sn_weights_are_uniform():
    (choice,) = learned_choices(SwitchableNorm2d(4))
    assert choice.mean_weights == choice.var_weights == pytest.approx({"IN": 1 / 3, "LN": 1 / 3, "BN": 1 / 3})


@pytest.mark.parametrize(
    "init_groups, batch, expected",
    [
        (4, True, (4, 4, True, True, "GN")),
        (16, False, (16, 1, True, False, "IN")),
        (1, True, (1, 16, True, True, "LN")),
    ],
)
def test_dn_grouping_of_its_initial_gates(init_groups, batch, expected):
    (choice,) = learned_choices(DynamicNorm2d(16, init_groups=init_groups, init_batch_pool=batch))
    assert choice == DynamicChoice("", 16, *expected[:4])
    assert choice.channel_pooling == expected[4]


def test_dn_with_hand_set_strided_gates():
    layer = DynamicNorm2d(16)
    with torch.no_grad():
        # gates fine to coarse: only bit 1 of the channel index is averaged: pairs (c, c + 2), not blocks
        layer.channel_gates.copy_(torch.tensor([-1.0, 1.0, -1.0, -1.0]))
        layer.batch_gate.fill_(-1.0)
    (choice,) = learned_choices(layer)
    assert (choice.num_groups, choice.group_size, choice.contiguous, choice.pools_batch) == (8, 2, False, False)
    assert choice.channel_pooling == "GN"


def test_a_state_dict_gives_the_same_choices_as_the_model():
    model = Parts()
    with torch.no_grad():
        model.dn.channel_gates.copy_(torch.tensor([1.0, -1.0, 1.0, -1.0]))
    from_model = learned_choices(model)
    assert [c.layer for c in from_model] == ["stem", "head", "dn"]
    assert choices_from_state_dict(model.state_dict()) == from_model


def test_mode_layers_in_a_state_dict():
    expected = [ModeGates("mn", "MN", 8, 3), ModeGates("mgn", "MGN", 12, 2)]
    assert mode_layers_in_state_dict(Parts().state_dict()) == expected


def test_malformed_state_dict_entries_name_the_layer():
    state = {f"a.{k}": v for k, v in SwitchableNorm2d(8).state_dict().items()}
    state["a.mean_weight"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"a\.mean_weight: SN logits must be a vector of 3"):
        choices_from_state_dict(state)
    state["a.mean_weight"] = torch.zeros(3)
    state["a.var_weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="layer 'a' do not fit a SwitchableNorm2d"):
        choices_from_state_dict(state)
    dn = {f"b.{k}": v for k, v in DynamicNorm2d(16).state_dict().items()}
    dn["b.channel_gates"] = torch.zeros(3)
    with pytest.raises(ValueError, match="layer 'b' do not fit a DynamicNorm2d"):
        choices_from_state_dict(dn)
    del dn["b.weight"]
    with pytest.raises(ValueError, match=r"b\.weight is missing"):
        choices_from_state_dict(dn)


def test_a_state_dict_without_learned_norms_has_no_choices():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), GroupNorm2d(8, num_groups=4))
    assert choices_from_state_dict(model.state_dict()) == [] and mode_layers_in_state_dict(model.state_dict()) == []
