"""The PRETRAIN keys are pretraining's (``add_pretrain_config``, ``validate_pretrain_config``), and every
tool has them: the engine's ``load_cfg`` adds them beside d2's keys and checks them, so that a config file
that sets them (the demo's) merges whatever the tool, and a bad value fails naming the key and what is
valid before anything is written."""

import argparse
import os
import re

import pytest
from detectron2.config import CfgNode, get_cfg

from sn_detection.engine.launch import load_cfg, setup_cfg
from sn_detection.pretraining.config import PRETRAIN_KEY_RULES, add_pretrain_config, validate_pretrain_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_CONFIG = os.path.join(REPO, "configs", "demo_mask_rcnn_sn.yaml")

# key, bad value, the valid values the message must state
OUT_OF_RANGE = [
    ("PRETRAIN.DATA", "", "'embedded' or an ImageFolder directory"),
    ("PRETRAIN.IMAGE_SIZE", 0, "an int >= 1"),
    ("PRETRAIN.CROP_AREA", (0.5, 0.2), "(low, high) with 0 < low <= high <= 1"),
    ("PRETRAIN.CROP_AREA", (0.0, 1.0), "(low, high) with 0 < low <= high <= 1"),
    ("PRETRAIN.CROP_AREA", (0.08, 1.5), "(low, high) with 0 < low <= high <= 1"),
    ("PRETRAIN.IMS_PER_BATCH", 0, "an int >= 1"),
    ("PRETRAIN.MAX_ITER", 0, "an int >= 1"),
    ("PRETRAIN.STOP_ITER", -1, "an int >= 0"),
    ("PRETRAIN.STOP_TOP1", -1.0, "a top-1 in [0, 100] % (0: no stop)"),
    ("PRETRAIN.STOP_TOP1", 101.0, "a top-1 in [0, 100] % (0: no stop)"),
    ("PRETRAIN.BASE_LR", -0.1, "a number >= 0"),
    ("PRETRAIN.WARMUP_ITERS", -1, "an int >= 0"),
    ("PRETRAIN.MOMENTUM", 1.0, "a number in (0, 1) (Nesterov momentum)"),
    ("PRETRAIN.MOMENTUM", 0.0, "a number in (0, 1) (Nesterov momentum)"),
    ("PRETRAIN.WEIGHT_DECAY", -1e-4, "a number >= 0"),
    ("PRETRAIN.GATE_LR_FACTOR", -1.0, "a number >= 0"),
    ("PRETRAIN.LABEL_SMOOTHING", 1.5, "a number in [0, 1]"),
    ("PRETRAIN.BATCH_AVERAGE_BATCHES", -2, "an int >= 0"),
    ("PRETRAIN.NUM_WORKERS", -1, "an int >= 0"),
    ("PRETRAIN.EVAL_PERIOD", -1, "an int >= 0"),
    ("PRETRAIN.CHECKPOINT_PERIOD", 0, "an int >= 1"),
    ("PRETRAIN.OUTPUT_DIR", "", "a folder name"),
]


def message_of(key, value, valid):
    return re.escape(f"{key}={value!r} is invalid: it must be {valid}")


def test_the_defaults_are_valid_and_every_rule_has_its_key():
    cfg = get_cfg()
    add_pretrain_config(cfg)
    validate_pretrain_config(cfg)
    assert set(PRETRAIN_KEY_RULES) <= set(cfg.PRETRAIN)


def test_the_tools_config_has_the_keys_with_their_defaults_and_a_files_values(tmp_path):
    alone = CfgNode()
    add_pretrain_config(alone)
    config = tmp_path / "config.yaml"
    config.write_text("MODEL:\n  DEVICE: cpu\n")
    assert load_cfg(str(config), []).PRETRAIN == alone.PRETRAIN
    demo = load_cfg(DEMO_CONFIG, ["PRETRAIN.MAX_ITER", "10"])
    assert (demo.PRETRAIN.IMAGE_SIZE, demo.PRETRAIN.MAX_ITER) == (64, 10)  # the file's, then the override


@pytest.mark.parametrize("key, value, valid", OUT_OF_RANGE, ids=[f"{k}={v}" for k, v, _ in OUT_OF_RANGE])
def test_out_of_range_values_are_named_with_their_key(key, value, valid):
    cfg = get_cfg()
    add_pretrain_config(cfg)
    cfg.merge_from_list([key, value])
    with pytest.raises(ValueError, match=message_of(key, value, valid)):
        validate_pretrain_config(cfg)


def test_the_engine_refuses_a_bad_value_before_writing_anything(tmp_path):
    """setup_cfg would write the config and a log into OUTPUT_DIR (detectron2's default_setup)."""
    config = tmp_path / "config.yaml"
    config.write_text("PRETRAIN:\n  WARMUP_ITERS: -1\n")
    output = ["OUTPUT_DIR", str(tmp_path / "output"), "MODEL.DEVICE", "cpu"]
    with pytest.raises(ValueError, match=message_of("PRETRAIN.WARMUP_ITERS", -1, "an int >= 0")):
        setup_cfg(argparse.Namespace(config_file=str(config), opts=output))
    assert [path.name for path in tmp_path.iterdir()] == ["config.yaml"]


def test_a_stop_past_the_schedule_is_refused():
    cfg = get_cfg()
    add_pretrain_config(cfg)
    cfg.PRETRAIN.MAX_ITER, cfg.PRETRAIN.STOP_ITER = 100, 101
    with pytest.raises(
        ValueError,
        match=r"PRETRAIN.STOP_ITER=101 is invalid: it must be 0 \(the whole schedule\) or "
        r"at most PRETRAIN.MAX_ITER=100",
    ):
        validate_pretrain_config(cfg)
    cfg.PRETRAIN.STOP_ITER = 100
    validate_pretrain_config(cfg)


def test_a_top1_stop_without_evaluations_is_refused():
    cfg = get_cfg()
    add_pretrain_config(cfg)
    cfg.PRETRAIN.STOP_TOP1, cfg.PRETRAIN.EVAL_PERIOD = 60.0, 0
    with pytest.raises(ValueError, match=r"PRETRAIN.STOP_TOP1=60.0 needs PRETRAIN.EVAL_PERIOD > 0"):
        validate_pretrain_config(cfg)
    cfg.PRETRAIN.EVAL_PERIOD = 100
    validate_pretrain_config(cfg)


def test_a_config_without_the_keys_is_refused_with_the_call_that_adds_them():
    with pytest.raises(
        ValueError, match=r"no PRETRAIN: call sn_detection.pretraining.config.add_pretrain_config\(cfg\)"
    ):
        validate_pretrain_config(get_cfg())
