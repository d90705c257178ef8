"""The benchmarks' side-by-side timing: every candidate once per round, warm-up rounds dropped, ratios of
medians and their spread over the rounds; the model benchmarks' shared options (counts of at least 1, a
JSON file checked before the work), norm list and per-norm configs (each validated)."""

import os
import time

import pytest
import torch

from sn_detection.benchmarks.timing import (
    WARMUP_ROUNDS,
    device_seconds,
    interleaved_seconds,
    norm_benchmark_parser,
    norm_setting_cfgs,
    range_text,
    ratio_to,
    timed_norms,
)
from sn_detection.engine import load_cfg

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_CONFIG = os.path.join(REPO, "configs", "demo_mask_rcnn_gn.yaml")
NORM_KEYS = ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM")


def test_rounds_interleave_candidates_and_drop_the_warm_up():
    calls = []

    def run(label, item):
        calls.append((label, item))
        return {"a": 1.0, "b": 2.0}[label] * (item + 1)

    times = interleaved_seconds({"a": "a", "b": "b"}, range(WARMUP_ROUNDS + 3), run)
    assert calls == [(label, item) for item in range(WARMUP_ROUNDS + 3) for label in "ab"]
    assert times == {"a": [3.0, 4.0, 5.0], "b": [6.0, 8.0, 10.0]}


def test_rounds_keep_every_round_without_warm_up():
    times = interleaved_seconds({"a": 1.0}, range(3), lambda scale, item: scale * (item + 1), warmup_rounds=0)
    assert times == {"a": [1.0, 2.0, 3.0]}


def test_device_seconds_is_the_wall_time_of_the_call():
    calls = []

    def work():
        time.sleep(0.05)
        calls.append(1)

    seconds = device_seconds(work, torch.device("cpu"))
    assert calls == [1] and 0.05 <= seconds < 5


def test_ratios_are_of_medians_with_the_per_round_range():
    summary = ratio_to({"gn": [1.0, 2.0, 4.0], "sn": [1.5, 2.0, 4.4]}, "gn")
    assert summary["gn"] == {"seconds": 2.0, "ratio": 1.0, "ratio_range": [1.0, 1.0]}
    assert summary["sn"]["seconds"] == 2.0 and summary["sn"]["ratio"] == 1.0
    assert summary["sn"]["ratio_range"] == pytest.approx([1.0, 1.5])
    assert range_text(summary["sn"]["ratio_range"]) == "1.00-1.50"


def test_the_reference_norm_is_timed_first_and_every_norm_once():
    assert timed_norms("SN,GN,,SN", "GN") == ["GN", "SN"]
    assert timed_norms("DN", "BN") == ["BN", "DN"]


def test_benchmark_options_keep_config_overrides_after_the_tools_own():
    parser = norm_benchmark_parser("t", "a.yaml", "GN,SN", "GN", 8)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(["--norms", "DN", "--devices", "2", "PRETRAIN.AMP", "True"])
    assert (args.config_file, args.norms, args.rounds, args.devices) == ("a.yaml", "DN", 8, 2)
    assert args.opts == ["PRETRAIN.AMP", "True"] and args.threads is None and args.json is None


@pytest.mark.parametrize("value, shown", [("0", "0"), ("-3", "-3"), ("2.5", "'2.5'"), ("x", "'x'")])
def test_a_count_below_one_or_not_an_int_is_an_argparse_error_naming_it(value, shown, capsys):
    parser = norm_benchmark_parser("t", "a.yaml", "GN,SN", "GN", 8)
    for option in ("--rounds", "--threads"):
        with pytest.raises(SystemExit):
            parser.parse_args([option, value])
        assert f"argument {option}: {shown} is invalid: it must be an int >= 1" in capsys.readouterr().err


def test_a_count_of_at_least_one_is_kept():
    args = norm_benchmark_parser("t", "a.yaml", "GN", "GN", 8).parse_args(["--rounds", "3", "--threads", "1"])
    assert (args.rounds, args.threads) == (3, 1)


def test_each_norm_setting_has_the_norm_at_every_key_and_the_base_unchanged():
    base = load_cfg(DEMO_CONFIG, [])
    cfgs = norm_setting_cfgs(base, ["GN", "SN", "FrozenBN"], NORM_KEYS)
    assert list(cfgs) == ["GN", "SN", "FrozenBN"]
    for norm, cfg in cfgs.items():
        assert cfg.is_frozen() and (cfg.MODEL.RESNETS.NORM, cfg.MODEL.FPN.NORM) == (norm, norm)
    assert base.MODEL.FPN.NORM == "GN" and cfgs["SN"].MODEL.ROI_BOX_HEAD.NORM == base.MODEL.ROI_BOX_HEAD.NORM


def test_a_norm_setting_the_config_cannot_build_is_refused_with_the_reason():
    base = load_cfg(DEMO_CONFIG, ["MODEL.META_ARCHITECTURE", "GeneralizedRCNN"])
    with pytest.raises(ValueError, match="'SN' is a norm of sn_detection, .* MODEL.META_ARCHITECTURE 'SNMetaArch'"):
        norm_setting_cfgs(base, ["GN", "SN"], NORM_KEYS)
    with pytest.raises(ValueError, match=r"unknown norm 'XN'; valid names are \[.*'SN'"):
        norm_setting_cfgs(base, ["GN", "XN"], NORM_KEYS)


def test_a_json_file_that_cannot_be_written_is_refused_before_the_work(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    parser = norm_benchmark_parser("a tool", "cfg.yaml", "GN", "GN", 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--json", str(tmp_path / "notes.txt" / "rows.json")])
