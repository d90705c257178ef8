"""Timing candidates side by side for the benchmark tools: interleaved rounds, so that a load change on a
shared machine hits every candidate alike, and ratios with their spread over the rounds; and the options
and per-norm configs of the tools that time a model per norm."""

import argparse
import statistics
import time

import torch

from ..engine.arguments import output_file, positive_int

WARMUP_ROUNDS = 2


def device_seconds(function, device: torch.device) -> float:
    """Wall seconds of ``function()``, with the device's queued work finished before and after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved_seconds(candidates, inputs, run, warmup_rounds: int = WARMUP_ROUNDS):
    """Seconds per candidate label, where ``run(candidate, input)`` returns the seconds of one run: one round
    per input, every candidate once per round; the first ``warmup_rounds`` rounds are not kept."""
    times = {label: [] for label in candidates}
    for round_index, item in enumerate(inputs):
        for label, candidate in candidates.items():
            seconds = run(candidate, item)
            if round_index >= warmup_rounds:
                times[label].append(seconds)
    return times


def ratio_to(times, reference):
    """Per label: the median seconds, the ratio of medians to ``reference``'s, and the lowest and highest
    ratio within one round over the rounds (the run-to-run spread of the ratio)."""
    reference_median = statistics.median(times[reference])
    summary = {}
    for label, values in times.items():
        per_round = [value / base for value, base in zip(values, times[reference])]
        summary[label] = {
            "seconds": statistics.median(values),
            "ratio": statistics.median(values) / reference_median,
            "ratio_range": [min(per_round), max(per_round)],
        }
    return summary


def range_text(ratio_range) -> str:
    """A ratio range as the tables print it: ``low-high``."""
    return "{:.2f}-{:.2f}".format(*ratio_range)


def norm_benchmark_parser(description: str, config_file: str, norms: str, reference: str, rounds: int):
    """The options of the tools that time a model per norm: the config, the norms (``reference``: always
    timed, first), the timed rounds, CPU threads, a JSON file for the rows, KEY VALUE config overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config-file", default=config_file)
    parser.add_argument("--norms", default=norms, help=f"comma-separated norm names; {reference} is always included")
    parser.add_argument(
        "--rounds", type=positive_int, default=rounds, help=f"timed rounds (after {WARMUP_ROUNDS} warm-up rounds)"
    )
    parser.add_argument("--threads", type=positive_int, help="CPU threads (default: PyTorch's choice)")
    parser.add_argument("--json", metavar="PATH", type=output_file, help="also write the rows as JSON")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides")
    return parser


def timed_norms(norms: str, reference: str) -> list:
    """The norms of a ``--norms`` value, ``reference`` first, each once."""
    return list(dict.fromkeys([reference, *filter(None, norms.split(","))]))


def norm_setting_cfgs(base_cfg, norms, norm_keys) -> dict:
    """Per norm, a frozen clone of ``base_cfg`` with that norm at every key of ``norm_keys``; every one is
    validated (``validate_sn_config``) first, so that a bad setting fails with the key and its valid values
    before any model is built."""
    return {norm: _setting_cfg(base_cfg, norm, norm_keys) for norm in norms}


def _setting_cfg(base_cfg, norm, norm_keys):
    from ..d2 import validate_sn_config  # here: the launch count times layers where detectron2 is absent

    cfg = base_cfg.clone()
    cfg.defrost()
    cfg.merge_from_list([item for key in norm_keys for item in (key, norm)])
    validate_sn_config(cfg)
    cfg.freeze()
    return cfg
