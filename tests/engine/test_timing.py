"""The benchmarks' side-by-side timing: every candidate once per round, warm-up rounds dropped, ratios of
medians and their spread over the rounds."""

import pytest

from sn_detection.engine.timing import WARMUP_ROUNDS, interleaved_seconds, ratio_to


def test_rounds_interleave_candidates_and_drop_the_warm_up():
    calls = []

    def run(label, item):
        calls.append((label, item))
        return {"a": 1.0, "b": 2.0}[label] * (item + 1)

    times = interleaved_seconds({"a": "a", "b": "b"}, range(WARMUP_ROUNDS + 3), run)
    assert calls == [(label, item) for item in range(WARMUP_ROUNDS + 3) for label in "ab"]
    assert times == {"a": [3.0, 4.0, 5.0], "b": [6.0, 8.0, 10.0]}


def test_runs_that_return_none_are_timed_by_the_clock():
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.75])
    times = interleaved_seconds({"x": None}, range(WARMUP_ROUNDS + 1), lambda *_: None, clock=lambda: next(ticks))
    assert times == {"x": [0.75]}


def test_ratios_are_of_medians_with_the_per_round_range():
    summary = ratio_to({"gn": [1.0, 2.0, 4.0], "sn": [1.5, 2.0, 4.4]}, "gn")
    assert summary["gn"] == {"seconds": 2.0, "ratio": 1.0, "ratio_range": [1.0, 1.0]}
    assert summary["sn"]["seconds"] == 2.0 and summary["sn"]["ratio"] == 1.0
    assert summary["sn"]["ratio_range"] == pytest.approx([1.0, 1.5])
