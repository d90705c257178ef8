"""tools/pretrain_grid.py: every norm's backbone pretrained under a grid of recipes at one budget, so that
each norm can be finetuned from its own best backbone instead of from one recipe tuned for one norm.

    tools/pretrain_grid.py [--config-file CFG] [--norms BN,GN,SN,DN,MGN] [--lrs 0.05,0.1,0.2,0.4]
        [--warmups 0,40] [--target-top1 X] [--equal-top1] [--jobs N] [--output-dir DIR] [--publish FILE]
        [--plan-only | --report-only] [KEY VALUE ...]

A **cell** is a norm and a setting (PRETRAIN.BASE_LR, and PRETRAIN.WARMUP_ITERS with ``--warmups``):
the config's backbone with MODEL.RESNETS.NORM set to the norm, pretrained by the config's PRETRAIN keys
with the setting's overrides, for the config's PRETRAIN.MAX_ITER iterations (the same budget in every
cell). FrozenBN is pretrained as BN (``pretrained_norm``), so it is the BN cell.

- **The cache is the result.** A cell's config is exactly the one ``tools/compare_norms.py --finetune``
  asks for with the same config, KEY VALUE overrides and PRETRAIN overrides (``cell_cfg`` and
  ``compare_norms.pretraining_configs`` clone the same loaded config and set the same keys), so the cell
  lands in the verified backbone cache (``cached_backbone``) under the key the finetune sweep reads. A
  cell is done when its backbone is in the cache, whoever made it: backbones made earlier by the
  finetune sweep or ``make demo`` count.
- **A backbone job per cell** (``sn_detection.engine.jobs``: a subprocess, ``--jobs N`` at once with
  the threads split) in ``OUTPUT_DIR/cells/<cell>``: it pretrains in ``training/`` with ``resume``, so
  a cell killed mid-way continues from its last checkpoint (PRETRAIN.CHECKPOINT_PERIOD) when the same
  command runs again; a finished one moves into the cache whole, and its work folder is removed.
  ``cell.json`` records what the cell is (its cache folder) and every attempt (wall time, exit status,
  resumed or not, threads); a cell folder planned for another cache folder (another config, budget or
  override) is refused before anything runs.
- **The estimate**, printed before anything runs: cells done and to run, and the wall time of those to
  run: per cell, seconds per iteration x the iterations it still runs (PRETRAIN.MAX_ITER, less those
  before a killed cell's last checkpoint), summed and divided by the jobs. A norm's
  seconds per iteration are the median of detectron2's per-iteration time (metrics.json) over its
  finished cells; for a norm without one, ``--estimate-steps K`` training steps measured here on a
  random batch at the threads one job gets (no data loading, batch average or evaluation: a lower
  bound). Start-up, batch average and evaluations are not in it, nor jobs slowing each other.
- **Results**, per cell: val top-1 (after the batch average), wall time (the grid's attempts together;
  for a cell made elsewhere, its recorded training time), iterations, seconds per iteration, and with
  PRETRAIN.EVAL_PERIOD the top-1 at each evaluation (``metrics.json``'s ``val_top1``; those before the
  end are of the moving-average statistics). ``--target-top1 X``: the first evaluated iteration at which
  val top-1 reached X, from the same runs. It does not train anything further: a cell whose runs never
  reach X within the budget shows "not reached", and the iteration is only as fine as EVAL_PERIOD (the
  end of training is always evaluated).
- **Equal top-1** (``--equal-top1``): once a norm's cells are all done, its best setting is trained again
  in a cell of its own with PRETRAIN.STOP_TOP1 X: it stops at the first periodic evaluation whose top-1
  reaches X, so it is the best cell's run (the same seed, data stream and schedule of PRETRAIN.MAX_ITER)
  cut short where that cell first reached X (on the grid's threads and CPU; elsewhere it may stop at
  another evaluation, and the table shows both), then batch-averaged and evaluated as every cell is, into
  the cache. So every norm gets a backbone of about X % top-1, and the iterations it needed are a
  finding of their own; and since the stop is the config's, ``compare_norms --backbone-seeds`` draws of it
  stop at X too, each after its own number of iterations. X is ``--target-top1``, by default the lowest
  of the norms' best top-1 rounded down to a whole percent (known once every cell is done), so that every
  norm reaches it; a norm whose best never did is reported as not reached. Where a norm's best cell
  first reached X at its end (the final evaluation), or at an evaluation whose model it kept (a grid run
  with PRETRAIN.KEEP_EVALUATED_MODELS), the equal cell is made from the cell's run without training
  (``pretraining.train.same_run_stop``): a copy of its backbone, or the batch average of that model.
  The stop is checked every PRETRAIN.EVAL_PERIOD of the grid, or every ``--equal-eval-period N``
  iterations: a finer N stops nearer X (top-1 may climb several points between two of the grid's
  evaluations), and the equal cells then train, their run's evaluations not being the grid cell's.
- **Outputs** in OUTPUT_DIR: ``results.md`` (top-1 per norm x setting with wall times, each norm's best
  setting by val top-1 in bold, then a row per cell, and where the cache holds other draws of a best
  setting (another SEED, as ``compare_norms --backbone-seeds`` makes them) a table of the draws),
  ``results.csv``, ``results.json`` (with the curves and those draws), and ``best.json``, ``{norm:
  {PRETRAIN key: value}}``: each norm's best setting, for norms whose cells are all done, with the
  grid's PRETRAIN.EVAL_PERIOD and KEEP_EVALUATED_MODELS where it evaluates periodically (neither changes
  the backbone: a draw of the setting is evaluated, and keeps its models, as the cell was, so that its
  equal-top-1 draw is made from it);
  ``tools/compare_norms.py --finetune --backbones best.json`` finetunes each setting from its backbone
  norm's best backbone (FrozenBN from BN's). With ``--equal-top1``, ``equal_top1.json`` (the same form,
  each norm's best setting with PRETRAIN.STOP_TOP1 and the PRETRAIN.EVAL_PERIOD it is checked at) and the
  equal-top-1 table under the grid's, with a table of its draws where the cache has them.
- **Published** (``--publish FILE``): the markdown, and beside it the settings files, ``FILE`` with
  ``.best.json`` and ``.equal_top1.json`` for its ``.md`` (``published_settings``): the grid's choice
  is then part of the repository, so that a finetune sweep on a machine whose cache and OUTPUT_DIR are
  empty pretrains the same backbones (``--backbones model_zoo/sections/1_pretrain_grid.best.json``)
  without running the grid again.
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import logging
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from detectron2.config import CfgNode

from .. import model_zoo
from ..d2 import valid_norm_names
from ..evidence.runs import reached_stop
from ..pretraining.model import PRETRAINED_AS
from ..pretraining.train import (
    LOG_PERIOD, METRICS_FILE, RESULTS_FILE, cached_backbone_folder, cached_backbone_path, is_cached,
    same_run_stop, top1_curve, trained_iterations,
)  # fmt: skip
from .compare_norms import DEFAULT_SEEDS, backbone_configs, config_label, override_list, with_pretrain_overrides
from .jobs import (
    JOB_LOG,
    WORK_FOLDER,
    backbone_command,
    checkpointed_iterations,
    child_environment,
    execute_job,
    read_job_record,
    read_json,
    run_jobs,
    seconds_per_iteration,
    threads_of,
    write_json,
)
from .launch import load_cfg
from .timing import create_folder_of, format_duration, output_file

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = os.path.join(model_zoo.CONFIG_DIR, "demo_finetune_norms.yaml")
DEFAULT_NORMS = ("BN", "GN", "SN", "DN", "MGN")
DEFAULT_LRS = (0.05, 0.1, 0.2, 0.4)
DEFAULT_OUTPUT_DIR = os.path.join("output", "pretrain_grid")
DEFAULT_ESTIMATE_STEPS = 3
TABLE_FILE, CSV_FILE, JSON_FILE, BEST_FILE = "results.md", "results.csv", "results.json", "best.json"
EQUAL_FILE = "equal_top1.json"

NOT_REACHED = "not reached"
CSV_COLUMNS = ("norm", "setting", "best", "val_top1", "iterations", "wall_s", "s_per_iter", "iterations_to_target")


def published_settings(publish: str) -> dict[str, str]:
    """The settings files written beside a published table ``publish`` (``--publish``): {output file name
    (BEST_FILE, EQUAL_FILE): its published path}, ``publish`` with ``.best.json`` or ``.equal_top1.json``
    for its extension."""
    stem = os.path.splitext(publish)[0]
    return {name: f"{stem}.{name}" for name in (BEST_FILE, EQUAL_FILE)}


@dataclass(frozen=True)
class Cell:
    """A norm and a setting: the PRETRAIN overrides (key -> value) of the grid's varied keys."""

    norm: str
    overrides: tuple[tuple[str, object], ...]

    @property
    def setting(self) -> str:
        names = {"PRETRAIN.BASE_LR": "LR", "PRETRAIN.WARMUP_ITERS": "warm-up", "PRETRAIN.STOP_ITER": "stopped at",
                 "PRETRAIN.STOP_TOP1": "stopped at top-1", "PRETRAIN.EVAL_PERIOD": "evaluated every"}  # fmt: skip
        return ", ".join(f"{names.get(key, key)} {value}" for key, value in self.overrides)

    @property
    def name(self) -> str:
        short = {"PRETRAIN.BASE_LR": "lr", "PRETRAIN.WARMUP_ITERS": "warmup", "PRETRAIN.STOP_ITER": "stop",
                 "PRETRAIN.STOP_TOP1": "top1-", "PRETRAIN.EVAL_PERIOD": "eval"}  # fmt: skip
        return "-".join([self.norm, *(f"{short.get(key, key)}{value}" for key, value in self.overrides)])


def parse_norms(text: str) -> list[str]:
    """Comma-separated norm names, each pretrained as ``pretrained_norm`` says (FrozenBN: BN), each once."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("--norms is empty: give at least one norm")
    valid = valid_norm_names()
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise ValueError(f"--norms: unknown norm(s) {unknown}; valid norms: {list(valid)}")
    return list(dict.fromkeys(PRETRAINED_AS.get(name, name) for name in names))  # FrozenBN's cell is BN's


def parse_values(text: str, option: str, kind, rule: str, is_valid) -> list:
    """Comma-separated values of ``kind`` (float or int), each ``is_valid``, none repeated."""
    values = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            value = kind(item)
        except ValueError:
            raise ValueError(f"{option}: {item!r} is not a number") from None
        if not is_valid(value):
            raise ValueError(f"{option}: {item} is invalid: each value must be {rule}")
        values.append(value)
    if not values:
        raise ValueError(f"{option} is empty: the grid needs at least one value")
    if len(set(values)) != len(values):
        raise ValueError(f"{option}: values repeat: {values}")
    return values


def plan_cells(norms: Sequence[str], lrs: Sequence[float], warmups: Optional[Sequence[int]] = None) -> list[Cell]:
    """Norms outermost, then LR, then warm-up: a grid cut short has every setting of its first norms."""
    cells = []
    for norm, lr in itertools.product(norms, lrs):
        for warmup in warmups if warmups else (None,):
            overrides = (("PRETRAIN.BASE_LR", float(lr)),)
            if warmup is not None:
                overrides += (("PRETRAIN.WARMUP_ITERS", int(warmup)),)
            cells.append(Cell(norm, overrides))
    return cells


def cell_cfg(cfg: CfgNode, cell: Cell) -> CfgNode:
    """The config that pretrains ``cell``: ``cfg`` (the loaded config with the KEY VALUE overrides) with
    the norm and the cell's PRETRAIN overrides, made as ``compare_norms.pretraining_configs`` makes it."""
    return with_pretrain_overrides(cfg, cell.norm, dict(cell.overrides))


# -- the cells' folders, records and results -------------------------------------------------------


def cell_folder(output_dir: str, cell: Cell) -> str:
    return os.path.abspath(os.path.join(output_dir, "cells", cell.name))


def check_cell_folders(output_dir: str, cells: Sequence[Cell], configs: dict) -> None:
    """Fail before anything runs if a cell folder holds a cell of another cache folder."""
    for cell in cells:
        record = read_job_record(cell_folder(output_dir, cell))
        planned = cached_backbone_folder(configs[cell])
        if record is not None and record["cache_folder"] != planned:
            raise ValueError(
                f"{cell_folder(output_dir, cell)} holds a cell pretrained into {record['cache_folder']}, "
                f"not the planned {planned} (another config, budget or override): use another --output-dir, "
                "or remove that folder"
            )


def iterations_to_reach(curve: Sequence[tuple[int, float]], target: float) -> Optional[int]:
    """The first evaluated iteration count whose top-1 is at least ``target``; None: not reached."""
    return next((iterations for iterations, top1 in curve if top1 >= target), None)


def evaluated_throughout(curve: Sequence[tuple[int, float]], period: int, iterations: int) -> bool:
    """Whether ``curve`` holds an evaluation after every ``period`` iterations before the end: a cell made
    elsewhere (by ``make demo``, or without PRETRAIN.EVAL_PERIOD) may hold only the final one, and then
    its first iteration at a top-1 is known only to be at most the end."""
    logged = dict(curve)
    return period > 0 and all(done in logged for done in range(period, iterations, period))


def _reach_text(reached: Optional[int], result: dict) -> str:
    if reached is None:
        return NOT_REACHED
    return f"{reached}" if result["evaluated_throughout"] else f"≤ {reached} (evaluated at the end only)"


def cell_result(output_dir: str, cell: Cell, cfg: CfgNode, target: Optional[float]) -> Optional[dict]:
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
    return {norm: result for norm, result in best.items()
            if all(cell in results for cell in cells if cell.norm == norm)}  # fmt: skip


def cell_draws(chosen: dict[str, CfgNode], seed: int) -> dict[str, dict[int, dict]]:
    """Per norm of ``chosen`` ({norm: a cell's config}) with more than one draw in the cache, {SEED:
    results.json} of that cell's backbone pretrained with each of the finetune sweep's default seeds
    (``compare_norms.DEFAULT_SEEDS``, as ``--backbone-seeds`` makes them: the same recipe, another
    initialisation and data order), the cell itself (SEED ``seed``) first."""
    seeds = list(dict.fromkeys([seed, *DEFAULT_SEEDS]))
    draws = {}
    for norm, config in chosen.items():
        drawn = backbone_configs({norm: config}, seeds, per_seed=True)
        found = {drawn_seed: read_json(os.path.join(cached_backbone_folder(config), RESULTS_FILE))
                 for (_, drawn_seed), config in drawn.items() if is_cached(config)}  # fmt: skip
        if len(found) > 1:
            draws[norm] = found
    return draws


def best_draws(settled: dict[str, dict], cells: Sequence[Cell], configs: dict, seed: int) -> dict[str, dict[int, float]]:
    """Per settled norm with more than one draw in the cache (``cell_draws``), {SEED: val top-1} of its best
    setting's backbones."""
    chosen = {norm: configs[next(cell for cell in cells if cell.norm == norm and cell.setting == result["setting"])]
              for norm, result in settled.items()}  # fmt: skip
    return {norm: {drawn_seed: results["val_top1"] for drawn_seed, results in found.items()}
            for norm, found in cell_draws(chosen, seed).items()}  # fmt: skip


def lowest_best_top1(cells: Sequence[Cell], results: dict, norms: int) -> Optional[float]:
    """``--equal-top1``'s default target: the lowest of the norms' best val top-1, rounded down to a whole
    percent, so that every norm reaches it; None until all ``norms`` are settled."""
    settled = settled_best_cells(cells, results)
    if len(settled) < norms:
        return None
    return float(math.floor(min(result["val_top1"] for result in settled.values())))


def equal_top1_cells(cells: Sequence[Cell], results: dict, target: float,
                     eval_period: int) -> tuple[dict[str, Cell], list[str]]:  # fmt: skip
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


# -- the estimate ------------------------------------------------------------------------------------


def measured_step_seconds(cfg: CfgNode, steps: int, threads: int) -> float:
    """The median of ``steps`` pretraining steps of ``cfg`` (after one untimed) on a random batch at
    ``threads`` intra-op threads: the trainer, network and optimizer of pretraining, without its data."""
    import torch

    from .benchmark_pretrain import Setting, random_batch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        setting = Setting(cfg, random_batch(cfg, cfg.PRETRAIN.IMS_PER_BATCH, 24), 24)
        setting.train_step()
        return statistics.median(setting.train_step() for _ in range(steps))
    finally:
        torch.set_num_threads(previous)


def estimate(cells_to_run, results, configs, jobs: int, steps: int, done: Callable[[Cell], int] = lambda cell: 0,
             iterations: Optional[Callable[[Cell], int]] = None) -> tuple[float, dict[str, tuple[float, str]]]:  # fmt: skip
    """(estimated wall seconds of ``cells_to_run``, per norm (s/iter, what it is based on)); NaN where a
    norm has no basis (no finished cell and ``steps`` 0). ``done``: the iterations a cell has checkpointed,
    which it does not run again; ``iterations``: those it trains in all (default: its config's)."""
    iterations = iterations or (lambda cell: trained_iterations(configs[cell]))
    basis = {}
    for norm in dict.fromkeys(cell.norm for cell in cells_to_run):
        finished = [r["s_per_iter"] for r in results if r["norm"] == norm and not math.isnan(r["s_per_iter"])]
        if finished:
            basis[norm] = (statistics.median(finished), f"median of {len(finished)} finished cell(s)' metrics.json")
        elif steps > 0:
            cfg = configs[next(cell for cell in cells_to_run if cell.norm == norm)]
            threads = max(1, threads_per_job(jobs))
            seconds = measured_step_seconds(cfg, steps, threads)
            basis[norm] = (seconds, f"{steps} steps measured now on a random batch, {threads} thread(s)")
        else:
            basis[norm] = (math.nan, "no finished cell, nothing measured (--estimate-steps 0)")
    total = sum(basis[cell.norm][0] * (iterations(cell) - done(cell)) for cell in cells_to_run)
    return total / max(1, min(jobs, len(cells_to_run))), basis


def threads_per_job(jobs: int) -> int:
    return threads_of(child_environment(jobs))


# -- running the cells -------------------------------------------------------------------------------


def run_cells(todo, output_dir, config_file, opts, configs, jobs: int, after_each=None) -> list[Cell]:
    """Runs the cells ``todo`` as backbone jobs (``jobs.execute_job``), ``jobs`` at a time in order;
    returns those that failed."""

    def run(cell: Cell) -> bool:
        folder, cache = cell_folder(output_dir, cell), cached_backbone_folder(configs[cell])
        logger.info("%s: pretraining %d iterations (log: %s)", cell.name, trained_iterations(configs[cell]),
                    os.path.join(folder, JOB_LOG))  # fmt: skip
        command = backbone_command(config_file, [*opts, *override_list(dict(cell.overrides))], cell.norm, folder, cache)
        record = {"norm": cell.norm, "overrides": dict(cell.overrides), "cache_folder": cache}
        return execute_job(command, folder, record, jobs)

    return run_jobs(todo, run, jobs, done=lambda cell: is_cached(configs[cell]), name=lambda cell: cell.name,
                    log_of=lambda cell: os.path.join(cell_folder(output_dir, cell), JOB_LOG), after_each=after_each,
                    outcome=lambda cell: f"done, backbone in {cached_backbone_folder(configs[cell])}")  # fmt: skip


# -- the outputs -------------------------------------------------------------------------------------


def describe(cfg: CfgNode, config_file: str, cells: Sequence[Cell], target: Optional[float]) -> str:
    varied = ", ".join(dict.fromkeys(key for cell in cells for key, _ in cell.overrides))
    batches = cfg.PRETRAIN.BATCH_AVERAGE_BATCHES
    statistics_text = f"after the batch average over {batches} batches" if batches else "with the moving averages"
    text = (
        f"### Pretraining grid (`tools/pretrain_grid.py`, measured here)\n\n"
        f"ResNet-{cfg.MODEL.RESNETS.DEPTH} of `{config_label(config_file)}` pretrained with each norm on "
        f"`{cfg.PRETRAIN.DATA}` ({cfg.PRETRAIN.IMAGE_SIZE} px, batch {cfg.PRETRAIN.IMS_PER_BATCH}), "
        f"{cfg.PRETRAIN.MAX_ITER} iterations in every cell, the config's PRETRAIN recipe with {varied} varied. "
        f"Top-1 on the val split {statistics_text}; in bold each norm's best setting (`best.json`, published "
        "beside this table, which `tools/compare_norms.py --finetune --backbones` reads). Wall time: the grid's "
        f"attempts at the cell together, on {os.cpu_count()} CPU cores, noisy where other work shared the machine. "
        f"Each cell is one run (SEED {cfg.SEED}): another draw of it (another SEED, thread count or CPU) can land "
        "points away, so where settings are that close the best is a choice, not a finding."
    )
    if target is not None:
        text += (
            f" *Iterations to {target:g} %*: the first evaluated iteration (PRETRAIN.EVAL_PERIOD "
            f"{cfg.PRETRAIN.EVAL_PERIOD}, and the end) at which val top-1 reached {target:g} %."
        )
    return text


def _top1_text(result: Optional[dict], best: bool) -> str:
    if result is None:
        return "–"
    text = f"{result['val_top1']:.1f} % ({format_duration(result['wall_s'])})"
    return f"**{text}**" if best else text


def markdown(description: str, cells: Sequence[Cell], results: dict, target: Optional[float]) -> str:
    best = settled_best_cells(cells, results)  # as best.json: a norm with cells to run has no best yet
    settings = list(dict.fromkeys(cell.setting for cell in cells))
    norms = list(dict.fromkeys(cell.norm for cell in cells))
    lines = [description, "", "| norm | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    for norm in norms:
        row = []
        for setting in settings:
            cell = next((c for c in cells if c.norm == norm and c.setting == setting), None)
            result = results.get(cell)
            row.append(_top1_text(result, result is not None and best.get(norm) is result))
        lines.append(f"| {norm} | " + " | ".join(row) + " |")
    header = "| norm | setting | val top-1 | iterations | wall | s/iter |"
    if target is not None:
        header += f" iterations to {target:g} % |"
    lines += ["", header, "|---" * (header.count("|") - 1) + "|"]
    for cell in cells:
        result = results.get(cell)
        if result is None:
            row = f"| {cell.norm} | {cell.setting} | not done | | | |"
            row += " |" if target is not None else ""
        else:
            mark = " (best)" if best.get(cell.norm) is result else ""
            row = (f"| {cell.norm} | {cell.setting}{mark} | {result['val_top1']:.2f} % | {result['iterations']} | "
                   f"{format_duration(result['wall_s'])} | {result['s_per_iter']:.3f} |")  # fmt: skip
            if target is not None:
                row += f" {_reach_text(result['iterations_to_target'], result)} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def draws_markdown(draws: dict[str, dict[int, float]], settled: dict[str, dict]) -> str:
    """The table of ``best_draws``: each norm's best setting drawn again, and the spread of its draws."""
    cell_seed = next(iter(next(iter(draws.values()))))
    seeds = [cell_seed, *sorted({seed for found in draws.values() for seed in found} - {cell_seed})]
    lines = [
        "#### Each norm's best setting, drawn again", "",
        ("The backbone of each norm's best setting pretrained again with another SEED (the same recipe, another "
        "initialisation and data order), as `tools/compare_norms.py --finetune --backbone-seeds` makes it, where "
        "the cache has it: val top-1, then mean ± sample standard deviation over the draws. A difference between "
        "cells within about that spread is one a single draw per cell cannot tell."), "",
        "| norm | setting | " + " | ".join(f"SEED {s}{' (the cell)' if s == cell_seed else ''}" for s in seeds)
        + " | mean ± std |",
        "|---" * (len(seeds) + 3) + "|",
    ]  # fmt: skip
    for norm, found in draws.items():
        values = " | ".join(f"{found[s]:.2f} %" if s in found else "–" for s in seeds)
        spread = f"{statistics.mean(found.values()):.1f} ± {statistics.stdev(found.values()):.1f} %"
        lines.append(f"| {norm} | {settled[norm]['setting']} | {values} | {spread} |")
    return "\n".join(lines) + "\n"


def equal_markdown(target: float, equal: dict[str, Cell], not_reached: Sequence[str], results: dict,
                   settled: dict[str, dict]) -> str:
    """The ``--equal-top1`` table: per norm, the iterations its best setting needed to reach ``target``."""
    lines = [
        f"#### Trained to {target:g} % (`--equal-top1`)", "",
        (f"Each norm's best setting trained again with PRETRAIN.STOP_TOP1 {target:g}: it stops at the first "
        f"evaluation (with the moving averages, every PRETRAIN.EVAL_PERIOD of its setting) at which val top-1 "
        f"reached {target:g} %; evaluated as often as its grid cell, the same run, that is where the cell first "
        "did. Then it is batch-averaged and evaluated as every cell is. Where the grid cell "
        f"reached {target:g} % only at its end, its backbone is copied: the same run would end alike; where the "
        "cell kept its model at the evaluation that first reached it (PRETRAIN.KEEP_EVALUATED_MODELS), that "
        "model is batch-averaged and evaluated, without training. `equal_top1.json` (published beside this "
        "table) holds these settings for `tools/compare_norms.py --finetune --backbones`."), "",
        f"| norm | setting | iterations to {target:g} % | top-1 there (grid cell) | val top-1 | wall |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for norm, cell in equal.items():
        best = settled[norm]
        expected = iterations_to_reach(best["top1_curve"], target)
        result = results.get(cell)
        known = best["evaluated_throughout"]  # else the cell's first reach is only known to be by its end
        if result is None:
            trained, done = _reach_text(expected, best), "not done | "
        else:
            trained = f"{result['iterations']}" if reached_stop(result) else f"{NOT_REACHED} in {result['iterations']}"
            if result["iterations"] != expected:
                trained += f" (grid cell: {_reach_text(expected, best)})"
            done = f"{result['val_top1']:.2f} % | {format_duration(result['wall_s'])}"
        at = f"{dict(best['top1_curve'])[expected]:.2f} %" if known else "–"
        lines.append(f"| {norm} | {best['setting']} | {trained} | {at} | {done} |")
    for norm in not_reached:
        lines.append(f"| {norm} | {settled[norm]['setting']} | {NOT_REACHED} in {settled[norm]['iterations']} | "
                     f"best {settled[norm]['val_top1']:.2f} % | | |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _draw_text(results: dict) -> str:
    """A draw of an equal-top-1 setting: the iterations it trained and its val top-1."""
    if results.get("stop_top1_reached"):
        stop = ""
    elif "stop_top1" not in results:
        stop = " (whole schedule)"
    else:
        stop = " (at the end)" if reached_stop(results) else f" ({NOT_REACHED})"
    return f"{results['iterations']}{stop}, {results['val_top1']:.1f} %"


def equal_draws_markdown(target: float, draws: dict[str, dict[int, dict]], settled: dict[str, dict],
                         cell_seed: int) -> str:  # fmt: skip
    """The table of the equal-top-1 settings' draws (``cell_draws``; the cell's own is SEED ``cell_seed``):
    how many iterations each needed."""
    seeds = [cell_seed, *sorted({seed for found in draws.values() for seed in found} - {cell_seed})]
    lines = [
        f"#### Trained to {target:g} %, drawn again", "",
        ("Each norm's equal-top-1 setting pretrained again with another SEED, as `tools/compare_norms.py --finetune "
        "--backbone-seeds --backbones equal_top1.json` makes it, where the cache has it: the iterations each draw "
        f"trained before its top-1 reached {target:g} % (at an evaluation, or *at the end* of its schedule), "
        f"then its val top-1; mean ± sample standard deviation of the iterations of the draws that reached "
        f"{target:g} %."), "",
        "| norm | setting | " + " | ".join(f"SEED {s}{' (the cell)' if s == cell_seed else ''}" for s in seeds)
        + " | iterations, mean ± std |",
        "|---" * (len(seeds) + 3) + "|",
    ]  # fmt: skip
    for norm, found in draws.items():
        values = " | ".join(_draw_text(found[s]) if s in found else "–" for s in seeds)
        stopped = [results["iterations"] for results in found.values() if reached_stop(results)]
        spread = f"{statistics.mean(stopped):.0f} ± {statistics.stdev(stopped):.0f}" if len(stopped) > 1 else "–"
        lines.append(f"| {norm} | {settled[norm]['setting']} | {values} | {spread} |")
    return "\n".join(lines) + "\n"


def periodic_settings(cfg: CfgNode) -> dict:
    """The grid's PRETRAIN.EVAL_PERIOD and KEEP_EVALUATED_MODELS where it evaluates periodically, for
    best.json: not part of a setting (the backbone is the same without them), but how a draw of it runs
    to be evaluated as the cell was and to serve its equal-top-1 draw (``same_run_stop``)."""
    if not cfg.PRETRAIN.EVAL_PERIOD:
        return {}
    keep = {"PRETRAIN.KEEP_EVALUATED_MODELS": True} if cfg.PRETRAIN.KEEP_EVALUATED_MODELS else {}
    return {"PRETRAIN.EVAL_PERIOD": cfg.PRETRAIN.EVAL_PERIOD, **keep}


def write_outputs(output_dir, description, cells, results, target, publish=None, equal=None,
                  draws: Optional[Callable[[dict], dict]] = None,
                  equal_draws: Optional[Callable[[dict], dict]] = None, equal_seed: int = 1,
                  periodic: Optional[dict] = None) -> dict:  # fmt: skip
    """results.md, .csv, .json and best.json (norms whose cells are all done, each with the ``periodic``
    settings: ``periodic_settings``); ``draws`` (settled best cells -> ``best_draws``) adds the table of
    their other draws; with ``equal`` (the ``equal_top1_cells``) also equal_top1.json and their table, and
    ``equal_draws`` ({norm: equal cell} -> ``cell_draws``) the table of theirs (``equal_seed``: the cells'
    own SEED). Returns best.json's content."""
    os.makedirs(output_dir, exist_ok=True)
    done = [results[cell] for cell in cells if cell in results]
    settled = settled_best_cells(cells, results)  # the "best" of the table, CSV, JSON and best.json alike
    best_overrides = {norm: {**result["overrides"], **(periodic or {})} for norm, result in settled.items()}
    drawn = draws(settled) if draws else {}
    text = markdown(description, cells, results, target)
    if drawn:
        text += "\n" + draws_markdown(drawn, settled)
    drawn_equal = {}
    if equal is not None:
        text += "\n" + equal_markdown(target, *equal, results, settled)
        drawn_equal = equal_draws(equal[0]) if equal_draws else {}
        if drawn_equal:
            text += "\n" + equal_draws_markdown(target, drawn_equal, settled, equal_seed)
    settings = {BEST_FILE: best_overrides}
    if equal is not None:
        settings[EQUAL_FILE] = {norm: dict(cell.overrides) for norm, cell in equal[0].items()}
    for name, overrides in settings.items():
        write_json(os.path.join(output_dir, name), overrides)
        if publish:
            write_json(published_settings(publish)[name], overrides)
    with open(os.path.join(output_dir, TABLE_FILE), "w") as f:
        f.write(text)
    if publish:
        create_folder_of(publish)
        with open(publish, "w") as f:
            f.write(text)
    with open(os.path.join(output_dir, CSV_FILE), "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for result in done:
            reached = result.get("iterations_to_target", "")
            writer.writerow({**result, "best": settled.get(result["norm"]) is result,
                             "iterations_to_target": NOT_REACHED if reached is None else reached})  # fmt: skip
    write_json(os.path.join(output_dir, JSON_FILE), {
        "cells": [{**result, "best": settled.get(result["norm"]) is result} for result in done],
        "not_done": [{"norm": cell.norm, "setting": cell.setting} for cell in cells if cell not in results],
        "best_draws": {norm: {str(seed): top1 for seed, top1 in found.items()} for norm, found in drawn.items()},
        "target_top1": target,
        "equal_top1": [results[cell] for cell in equal[0].values() if cell in results] if equal is not None else [],
        "equal_top1_draws": {norm: {str(seed): {"iterations": r["iterations"], "val_top1": r["val_top1"],
                                                "reached": reached_stop(r)}
                                    for seed, r in found.items()} for norm, found in drawn_equal.items()},
    })  # fmt: skip
    return best_overrides


# -- the command -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Pretrain every norm's backbone under a grid of PRETRAIN settings at one budget, into the "
        "backbone cache that tools/compare_norms.py --finetune reads; resumable by running it again."
    )
    parser.add_argument("--config-file", default=DEFAULT_CONFIG, metavar="FILE", help="default: %(default)s")
    parser.add_argument("--norms", default=",".join(DEFAULT_NORMS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--lrs", default=",".join(map(str, DEFAULT_LRS)),
                        help="PRETRAIN.BASE_LR values, comma-separated (default: %(default)s)")  # fmt: skip
    parser.add_argument("--warmups", help="PRETRAIN.WARMUP_ITERS values, comma-separated (default: the config's)")
    parser.add_argument("--target-top1", type=float, metavar="X",
                        help="report the first evaluated iteration at which val top-1 reached X %%")  # fmt: skip
    parser.add_argument("--equal-top1", action="store_true",
                        help="then train each norm's best setting again, stopped where its top-1 first reaches "
                        "--target-top1 (default: the lowest best top-1, rounded down to a whole percent, once every "
                        "norm's cells are done; PRETRAIN.STOP_TOP1 checked every --equal-eval-period), and write "
                        "equal_top1.json for compare_norms")  # fmt: skip
    parser.add_argument("--equal-eval-period", type=int, metavar="N",
                        help=f"with --equal-top1: check the stop every N iterations (>= {LOG_PERIOD}; default: the "
                        "grid's PRETRAIN.EVAL_PERIOD, whose cells' kept models then give the equal cells without "
                        "training)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="cells at once, the threads split between them (default: 1)")  # fmt: skip
    parser.add_argument("--estimate-steps", type=int, default=DEFAULT_ESTIMATE_STEPS, metavar="K",
                        help="steps measured per norm without a finished cell for the estimate; 0: none "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help="default: %(default)s")
    parser.add_argument("--publish", metavar="FILE", type=output_file,
                        help="also write the markdown table here, and beside it best.json (and equal_top1.json) as "
                        "FILE's name with .best.json (.equal_top1.json) for .md")  # fmt: skip
    parser.add_argument("--plan-only", action="store_true", help="print the plan and the estimate, run nothing")
    parser.add_argument("--report-only", action="store_true", help="only write the outputs of the done cells")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides for every cell")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.estimate_steps < 0:
        parser.error(f"--estimate-steps must be >= 0, got {args.estimate_steps}")
    if args.equal_eval_period is not None and args.equal_eval_period < LOG_PERIOD:
        parser.error(f"--equal-eval-period must be >= {LOG_PERIOD} (metrics.json is written every {LOG_PERIOD} "
                     f"iterations), got {args.equal_eval_period}")  # fmt: skip
    if args.target_top1 is not None and not 0 < args.target_top1 <= 100:
        parser.error(f"--target-top1 must be a top-1 in (0, 100] %, got {args.target_top1}")
    if not os.path.isfile(args.config_file):
        parser.error(f"--config-file {args.config_file}: no such file")
    try:
        args.norms = parse_norms(args.norms)
        args.lrs = parse_values(args.lrs, "--lrs", float, "a learning rate > 0", lambda v: v > 0 and math.isfinite(v))
        if args.warmups is not None:
            args.warmups = parse_values(args.warmups, "--warmups", int, "an int >= 0", lambda v: v >= 0)
    except ValueError as error:
        parser.error(str(error))
    return args


def plan(args) -> tuple[CfgNode, list[Cell], dict]:
    """The loaded config, the cells and each cell's config; bad values fail here."""
    cfg = load_cfg(os.path.abspath(args.config_file), list(args.opts))
    period = cfg.PRETRAIN.EVAL_PERIOD
    if 0 < period < LOG_PERIOD:
        raise ValueError(
            f"PRETRAIN.EVAL_PERIOD={period}: metrics.json is written every {LOG_PERIOD} iterations and keeps "
            f"the latest evaluation of each write only, so the top-1 curve would miss evaluations; use 0 (the "
            f"end only) or >= {LOG_PERIOD}"
        )
    if args.target_top1 is not None and period == 0:
        logger.info("PRETRAIN.EVAL_PERIOD is 0: iterations to %g %% are known only at the end of training",
                    args.target_top1)  # fmt: skip
    cells = plan_cells(args.norms, args.lrs, args.warmups)
    configs = {cell: cell_cfg(cfg, cell) for cell in cells}
    return cfg, cells, configs


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Returns the exit status: 1 if a cell failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s pretrain_grid] %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    try:
        cfg, cells, configs = plan(args)
        check_cell_folders(args.output_dir, cells, configs)
    except ValueError as error:
        raise SystemExit(f"pretrain_grid: error: {error}") from None

    def collect(extra: Sequence[Cell] = ()) -> dict:
        for cell in extra:
            configs.setdefault(cell, cell_cfg(cfg, cell))
        found = {cell: cell_result(args.output_dir, cell, configs[cell], args.target_top1) for cell in (*cells, *extra)}
        return {cell: result for cell, result in found.items() if result is not None}

    def plan_equal() -> Optional[tuple[dict[str, Cell], list[str]]]:
        """The --equal-top1 cells of the norms settled so far (their configs checked), or None (no
        --equal-top1, or its target still unknown)."""
        if not args.equal_top1:
            return None
        results = collect()
        if args.target_top1 is None:
            args.target_top1 = lowest_best_top1(cells, results, len(args.norms))
            if args.target_top1 is None:
                return None
        equal = equal_top1_cells(cells, results, args.target_top1, args.equal_eval_period or cfg.PRETRAIN.EVAL_PERIOD)
        planned = list(equal[0].values())
        for cell in planned:
            configs.setdefault(cell, cell_cfg(cfg, cell))
        check_cell_folders(args.output_dir, planned, configs)
        return equal

    def write() -> dict:
        equal = plan_equal()
        results = collect(list(equal[0].values()) if equal else ())
        description = describe(cfg, args.config_file, cells, args.target_top1)
        return write_outputs(args.output_dir, description, cells, results, args.target_top1, args.publish, equal,
                             draws=lambda settled: best_draws(settled, cells, configs, cfg.SEED),
                             equal_draws=lambda chosen: cell_draws({n: configs[c] for n, c in chosen.items()}, cfg.SEED),
                             equal_seed=cfg.SEED, periodic=periodic_settings(cfg))  # fmt: skip

    results = collect()
    todo = [cell for cell in cells if cell not in results]
    norms, settings = len(args.norms), len(cells) // len(args.norms)
    print(f"Pretraining grid: {norms} norm(s) x {settings} setting(s) = {len(cells)} cells, "
          f"{cfg.PRETRAIN.MAX_ITER} iterations each at batch {cfg.PRETRAIN.IMS_PER_BATCH}; {len(results)} done "
          f"(in the cache), {len(todo)} to run, --jobs {args.jobs}.", flush=True)  # fmt: skip
    if todo and not args.report_only:
        print_estimate(f"the {len(todo)} cell(s) to run", todo, results, configs, args)
    try:
        equal = plan_equal()
    except ValueError as error:
        raise SystemExit(f"pretrain_grid: error: {error}") from None
    if args.equal_top1 and equal is None:
        print("Trained to the lowest best top-1 (--equal-top1): that target is known once every norm's cells are "
              "done.", flush=True)  # fmt: skip
    if equal is not None:
        equal_todo = [cell for cell in equal[0].values() if cell not in collect(list(equal[0].values()))]
        print(f"Trained to {args.target_top1:g} % (--equal-top1): {len(equal[0])} norm(s) with all cells done, "
              f"{len(equal_todo)} to run; not reached by: {', '.join(equal[1]) or 'none'}.", flush=True)  # fmt: skip
        if equal_todo and not args.report_only:
            settled = settled_best_cells(cells, results)  # an equal cell stops where its grid cell reached X
            expected = {cell: 0 if same_run_stop(configs[cell]) else iterations_to_reach(settled[cell.norm]["top1_curve"],
                                                                                     args.target_top1)
                        for cell in equal_todo}  # fmt: skip
            print_estimate("the equal-top-1 cell(s) to run", equal_todo, results, configs, args, expected,
                           f"where their grid cell reached {args.target_top1:g} %; 0 for one made from the grid "
                           "cell's run")  # fmt: skip
    if args.plan_only:
        planned = cells + (list(equal[0].values()) if equal else [])
        done = collect(planned[len(cells):])
        for cell in planned:
            print(f"  {cell.name}: {'done' if cell in done else 'to run'} "
                  f"({cached_backbone_folder(configs[cell])})")  # fmt: skip
        return 0

    failed = []
    if not args.report_only:
        run = functools.partial(run_cells, output_dir=args.output_dir, config_file=os.path.abspath(args.config_file),
                                opts=list(args.opts), configs=configs, jobs=args.jobs, after_each=write)  # fmt: skip
        failed += run(todo) if todo else []
        equal = plan_equal()  # the norms the grid has just settled too
        if equal is not None:
            done = collect(list(equal[0].values()))
            failed += run([cell for cell in equal[0].values() if cell not in done])
    best = write()
    logger.info("%d of %d cells done; results in %s; best settings (%s): %s", len(collect()), len(cells),
                args.output_dir, BEST_FILE, best)  # fmt: skip
    if failed:
        logger.error("failed cells: %s", ", ".join(cell.name for cell in failed))
    return 1 if failed else 0


def print_estimate(what: str, todo: Sequence[Cell], results: dict, configs: dict, args,
                   iterations: Optional[dict] = None, stop: str = "") -> None:  # fmt: skip
    """``estimate`` printed; ``iterations`` ({cell: iterations it trains}, default its config's): ``stop``
    says where those come from."""
    done = {cell: checkpointed_iterations(os.path.join(cell_folder(args.output_dir, cell), WORK_FOLDER)) for cell in todo}
    seconds, basis = estimate(todo, list(results.values()), configs, args.jobs, args.estimate_steps, done.__getitem__,
                              iterations.__getitem__ if iterations else None)  # fmt: skip
    resumed = ", ".join(f"{cell.name} after {done[cell]}" for cell in todo if done[cell])
    print(f"Estimated wall time of {what}: {format_duration(seconds)} = the sum over cells of s/iter x their "
          f"iterations still to run{f' ({stop})' if stop else ''}{f' (resumed: {resumed})' if resumed else ''}, / "
          f"{min(args.jobs, len(todo))} "
          "job(s) at once; start-up, batch average and evaluations not included. s/iter per norm:", flush=True)  # fmt: skip
    for norm, (per_iter, source) in basis.items():
        print(f"  {norm}: {per_iter:.3f} s/iter ({source})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
