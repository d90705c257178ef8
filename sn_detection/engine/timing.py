"""Timing candidates side by side for the benchmark tools: interleaved rounds, so that a load change on a
shared machine hits every candidate alike, and ratios with their spread over the rounds."""

import statistics
import time

WARMUP_ROUNDS = 2


def interleaved_seconds(candidates, inputs, run, clock=time.perf_counter):
    """Seconds of ``run(candidate, input)`` per candidate label, one round per input, every candidate once
    per round; the first ``WARMUP_ROUNDS`` rounds are not kept. ``run`` returns its own seconds, or None
    to be timed by ``clock`` here (the caller synchronizes its device inside ``run``)."""
    times = {label: [] for label in candidates}
    for round_index, item in enumerate(inputs):
        for label, candidate in candidates.items():
            start = clock()
            seconds = run(candidate, item)
            seconds = clock() - start if seconds is None else seconds
            if round_index >= WARMUP_ROUNDS:
                times[label].append(seconds)
    return times


def ratio_to(times, reference):
    """Per label: the median seconds, the ratio of medians to ``reference``'s, and the lowest and highest
    ratio within one round over the rounds (the run-to-run spread of the ratio)."""
    summary = {}
    for label, values in times.items():
        per_round = [value / base for value, base in zip(values, times[reference])]
        summary[label] = {
            "seconds": statistics.median(values),
            "ratio": statistics.median(values) / statistics.median(times[reference]),
            "ratio_range": [min(per_round), max(per_round)],
        }
    return summary
