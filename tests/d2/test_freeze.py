"""Frozen stages: our norms there keep their parameters and running statistics and normalize as at test
time, also in model.train() and on any entry point (freezing is derived from detectron2's
requires_grad=False, not applied by a step after the build); the other norms train."""

import copy

import pytest
import torch
from detectron2.modeling import build_model
from tiny_rcnn import is_frozen_stage, norms_under, snapshot, tiny_cfg, train_step
from torch import nn

from sn_detection.layers import NormBase, SwitchableNorm2d, build_norm

# The layers with batch-dependent statistics, configured so that the batch matters in training.
FREEZABLE = {"SN": {}, "SyncSN": {}, "DN": {"init_batch_pool": True}, "MN": {}, "BNSR": {}}


def trained_layer(name):
    """A layer in training mode whose running statistics have moved away from their initial values."""
    torch.manual_seed(0)
    layer = build_norm(name, 8, **FREEZABLE[name]).train()
    for _ in range(3):
        layer(torch.randn(4, 8, 5, 5) * 3 + 2)
    return layer


@pytest.mark.parametrize("name", FREEZABLE)
def test_a_frozen_layer_normalizes_as_in_evaluation_and_changes_nothing(name):
    layer = trained_layer(name)
    reference = copy.deepcopy(layer)
    keys = layer.state_dict().keys()

    layer.freeze().train()

    assert isinstance(layer, NormBase) and layer.frozen and not layer.training
    assert not any(p.requires_grad for p in layer.parameters())
    assert layer.state_dict().keys() == keys
    x = torch.randn(3, 8, 5, 5)
    before = snapshot(layer)
    out = layer(x)
    torch.testing.assert_close(out, reference.eval()(x), rtol=0, atol=0)
    assert not torch.allclose(out, reference.train()(x))
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


def test_a_norm_is_frozen_exactly_when_none_of_its_parameters_trains():
    model = nn.Sequential(SwitchableNorm2d(4), SwitchableNorm2d(4), SwitchableNorm2d(4), nn.GroupNorm(2, 4))
    model[0].requires_grad_(False)
    model[1].mean_weight.requires_grad_(False)
    model[3].requires_grad_(False)

    model.train()
    assert [m.training for m in model] == [False, True, True, True]
    assert [m.frozen for m in model[:3]] == [True, False, False]
    model[0].requires_grad_(True)  # derived, not stored: unfreezing the parameters unfreezes the layer
    assert not model[0].frozen and model.train()[0].training


@pytest.mark.parametrize("name", FREEZABLE)
def test_a_layer_frozen_after_it_entered_training_mode_leaves_it_at_its_next_forward(name):
    """A model trained without ever calling train(): detectron2 freezes a stage in its constructor, when
    the layers are already in (the default) training mode."""
    layer = trained_layer(name)
    reference = copy.deepcopy(layer).eval()
    layer.requires_grad_(False)
    assert layer.training
    x = torch.randn(3, 8, 5, 5)
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)
    assert not layer.training


def test_frozen_stages_stay_frozen_across_a_training_step():
    torch.manual_seed(0)
    cfg = tiny_cfg("SN", "fpn")
    model = build_model(cfg)
    norms = norms_under(model, "")
    frozen = {name for name in norms if is_frozen_stage(name)}
    assert frozen and {name for name, m in norms.items() if m.frozen} == frozen
    unfrozen_keys = build_model(tiny_cfg("SN", "fpn", "MODEL.BACKBONE.FREEZE_AT", 0)).state_dict().keys()
    assert model.state_dict().keys() == unfrozen_keys

    model.train()
    assert all(m.training == (name not in frozen) for name, m in norms.items())
    stem = model.backbone.bottom_up.stem.conv1.norm
    x = torch.randn(2, stem.num_channels, 8, 8) * 2 + 1
    as_at_test_time = SwitchableNorm2d(stem.num_channels)
    as_at_test_time.load_state_dict(stem.state_dict())
    torch.testing.assert_close(stem(x), as_at_test_time.eval()(x), rtol=0, atol=0)
    assert not torch.allclose(stem(x), as_at_test_time.train()(x))

    before = snapshot(model)
    train_step(cfg, model)
    after = model.state_dict()

    for name in norms:
        for key in norms[name].state_dict():
            unchanged = torch.equal(before[f"{name}.{key}"], after[f"{name}.{key}"])
            if name in frozen:
                assert unchanged, f"{name}.{key}"
            elif key in ("bias", "running_mean", "running_var", "num_batches_tracked"):
                assert not unchanged, f"{name}.{key}"
