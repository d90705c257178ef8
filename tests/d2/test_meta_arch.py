"""SNMetaArch: detectron2's stock builders build our layers, with the options of cfg.MODEL.SN, in every
norm key, and train; detectron2's own names build what they build without SNMetaArch; nothing outside
the config decides a layer's options; unknown names and unsuitable options say what is valid."""

import math

import detectron2.modeling
import pytest
import torch
from detectron2.layers import FrozenBatchNorm2d, get_norm
from detectron2.modeling import META_ARCH_REGISTRY, build_model
from detectron2.modeling.meta_arch import GeneralizedRCNN
from tiny_rcnn import C4_PARTS, FPN_PARTS, is_frozen_stage, norms_under, snapshot, tiny_cfg, train_step
from torch import nn

import sn_detection.d2
from sn_detection.d2 import norm_layer, resolve_norms, validate_sn_config
from sn_detection.layers import (
    IDENTITY_KEY,
    NORM_NAMES,
    GroupNorm2d,
    NormBuildError,
    NormFactory,
    SwitchableNorm2d,
    build_norm,
)


def test_importing_the_package_registers_the_meta_architecture():
    assert META_ARCH_REGISTRY.get("SNMetaArch") is sn_detection.d2.SNMetaArch


def test_the_model_is_detectron2s_own_class():
    assert type(build_model(tiny_cfg("SN"))) is GeneralizedRCNN


@pytest.mark.parametrize("norm", ["BN", "SyncBN", "FrozenBN", "LN", "nnSyncBN", "naiveSyncBN", "naiveSyncBN_N"])
def test_detectron2_names_build_what_they_built_before(norm):
    ours, theirs = norm_layer(tiny_cfg(), norm, 16), get_norm(norm, 16)
    assert type(ours) is type(theirs)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert getattr(ours, "eps", None) == getattr(theirs, "eps", None)


def test_no_norm_stays_no_norm():
    assert norm_layer(tiny_cfg(), "", 16) is None


def test_gn_is_detectron2s_group_norm_by_default():
    ours, theirs = norm_layer(tiny_cfg("", "fpn", "MODEL.SN.GN_GROUPS", 32), "GN", 64), get_norm("GN", 64)
    assert isinstance(ours, GroupNorm2d) and isinstance(ours, nn.GroupNorm)
    assert (ours.num_groups, ours.num_channels, ours.eps) == (theirs.num_groups, theirs.num_channels, theirs.eps)
    assert ours.state_dict().keys() - {IDENTITY_KEY} == theirs.state_dict().keys()  # ours also saves what it is
    x = torch.randn(2, 64, 5, 5)
    torch.testing.assert_close(ours(x), theirs(x))


def test_detectron2_names_build_their_modules_in_a_model():
    cfg = tiny_cfg(
        "",
        "fpn",
        "MODEL.RESNETS.NORM",
        "FrozenBN",
        "MODEL.FPN.NORM",
        "LN",
        "MODEL.ROI_BOX_HEAD.NORM",
        "BN",
        "MODEL.ROI_MASK_HEAD.NORM",
        "SyncBN",
    )
    model = build_model(cfg)
    for key, prefix in FPN_PARTS.items():
        norms = norms_under(model, prefix)
        expected = type(get_norm(cfg.MODEL[key.split(".")[1]].NORM, 16))
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


@pytest.mark.parametrize("key", FPN_PARTS)
def test_an_unknown_name_in_any_key_fails_when_the_model_is_built(key):
    cfg = tiny_cfg("GN", "fpn", key, "SwitchNorm")
    with pytest.raises(ValueError, match=rf"{key}: unknown norm 'SwitchNorm'; valid names are \['SN', 'SyncSN'"):
        build_model(cfg)


def test_options_from_the_config_reach_the_layers():
    cfg = tiny_cfg(
        "GN",
        "fpn",
        "MODEL.SN.GN_GROUPS",
        4,
        "MODEL.SN.EPS",
        1e-3,
        "MODEL.ROI_BOX_HEAD.NORM",
        "SN",
        "MODEL.SN.USE_BN",
        False,
        "MODEL.SN.MOMENTUM",
        0.2,
        "MODEL.ROI_MASK_HEAD.NORM",
        "MN",
        "MODEL.SN.NUM_MODES",
        3,
    )
    model = build_model(cfg)
    groups = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert groups and all(m.num_groups == 4 and m.eps == 1e-3 for m in groups)
    switchable = list(norms_under(model, FPN_PARTS["MODEL.ROI_BOX_HEAD.NORM"]).values())
    assert all(isinstance(m, SwitchableNorm2d) for m in switchable)
    assert all(m.mean_weight.numel() == 2 and m.var_weight.numel() == 2 and m.momentum == 0.2 for m in switchable)
    modes = norms_under(model, FPN_PARTS["MODEL.ROI_MASK_HEAD.NORM"]).values()
    assert all(m.num_modes == 3 and m.gate.out_features == 3 for m in modes)


@pytest.mark.parametrize(
    "norm, key, value",
    [
        ("DN", "MODEL.SN.DN_INIT_GROUPS", 1),
        ("DN", "MODEL.SN.DN_INIT_BATCH_POOL", True),
        ("BNSR", "MODEL.SN.BNSR_P", 1.5),
        ("MGN", "MODEL.SN.NUM_MODES", 4),
    ],
)
def test_each_option_reaches_its_layer(norm, key, value):
    model = build_model(tiny_cfg(norm, "c4", key, value))
    stem = model.backbone.stem.conv1.norm
    expected = {
        "MODEL.SN.DN_INIT_GROUPS": lambda m: m.selected_grouping().num_groups == 1,
        "MODEL.SN.DN_INIT_BATCH_POOL": lambda m: m.selected_grouping().pools_batch,
        "MODEL.SN.BNSR_P": lambda m: m.p == 1.5,
        "MODEL.SN.NUM_MODES": lambda m: m.num_modes == 4,
    }[key]
    assert expected(stem)


def test_two_configs_built_in_turn_each_get_their_own_options():
    """No state outside the config: what one build used cannot leak into the next, in either order."""
    four, eight = tiny_cfg("GN", "c4", "MODEL.SN.GN_GROUPS", 4), tiny_cfg("GN", "c4", "MODEL.SN.GN_GROUPS", 8)
    for cfg, groups in [(four, 4), (eight, 8), (four, 4)]:
        assert build_model(cfg).backbone.stem.conv1.norm.num_groups == groups


def test_the_users_config_is_left_as_it_was():
    cfg = tiny_cfg("SN", "fpn")
    before = cfg.dump()
    build_model(cfg)
    assert cfg.dump() == before


def test_resolve_norms_hands_the_builders_factories_for_our_names_only():
    cfg = tiny_cfg("SN", "fpn", "MODEL.FPN.NORM", "FrozenBN", "MODEL.SN.MOMENTUM", 0.05)
    resolved = resolve_norms(cfg)
    assert resolved.MODEL.META_ARCHITECTURE == "GeneralizedRCNN" and resolved.is_frozen()
    assert resolved.MODEL.RESNETS.NORM == NormFactory("SN", eps=1e-5, momentum=0.05, use_bn=True)
    assert resolved.MODEL.FPN.NORM == "FrozenBN"


def test_a_path_that_does_not_see_the_options_cannot_build_our_layers():
    """detectron2's meta-architecture without SNMetaArch around it: our names are no names of its own, so
    the build fails instead of building our layers with default options; our validation says why."""
    cfg = tiny_cfg("MGN", "fpn", "MODEL.SN.NUM_MODES", 3, "MODEL.META_ARCHITECTURE", "GeneralizedRCNN")
    with pytest.raises(KeyError, match="MGN"):
        detectron2.modeling.build_model(cfg)
    with pytest.raises(ValueError, match=r"MODEL\.\w+\.NORM='MGN' is a norm of sn_detection.*'SNMetaArch'"):
        validate_sn_config(cfg)


@pytest.mark.parametrize("option", [("MODEL.SN.GN_GROUPS", 16), ("MODEL.SN.EPS", 1e-3)], ids=["groups", "eps"])
def test_gn_options_other_than_detectron2s_need_sn_meta_arch(option):
    """detectron2's GN is nn.GroupNorm(32, C) with eps 1e-5: another option would be silently dropped."""
    validate_sn_config(tiny_cfg("GN", "fpn", "MODEL.SN.GN_GROUPS", 32, "MODEL.META_ARCHITECTURE", "GeneralizedRCNN"))
    cfg = tiny_cfg("GN", "fpn", "MODEL.SN.GN_GROUPS", 32, *option, "MODEL.META_ARCHITECTURE", "GeneralizedRCNN")
    with pytest.raises(ValueError, match=r"MODEL\.\w+\.NORM='GN' is a norm of sn_detection"):
        validate_sn_config(cfg)


@pytest.mark.parametrize("inner", ["SNMetaArch", "NoSuchArch"])
def test_the_inner_meta_architecture_must_be_another_registered_one(inner):
    with pytest.raises(ValueError, match=f"MODEL.SN.META_ARCHITECTURE='{inner}' is invalid"):
        build_model(tiny_cfg("SN", "fpn", "MODEL.SN.META_ARCHITECTURE", inner))


@pytest.mark.parametrize(
    "norm, key, value, message",
    [
        ("GN", "MODEL.SN.GN_GROUPS", 3, "not divisible by num_groups=3"),
        ("DN", "MODEL.SN.DN_INIT_GROUPS", 3, "init_groups=3 cannot be expressed"),
    ],
)
def test_group_counts_that_do_not_suit_the_channels_fail_when_the_model_is_built(norm, key, value, message):
    """Values out of range whatever the channels fail earlier, with the config: tests/d2/test_config.py."""
    with pytest.raises(ValueError, match=message) as error:
        build_model(tiny_cfg(norm, "c4", key, value))
    assert f"cannot build norm {norm!r} over 16 channels" in str(error.value)  # the stem
    assert f"{key}={value!r}" in str(error.value)


@pytest.mark.parametrize(
    "norm, options, message",
    [
        ("MN", {"num_modes": 0}, r"ModeNorm2d: num_modes=0 is invalid: it must be an int >= 1"),
        ("MGN", {"num_modes": 0}, r"ModeGroupNorm2d: num_modes=0 is invalid: it must be an int >= 1"),
        ("BNSR", {"p": 0.0}, r"SkewnessReducedBatchNorm2d: p=0.0 is invalid: it must be a number > 0"),
        ("SN", {"num_groups": 4}, r"norm 'SN' does not accept option\(s\) \['num_groups'\]"),
    ],
)
def test_invalid_factory_options_fail_when_the_factory_is_made(norm, options, message):
    with pytest.raises(ValueError, match=message):
        NormFactory(norm, **options)


def test_a_layer_refusing_its_channels_names_the_norm_and_its_options():
    factory = NormFactory("GN", num_groups=3)
    with pytest.raises(
        NormBuildError, match=r"cannot build norm 'GN' over 16 channels with options \{'num_groups': 3\}"
    ):
        factory(16)
