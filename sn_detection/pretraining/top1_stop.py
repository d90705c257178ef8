"""A run stopped at a top-1 (PRETRAIN.STOP_TOP1 X) made from the same run without the stop, without training.

A run that stops at X is the run without the stop cut short at its first periodic evaluation whose top-1 is
at least X: the same iterations, then the batch average and the final evaluation. So where the run without
the stop is finished, and kept its model at each evaluation (PRETRAIN.KEEP_EVALUATED_MODELS), the stopped
one is a copy of it (X never reached before its end) or ``stop_at_evaluation`` of the model it kept where it
reached X. ``stop_in_run`` reads from a finished run's folder whether and where that holds;
``from_same_run`` makes the stopped run's outputs from it. The backbone cache (``cache.same_run_stop``)
decides when to use them.
"""

from __future__ import annotations

import json
import math
import os
import shutil

from detectron2.config import CfgNode

from .train import (
    BACKBONE_FILE,
    METRICS_FILE,
    RESULTS_FILE,
    evaluated_model_path,
    stop_at_evaluation,
    trained_iterations,
)


def without_stop(cfg: CfgNode) -> CfgNode:
    """``cfg`` with PRETRAIN.STOP_TOP1 0: the run that ``cfg`` cuts short."""
    source_cfg = cfg.clone()
    source_cfg.defrost()
    source_cfg.PRETRAIN.STOP_TOP1 = 0.0
    return source_cfg


def top1_curve(metrics_path: str, max_iter: int) -> list[tuple[int, float]]:
    """(iterations trained, val top-1) of each evaluation in metrics.json. detectron2 logs a periodic
    evaluation at the index of the iteration it follows (so after index + 1 iterations) and the final one
    at ``max_iter`` (the iterations trained) or its index; a resumed run appends, so an evaluation logged
    twice keeps its latest value, and so does the final one over a periodic one after the same iterations
    (PRETRAIN.STOP_TOP1's stop: the final one is after the batch average)."""
    if not os.path.isfile(metrics_path):
        return []
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by_iteration = {row["iteration"]: row["val_top1"] for row in rows if "val_top1" in row}
    trained = {(it if it >= max_iter else it + 1): top1 for it, top1 in sorted(by_iteration.items())}
    return sorted(trained.items())


def reached_stop(results: dict) -> bool:
    """Whether a backbone pretrained with PRETRAIN.STOP_TOP1 X reached X, by its results file: at a periodic
    evaluation (it stopped there) or at the final one, after its whole schedule."""
    return results.get("stop_top1_reached", False) or results["val_top1"] >= results.get("stop_top1", math.inf)


def stop_in_run(cfg: CfgNode, source: str) -> tuple[str, int | None] | None:
    """Where ``cfg`` has PRETRAIN.STOP_TOP1 X and ``source`` is the finished folder of the same run without the
    stop (``without_stop``), evaluated at each of cfg's PRETRAIN.EVAL_PERIOD before its end: (``source``, the
    iterations after which it first reached X there, or None where it never did before its end, so that
    ``cfg`` trains that same run to the same end). None where that is not known, or where the run reached X
    at an evaluation whose model it did not keep (PRETRAIN.KEEP_EVALUATED_MODELS), or where the run was
    trained by several processes (``stop_at_evaluation`` is one) or on another device than cfg's
    MODEL.DEVICE: then ``cfg`` must be trained."""
    target, period = cfg.PRETRAIN.STOP_TOP1, cfg.PRETRAIN.EVAL_PERIOD
    end = trained_iterations(without_stop(cfg))
    with open(os.path.join(source, RESULTS_FILE)) as f:
        results = json.load(f)
    if results["processes"] != 1:  # its batch average was over each process's share of a batch
        return None
    curve = dict(top1_curve(os.path.join(source, METRICS_FILE), end))
    for done in range(period, end, period):
        if done not in curve:
            return None
        if curve[done] >= target:
            kept = os.path.isfile(evaluated_model_path(source, done))
            made_alike = results.get("device") == cfg.MODEL.DEVICE and "threads" in results
            return (source, done) if kept and made_alike else None
    return source, None


def from_same_run(cfg: CfgNode, source: str, stop: int | None, folder: str) -> None:
    """Make ``cfg``'s cache entry in ``folder`` from ``stop_in_run``'s run in ``source``: a copy where it
    did not stop, else ``stop_at_evaluation`` of its model after ``stop`` iterations, on its threads, with
    its metrics.json rows up to there (the trained stopped run's top-1 curve). results.json says whose run
    it is (``same_run_as``)."""
    with open(os.path.join(source, METRICS_FILE)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(source, RESULTS_FILE)) as f:
        source_results = json.load(f)
    if stop is None:
        shutil.copy2(os.path.join(source, BACKBONE_FILE), os.path.join(folder, BACKBONE_FILE))
        results = dict(source_results, stop_top1=cfg.PRETRAIN.STOP_TOP1, stop_top1_reached=False)
    else:  # the periodic rows up to the stop, then the final evaluation's, where ``pretrain`` logs it
        rows = [row for row in rows if row["iteration"] < stop]
        results = stop_at_evaluation(cfg, evaluated_model_path(source, stop), folder, source_results["threads"])
        rows.append({"iteration": stop, "val_top1": results["val_top1"]})
    results["same_run_as"] = source
    with open(os.path.join(folder, RESULTS_FILE), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(folder, METRICS_FILE), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
