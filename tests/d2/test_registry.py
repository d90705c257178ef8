"""Our norm names in detectron2's norm config keys: stock builders build our layers with the options of
cfg.MODEL.SN and train; detectron2's own names build what they built before; unknown names say what is
valid."""

import importlib
import math

import detectron2.modeling
import pytest
import torch
from detectron2.layers import FrozenBatchNorm2d
from torch import nn
from tiny_rcnn import C4_PARTS, FPN_PARTS, is_frozen_stage, norms_under, snapshot, tiny_cfg, train_step

import sn_detection
from sn_detection.d2 import build_model, current_norm_options, norm_options_applied, registry, set_norm_options
from sn_detection.d2.registry import ORIGINAL_GET_NORM, get_norm, install_get_norm, valid_norm_names
from sn_detection.layers import NORM_NAMES, GroupNorm2d, SwitchableNorm2d, build_norm

# Every stock detectron2 module that resolves norm strings.
BUILDER_MODULES = [
    "detectron2.layers",
    "detectron2.layers.batch_norm",
    "detectron2.layers.blocks",
    "detectron2.modeling.backbone.resnet",
    "detectron2.modeling.backbone.fpn",
    "detectron2.modeling.backbone.regnet",
    "detectron2.modeling.roi_heads.box_head",
    "detectron2.modeling.roi_heads.mask_head",
    "detectron2.modeling.meta_arch.retinanet",
    "detectron2.modeling.meta_arch.semantic_seg",
]


def holds_our_get_norm(module_name):
    return importlib.import_module(module_name).get_norm is get_norm


def test_importing_the_package_installs_get_norm_in_every_builder():
    assert all(holds_our_get_norm(name) for name in BUILDER_MODULES)


def test_installing_again_is_harmless_and_keeps_the_original_reachable():
    install_get_norm()
    install_get_norm()
    assert all(holds_our_get_norm(name) for name in BUILDER_MODULES)
    assert ORIGINAL_GET_NORM is get_norm.__wrapped__
    assert ORIGINAL_GET_NORM.__module__ == "detectron2.layers.batch_norm"
    assert type(ORIGINAL_GET_NORM("BN", 8)) is nn.BatchNorm2d


def test_a_reloaded_registry_replaces_the_earlier_wrapper_and_keeps_the_original():
    earlier = registry.get_norm
    reloaded = importlib.reload(registry)
    try:
        reloaded.install_get_norm()
        assert reloaded.get_norm is not earlier
        assert reloaded.ORIGINAL_GET_NORM is ORIGINAL_GET_NORM
        assert all(importlib.import_module(name).get_norm is reloaded.get_norm for name in BUILDER_MODULES)
    finally:
        registry.get_norm = earlier
        registry.install_get_norm()
    assert all(holds_our_get_norm(name) for name in BUILDER_MODULES)


def test_reimporting_the_package_keeps_the_installation():
    importlib.reload(sn_detection)
    assert all(holds_our_get_norm(name) for name in BUILDER_MODULES)


@pytest.mark.parametrize("norm", ["BN", "SyncBN", "FrozenBN", "LN", "nnSyncBN", "naiveSyncBN", "naiveSyncBN_N"])
def test_detectron2_names_build_what_they_built_before(norm):
    ours, theirs = get_norm(norm, 16), ORIGINAL_GET_NORM(norm, 16)
    assert type(ours) is type(theirs)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert getattr(ours, "eps", None) == getattr(theirs, "eps", None)


@pytest.mark.parametrize("norm", ["", None])
def test_no_norm_stays_no_norm(norm):
    assert get_norm(norm, 16) is None


def test_callables_are_called_as_before():
    layer = get_norm(lambda channels: nn.BatchNorm2d(channels, eps=0.5), 16)
    assert type(layer) is nn.BatchNorm2d and layer.eps == 0.5


def test_gn_is_detectron2s_group_norm_by_default():
    ours, theirs = get_norm("GN", 64), ORIGINAL_GET_NORM("GN", 64)
    assert isinstance(ours, GroupNorm2d) and isinstance(ours, nn.GroupNorm)
    assert (ours.num_groups, ours.num_channels, ours.eps) == (theirs.num_groups, theirs.num_channels, theirs.eps)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(2, 64, 5, 5)
    torch.testing.assert_close(ours(x), theirs(x))


def test_detectron2_names_build_their_modules_in_a_model():
    cfg = tiny_cfg("", "fpn", "MODEL.RESNETS.NORM", "FrozenBN", "MODEL.FPN.NORM", "LN",
                   "MODEL.ROI_BOX_HEAD.NORM", "BN", "MODEL.ROI_MASK_HEAD.NORM", "SyncBN")
    model = build_model(cfg)
    for key, prefix in FPN_PARTS.items():
        norms = norms_under(model, prefix)
        expected = type(ORIGINAL_GET_NORM(cfg.MODEL[key.split(".")[1]].NORM, 16))
        assert norms and all(type(m) is expected for m in norms.values()), key
    assert isinstance(model.backbone.bottom_up.stem.conv1.norm, FrozenBatchNorm2d)


@pytest.mark.parametrize("arch", ["fpn", "c4"])
@pytest.mark.parametrize("norm", NORM_NAMES)
def test_each_name_builds_our_layers_in_every_key_and_trains(norm, arch):
    torch.manual_seed(0)
    cfg = tiny_cfg(norm, arch)
    model = build_model(cfg)
    expected = type(build_norm(norm, 32))
    for key, prefix in (FPN_PARTS if arch == "fpn" else C4_PARTS).items():
        norms = norms_under(model, prefix)
        assert norms and all(type(m) is expected for m in norms.values()), key
    all_norms = norms_under(model, "")
    before = snapshot(model)

    loss = train_step(cfg, model)

    assert math.isfinite(loss)
    after = model.state_dict()
    trained = [name for name in all_norms if not is_frozen_stage(name)]
    frozen = [name for name in all_norms if is_frozen_stage(name)]
    assert trained and frozen
    for name in trained:  # the bias starts at 0, where any update shows (gamma's may round away)
        assert not torch.equal(before[f"{name}.bias"], after[f"{name}.bias"]), name
    for name in frozen:
        for key in all_norms[name].state_dict():
            assert torch.equal(before[f"{name}.{key}"], after[f"{name}.{key}"]), f"{name}.{key}"


def test_unknown_names_fail_with_every_valid_name():
    with pytest.raises(ValueError) as error:
        get_norm("SwitchNorm", 16)
    for name in (*NORM_NAMES, "BN", "FrozenBN", "SyncBN", "LN", "GN"):
        assert repr(name) in str(error.value)
    assert set(valid_norm_names()) >= set(NORM_NAMES) | {"BN", "FrozenBN", "SyncBN", "LN"}


@pytest.mark.parametrize("key", FPN_PARTS)
def test_an_unknown_name_in_any_key_fails_when_the_model_is_built(key):
    cfg = tiny_cfg("GN", "fpn", key, "SwitchNorm")
    with pytest.raises(ValueError, match=r"unknown norm 'SwitchNorm'; valid names are \['SN', 'SyncSN'"):
        build_model(cfg)


def test_options_from_the_config_reach_the_layers():
    cfg = tiny_cfg("GN", "fpn", "MODEL.SN.GN_GROUPS", 4, "MODEL.SN.EPS", 1e-3,
                   "MODEL.ROI_BOX_HEAD.NORM", "SN", "MODEL.SN.USE_BN", False, "MODEL.SN.MOMENTUM", 0.2,
                   "MODEL.ROI_MASK_HEAD.NORM", "MN", "MODEL.SN.NUM_MODES", 3)
    model = build_model(cfg)
    groups = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert groups and all(m.num_groups == 4 and m.eps == 1e-3 for m in groups)
    switchable = list(norms_under(model, FPN_PARTS["MODEL.ROI_BOX_HEAD.NORM"]).values())
    assert all(isinstance(m, SwitchableNorm2d) for m in switchable)
    assert all(m.mean_weight.numel() == 2 and m.var_weight.numel() == 2 and m.momentum == 0.2 for m in switchable)
    modes = norms_under(model, FPN_PARTS["MODEL.ROI_MASK_HEAD.NORM"]).values()
    assert all(m.num_modes == 3 and m.gate.out_features == 3 for m in modes)
    assert current_norm_options() == {}


@pytest.mark.parametrize(
    "norm, key, value, channels",
    [("DN", "MODEL.SN.DN_INIT_GROUPS", 1, 16), ("DN", "MODEL.SN.DN_INIT_BATCH_POOL", True, 16),
     ("BNSR", "MODEL.SN.BNSR_P", 1.5, 16), ("MGN", "MODEL.SN.NUM_MODES", 4, 16)],
)
def test_each_option_reaches_its_layer(norm, key, value, channels):
    cfg = tiny_cfg(norm, "c4", key, value)
    model = build_model(cfg)
    stem = model.backbone.stem.conv1.norm
    expected = {"MODEL.SN.DN_INIT_GROUPS": lambda m: m.selected_grouping().num_groups == 1,
                "MODEL.SN.DN_INIT_BATCH_POOL": lambda m: m.selected_grouping().pools_batch,
                "MODEL.SN.BNSR_P": lambda m: m.p == 1.5,
                "MODEL.SN.NUM_MODES": lambda m: m.num_modes == 4}[key]
    assert expected(stem)


@pytest.mark.parametrize(
    "norm, key, value, message",
    [("GN", "MODEL.SN.GN_GROUPS", 3, "not divisible by num_groups=3"),
     ("DN", "MODEL.SN.DN_INIT_GROUPS", 3, "init_groups=3 cannot be expressed")],
)
def test_group_counts_that_do_not_suit_the_channels_fail_when_the_model_is_built(norm, key, value, message):
    """Values out of range whatever the channels fail earlier, with the config: tests/d2/test_config.py."""
    with pytest.raises(ValueError, match=message) as error:
        build_model(tiny_cfg(norm, "c4", key, value))
    assert f"cannot build norm {norm!r} over 16 channels" in str(error.value)  # the stem
    assert f"{key}={value!r}" in str(error.value)
    assert current_norm_options() == {}


@pytest.mark.parametrize(
    "norm, options, message",
    [("MN", {"num_modes": 0}, "num_modes must be a positive int"),
     ("MGN", {"num_modes": 0}, "num_modes must be a positive int"),
     ("BNSR", {"p": 0.0}, "p must be > 0")],
)
def test_invalid_options_set_by_hand_fail_with_the_norm_and_its_options(norm, options, message):
    with norm_options_applied({norm: options}), pytest.raises(registry.NormBuildError, match=message) as error:
        get_norm(norm, 16)
    assert f"cannot build norm {norm!r} over 16 channels with options {options}" in str(error.value)


def test_detectron2s_build_model_uses_the_options_set_by_the_user():
    cfg = tiny_cfg("GN", "c4", "MODEL.RESNETS.STEM_OUT_CHANNELS", 32, "MODEL.RESNETS.WIDTH_PER_GROUP", 32,
                   "MODEL.RESNETS.RES2_OUT_CHANNELS", 128)
    assert detectron2.modeling.build_model(cfg).backbone.stem.conv1.norm.num_groups == 32
    set_norm_options({"GN": {"num_groups": 4}})
    try:
        assert detectron2.modeling.build_model(cfg).backbone.stem.conv1.norm.num_groups == 4
    finally:
        set_norm_options({})
    with norm_options_applied({"GN": {"num_groups": 2}}):
        assert detectron2.modeling.build_model(cfg).backbone.stem.conv1.norm.num_groups == 2
    assert current_norm_options() == {}


@pytest.mark.parametrize(
    "options, message",
    [({"SwitchNorm": {}}, "options given for unknown norm 'SwitchNorm'"),
     ({"SN": {"num_groups": 4}}, r"norm 'SN' has no option\(s\) \['num_groups'\]")],
)
def test_misnamed_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        set_norm_options(options)
    assert current_norm_options() == {}
