"""What a pretraining grid has made: each done cell's result, read from the backbone cache (``cell_result``),
each norm's best cell, the other draws of a setting the cache holds, and the equal-top-1 cells planned from the
best (``equal_top1_cells``)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from detectron2.config import CfgNode

from ...pretraining.cache import cached_backbone_folder, cached_backbone_path, is_cached
from ...pretraining.top1_stop import top1_curve
from ...pretraining.train import METRICS_FILE, RESULTS_FILE
from ..backbones import DEFAULT_SEEDS, backbone_configs
from ..jobs import read_job_record, read_json, seconds_per_iteration
from .plan import Cell, cell_folder


def iterations_to_reach(curve: Sequence[tuple[int, float]], target: float) -> int | None:
    """The first evaluated iteration count whose top-1 is at least ``target``; None: not reached."""
    return next((iterations for iterations, top1 in curve if top1 >= target), None)


def evaluated_throughout(curve: Sequence[tuple[int, float]], period: int, iterations: int) -> bool:
    """Whether ``curve`` holds an evaluation after every ``period`` iterations before the end: a cell made
    elsewhere (by ``make demo``, or without PRETRAIN.EVAL_PERIOD) may hold only the final one, and then
    its first iteration at a top-1 is known only to be at most the end."""
    logged = dict(curve)
    return period > 0 and all(done in logged for done in range(period, iterations, period))


def cell_result(output_dir: str, cell: Cell, cfg: CfgNode, target: float | None) -> dict | None:
    """The result of a done cell (its backbone in the cache), else None."""
    if not is_cached(cfg):
        return None
    cache = cached_backbone_folder(cfg)
    results = read_json(os.path.join(cache, RESULTS_FILE))
    folder = cell_folder(output_dir, cell)
    record = read_job_record(folder)
    attempts = record["attempts"] if record else []
    curve = top1_curve(os.path.join(cache, METRICS_FILE), results["iterations"])
    result = {
        "norm": cell.norm,
        "setting": cell.setting,
        "overrides": dict(cell.overrides),
        "val_top1": results["val_top1"],
        "iterations": results["iterations"],
        # the grid's attempts together; a cell made elsewhere: its recorded training time
        "wall_s": round(sum(a["wall_s"] for a in attempts), 1) if attempts else results["train_seconds"],
        "wall_source": "grid" if attempts else "training time in results.json",
        "s_per_iter": seconds_per_iteration(os.path.join(cache, METRICS_FILE)),
        "top1_curve": curve,
        "evaluated_throughout": evaluated_throughout(curve, cfg.PRETRAIN.EVAL_PERIOD, results["iterations"]),
        "backbone": cached_backbone_path(cfg),
    }
    if "stop_top1" in results:  # PRETRAIN.STOP_TOP1 X, and whether a periodic evaluation reached X
        result.update(stop_top1=results["stop_top1"], stop_top1_reached=results["stop_top1_reached"])
    if target is not None:
        result["iterations_to_target"] = iterations_to_reach(curve, target)
    return result


def best_cells(results: Sequence[dict]) -> dict[str, dict]:
    """Per norm, its done cell of the highest val top-1 (the first in grid order on a tie)."""
    best = {}
    for result in results:
        if result["norm"] not in best or result["val_top1"] > best[result["norm"]]["val_top1"]:
            best[result["norm"]] = result
    return best


def settled_best_cells(cells: Sequence[Cell], results: dict) -> dict[str, dict]:
    """``best_cells`` of the norms whose cells are all done: their best cannot change any more."""
    best = best_cells([results[cell] for cell in cells if cell in results])
    return {
        norm: result for norm, result in best.items() if all(cell in results for cell in cells if cell.norm == norm)
    }


def cell_draws(chosen: dict[str, CfgNode], seed: int) -> dict[str, dict[int, dict]]:
    """Per norm of ``chosen`` ({norm: a cell's config}) with more than one draw in the cache, {SEED:
    results.json} of that cell's backbone pretrained with each of the finetune sweep's default seeds
    (``backbones.DEFAULT_SEEDS``, as ``--backbone-seeds`` makes them: the same recipe, another
    initialisation and data order), the cell itself (SEED ``seed``) first."""
    seeds = list(dict.fromkeys([seed, *DEFAULT_SEEDS]))
    draws = {}
    for norm, config in chosen.items():
        drawn = backbone_configs({norm: config}, seeds, per_seed=True)
        found = {
            drawn_seed: read_json(os.path.join(cached_backbone_folder(config), RESULTS_FILE))
            for (_, drawn_seed), config in drawn.items()
            if is_cached(config)
        }
        if len(found) > 1:
            draws[norm] = found
    return draws


def best_draws(
    settled: dict[str, dict], cells: Sequence[Cell], configs: dict, seed: int
) -> dict[str, dict[int, float]]:
    """Per settled norm with more than one draw in the cache (``cell_draws``), {SEED: val top-1} of its best
    setting's backbones."""
    chosen = {
        norm: configs[next(cell for cell in cells if cell.norm == norm and cell.setting == result["setting"])]
        for norm, result in settled.items()
    }
    return {
        norm: {drawn_seed: results["val_top1"] for drawn_seed, results in found.items()}
        for norm, found in cell_draws(chosen, seed).items()
    }


def lowest_best_top1(cells: Sequence[Cell], results: dict, norms: int) -> float | None:
    """``--equal-top1``'s default target: the lowest of the norms' best val top-1, rounded down to a whole
    percent, so that every norm reaches it; None until all ``norms`` are settled."""
    settled = settled_best_cells(cells, results)
    if len(settled) < norms:
        return None
    return float(math.floor(min(result["val_top1"] for result in settled.values())))


def equal_top1_cells(
    cells: Sequence[Cell], results: dict, target: float, eval_period: int
) -> tuple[dict[str, Cell], list[str]]:
    """``--equal-top1``: per norm with a settled best, that setting with PRETRAIN.STOP_TOP1 ``target``
    checked every ``eval_period`` iterations (the grid's PRETRAIN.EVAL_PERIOD, so that it stops where its
    grid cell first reached ``target``); and the norms whose best never reached it."""
    equal, not_reached = {}, []
    for norm, best in settled_best_cells(cells, results).items():
        if iterations_to_reach(best["top1_curve"], target) is None:
            not_reached.append(norm)
        else:
            stopping = (("PRETRAIN.STOP_TOP1", float(target)), ("PRETRAIN.EVAL_PERIOD", int(eval_period)))
            equal[norm] = Cell(norm, (*best["overrides"].items(), *stopping))
    return equal, not_reached
