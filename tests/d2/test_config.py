"""Bad values of sn_detection's config keys, and unknown names in the norm keys, fail up front with a
ValueError that names the key and what is valid: when the config is read (the engine's ``setup_cfg``,
before anything is written) and when a model is built from it. (Group counts that do not suit a layer's
channels fail when the model is built: tests/d2/test_meta_arch.py.)"""

import argparse
import re

import pytest
from detectron2.modeling import build_model
from tiny_rcnn import FPN_PARTS, tiny_cfg

from sn_detection.d2 import validate_sn_config
from sn_detection.engine import setup_cfg
from sn_detection.layers import NORM_NAMES

# key, bad value, the valid values the message must state
OUT_OF_RANGE = [
    ("MODEL.SN.EPS", 0.0, "a number > 0"),
    ("MODEL.SN.EPS", -1e-5, "a number > 0"),
    ("MODEL.SN.EPS", float("inf"), "a number > 0"),  # yaml's 1e999
    ("MODEL.SN.MOMENTUM", -0.1, "a number in [0, 1]"),
    ("MODEL.SN.MOMENTUM", 1.5, "a number in [0, 1]"),
    ("MODEL.SN.GN_GROUPS", 0, "an int >= 1"),
    ("MODEL.SN.NUM_MODES", 0, "an int >= 1"),
    ("MODEL.SN.BNSR_P", 0.0, "a number > 0"),
    ("MODEL.SN.BNSR_P", -1.01, "a number > 0"),
    ("MODEL.SN.DN_INIT_GROUPS", 0, "an int >= 1"),
    ("SOLVER.GATE_LR_FACTOR", -1.0, "a number >= 0"),
    ("SOLVER.GATE_WEIGHT_DECAY", -1e-4, "a number >= 0"),
    ("SOLVER.GATE_LR_FACTOR", float("inf"), "a number >= 0"),
    ("SOLVER.GATE_LR_FACTOR", float("nan"), "a number >= 0"),
    ("TEST.NORM_ANALYSIS.PERIOD", -1, "an int >= 0"),
]


def message_of(key, value, valid):
    return re.escape(f"{key}={value!r} is invalid: it must be {valid}")


def test_the_defaults_are_valid():
    validate_sn_config(tiny_cfg("SN"))


@pytest.mark.parametrize("key, value, valid", OUT_OF_RANGE, ids=[f"{k}={v}" for k, v, _ in OUT_OF_RANGE])
def test_out_of_range_values_fail_when_the_model_is_built(key, value, valid):
    cfg = tiny_cfg("SN", "fpn", key, value)
    with pytest.raises(ValueError, match=message_of(key, value, valid)):
        validate_sn_config(cfg)
    with pytest.raises(ValueError, match=message_of(key, value, valid)):
        build_model(cfg)


def test_momentum_none_is_the_cumulative_average_from_a_file_and_the_command_line(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("MODEL:\n  SN:\n    MOMENTUM: null\n")
    cfg = tiny_cfg("SN", "fpn")
    cfg.merge_from_file(str(config))
    assert cfg.MODEL.SN.MOMENTUM is None
    cfg.merge_from_list(["MODEL.SN.MOMENTUM", "0.2", "MODEL.SN.MOMENTUM", "None"])
    assert cfg.MODEL.SN.MOMENTUM is None
    validate_sn_config(cfg)
    layers = [module for module in build_model(cfg).modules() if type(module).__name__ == "SwitchableNorm2d"]
    assert layers and all(layer.momentum is None for layer in layers)


def test_values_of_the_wrong_type_are_named():
    cfg = tiny_cfg("SN")
    cfg.MODEL.SN.USE_BN = 1  # yacs checks types on merge only; code can still set anything
    with pytest.raises(ValueError, match=message_of("MODEL.SN.USE_BN", 1, "True or False")):
        validate_sn_config(cfg)
    cfg = tiny_cfg("GN")
    cfg.MODEL.SN.GN_GROUPS = 2.5
    with pytest.raises(ValueError, match=message_of("MODEL.SN.GN_GROUPS", 2.5, "an int >= 1")):
        validate_sn_config(cfg)


def test_batch_average_needs_a_batch_only_when_enabled():
    validate_sn_config(tiny_cfg("SN", "fpn", "TEST.BATCH_AVERAGE.NUM_BATCHES", 0))
    cfg = tiny_cfg("SN", "fpn", "TEST.BATCH_AVERAGE.ENABLED", True, "TEST.BATCH_AVERAGE.NUM_BATCHES", 0)
    with pytest.raises(ValueError, match=message_of("TEST.BATCH_AVERAGE.NUM_BATCHES", 0, "an int >= 1")):
        validate_sn_config(cfg)


@pytest.mark.parametrize("key", FPN_PARTS)
def test_an_unknown_norm_name_is_named_with_its_key_and_the_valid_names(key):
    cfg = tiny_cfg("SN", "fpn", key, "SwitchNorm")
    with pytest.raises(ValueError) as error:
        validate_sn_config(cfg)
    message = str(error.value)
    assert message.startswith(f"{key}: unknown norm 'SwitchNorm'; valid names are")
    for name in (*NORM_NAMES, "BN", "FrozenBN", "GN", "LN"):
        assert repr(name) in message


def test_no_norm_is_a_valid_name():
    validate_sn_config(tiny_cfg("", "fpn"))


def test_the_engine_refuses_a_bad_config_before_writing_anything(tmp_path):
    """setup_cfg would write the config and a log into OUTPUT_DIR (detectron2's default_setup)."""
    config = tmp_path / "config.yaml"
    config.write_text("MODEL:\n  FPN:\n    NORM: SwitchNorm\n")
    output = ["OUTPUT_DIR", str(tmp_path / "output")]
    with pytest.raises(ValueError, match="MODEL.FPN.NORM: unknown norm 'SwitchNorm'"):
        setup_cfg(argparse.Namespace(config_file=str(config), opts=output))
    opts = output + ["MODEL.FPN.NORM", "SN", "MODEL.SN.EPS", "-1.0"]
    with pytest.raises(ValueError, match=message_of("MODEL.SN.EPS", -1.0, "a number > 0")):
        setup_cfg(argparse.Namespace(config_file=str(config), opts=opts))
    assert [path.name for path in tmp_path.iterdir()] == ["config.yaml"]
