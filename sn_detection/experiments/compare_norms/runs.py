"""One run of tools/compare_norms.py: its folder and what is read from it.

A run folder is the OUTPUT_DIR of one ``tools/train_net.py`` training plus ``sweep_run.json``, the
sweep's record of what the run is (setting, seed, schedule, the exact train_net arguments) and of each
attempt at it (wall time, exit status). A run is finished when train_net has written its final
evaluation into its results file, whose name the caller passes (``sn_detection.engine.trainer``, the
writer, names it); its learning curve is the ``total_loss`` of detectron2's ``metrics.json``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ...pretraining.top1_stop import reached_stop

RUN_RECORD = "sweep_run.json"
# what detectron2's JSONWriter writes into OUTPUT_DIR
METRICS_FILE = "metrics.json"

# result column -> (COCOEvaluator task, metric)
AP_METRICS = {
    "box_AP": ("bbox", "AP"),
    "box_AP50": ("bbox", "AP50"),
    "box_AP75": ("bbox", "AP75"),
    "mask_AP": ("segm", "AP"),
    "mask_AP50": ("segm", "AP50"),
    "mask_AP75": ("segm", "AP75"),
}


NOT_RECORDED = "not recorded"


@dataclass(frozen=True)
class RunResult:
    """A finished run: what it was, its COCO AP (``AP_METRICS``) and its cost."""

    setting: str
    backbone: str
    head: str
    seed: int
    iterations: int
    batch_average: int  # batches of the batch average before evaluation; 0: none
    metrics: dict[str, float]
    wall_s: float  # all attempts together
    s_per_iter: float  # median of train_net's per-iteration time
    final_loss: float  # the last logged total_loss (detectron2's 20-iteration median)
    folder: str
    backbone_top1: float = math.nan  # val top-1 of the pretrained backbone it started from; NaN: none known
    weights: str | None = None  # the MODEL.WEIGHTS it started from; None: from scratch
    # the iterations its backbone pretrained where it stopped at a top-1 (PRETRAIN.STOP_TOP1); NaN otherwise
    backbone_iterations: float = math.nan
    # 1.0 where that backbone never reached its PRETRAIN.STOP_TOP1 (``reached_stop``), 0.0 where it did, NaN
    # where it had no such stop: a float so that its mean over the seeds is the share short of it
    backbone_short_of_stop: float = math.nan
    # the code of each attempt (``jobs.code_version``; NOT_RECORDED for attempts from before it was recorded)
    code: tuple[str, ...] = ()


def is_finished(folder: str, results_file: str) -> bool:
    """Whether the run in ``folder`` has written its final evaluation, ``results_file``."""
    return os.path.isfile(os.path.join(folder, results_file))


def read_record(folder: str) -> dict | None:
    """The run record of ``folder``, or None if the sweep never started a run there."""
    path = os.path.join(folder, RUN_RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_record(folder: str, record: dict) -> None:
    """Write the record atomically, so an interrupted sweep never leaves half a record."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, RUN_RECORD)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)


def read_metrics(folder: str) -> list[dict]:
    """The rows of metrics.json; [] if there is none."""
    path = os.path.join(folder, METRICS_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def loss_curve(folder: str) -> list[tuple[int, float]]:
    """(iteration, total_loss) in iteration order. A resumed run appends to metrics.json, so an
    iteration logged twice keeps its latest value."""
    by_iteration = {row["iteration"]: row["total_loss"] for row in read_metrics(folder) if "total_loss" in row}
    return sorted(by_iteration.items())


def read_result(folder: str, results_file: str, backbone_results_file: str | None = None) -> RunResult:
    """The result of the finished run in ``folder``, whose final evaluation is ``results_file``; with
    ``backbone_results_file``, the val top-1 of its initial weights (MODEL.WEIGHTS) from that file
    beside them, where pretraining wrote one."""
    record = read_record(folder)
    if record is None or not is_finished(folder, results_file):
        raise ValueError(f"{folder} holds no finished run of the sweep (needs {RUN_RECORD} and {results_file})")
    with open(os.path.join(folder, results_file)) as f:
        per_dataset = json.load(f)
    # the first test dataset is the one evaluated (the config has a single one)
    tasks = next(iter(per_dataset.values()))
    missing = sorted({task for task, _ in AP_METRICS.values()} - set(tasks))
    if missing:
        raise ValueError(f"{folder}/{results_file} has no {missing} results: the comparison needs box and mask AP")
    times = [row["time"] for row in read_metrics(folder) if "time" in row]
    curve = loss_curve(folder)
    weights = initial_weights(record["train_args"])
    backbone = _backbone_results(weights, backbone_results_file)
    return RunResult(
        setting=record["setting"],
        backbone=record["backbone"],
        head=record["head"],
        seed=record["seed"],
        iterations=record["iterations"],
        batch_average=record["batch_average"],
        metrics={column: float(tasks[task][metric]) for column, (task, metric) in AP_METRICS.items()},
        wall_s=sum(attempt["wall_s"] for attempt in record["attempts"]),
        s_per_iter=statistics.median(times) if times else math.nan,
        final_loss=curve[-1][1] if curve else math.nan,
        folder=folder,
        backbone_top1=float(backbone.get("val_top1", math.nan)),
        weights=weights,
        backbone_iterations=float(backbone["iterations"]) if "stop_top1" in backbone else math.nan,
        backbone_short_of_stop=float(not reached_stop(backbone)) if "stop_top1" in backbone else math.nan,
        code=tuple(attempt.get("code", NOT_RECORDED) for attempt in record["attempts"]),
    )


def initial_weights(train_args: Sequence[str]) -> str | None:
    """The MODEL.WEIGHTS a run's train_net arguments give (the last one wins, as in detectron2's merge);
    None where they give none."""
    weights = [train_args[i + 1] for i, arg in enumerate(train_args[:-1]) if arg == "MODEL.WEIGHTS"]
    return weights[-1] if weights else None


def _backbone_results(weights: str | None, backbone_results_file: str | None) -> dict:
    """The results file pretraining left beside a run's initial ``weights`` (its ``val_top1``, and with
    PRETRAIN.STOP_TOP1 its ``iterations``); empty without weights, or where there is no such file."""
    if not backbone_results_file or not weights:
        return {}
    path = os.path.join(os.path.dirname(weights), backbone_results_file)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        results = json.load(f)
    return {key: value for key, value in results.items() if value is not None}
