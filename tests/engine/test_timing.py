"""The benchmarks' side-by-side timing: every candidate once per round, warm-up rounds dropped, ratios of
medians and their spread over the rounds; the model benchmarks' shared options and norm list."""

import time

import pytest
import torch

from sn_detection.engine.timing import (
    WARMUP_ROUNDS, device_seconds, interleaved_seconds, norm_benchmark_parser, range_text, ratio_to, timed_norms,
)  # fmt: skip


def test_rounds_interleave_candidates_and_drop_the_warm_up():
    calls = []

    def run(label, item):
        calls.append((label, item))
        return {"a": 1.0, "b": 2.0}[label] * (item + 1)

    times = interleaved_seconds({"a": "a", "b": "b"}, range(WARMUP_ROUNDS + 3), run)
    assert calls == [(label, item) for item in range(WARMUP_ROUNDS + 3) for label in "ab"]
    assert times == {"a": [3.0, 4.0, 5.0], "b": [6.0, 8.0, 10.0]}


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
