"""build_norm: one table from names to layers, with errors that say what is valid."""

import pytest

from sn_detection.layers import (
    NORM_NAMES,
    DynamicNorm2d,
    GroupNorm2d,
    ModeGroupNorm2d,
    ModeNorm2d,
    PositionalNorm2d,
    SkewnessReducedBatchNorm2d,
    SparseSwitchableNorm2d,
    SwitchableNorm2d,
    SyncSparseSwitchableNorm2d,
    SyncSwitchableNorm2d,
    build_norm,
    norm_options,
)

EXPECTED = {
    "SN": SwitchableNorm2d,
    "SyncSN": SyncSwitchableNorm2d,
    "SSN": SparseSwitchableNorm2d,
    "SyncSSN": SyncSparseSwitchableNorm2d,
    "DN": DynamicNorm2d,
    "GN": GroupNorm2d,
    "MGN": ModeGroupNorm2d,
    "MN": ModeNorm2d,
    "BNSR": SkewnessReducedBatchNorm2d,
    "PONO": PositionalNorm2d,
}


def test_names():
    assert NORM_NAMES == tuple(EXPECTED)


@pytest.mark.parametrize("name", NORM_NAMES)
def test_builds_the_named_layer(name):
    layer = build_norm(name, 32)
    assert type(layer) is EXPECTED[name]
    assert layer.weight.shape == (32,)


def test_options_reach_the_layer():
    assert build_norm("GN", 16, num_groups=4).num_groups == 4
    assert build_norm("SN", 16, use_bn=False).mean_weight.shape == (2,)
    assert build_norm("BNSR", 16, p=1.05, eps=1e-3).p == 1.05


def test_options_are_the_keyword_only_parameters():
    assert norm_options("GN") == ("num_groups", "eps")
    assert norm_options("SN") == ("eps", "momentum", "use_bn")
    assert norm_options("SSN") == norm_options("SyncSSN") == ("eps", "momentum", "use_bn")
    assert norm_options("PONO") == ("eps",)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown norm 'BN'") as error:
        build_norm("BN", 16)
    assert all(repr(name) in str(error.value) for name in NORM_NAMES)


def test_unknown_option_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"'GN' does not accept option\(s\) \['groups'\]") as error:
        build_norm("GN", 16, groups=4)
    assert "['num_groups', 'eps']" in str(error.value)
