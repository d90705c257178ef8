"""The plan of a pretraining grid: its cells (a norm and a setting), each cell's config and folder, checked before
anything runs, and the estimate of the wall time of the cells to run (``print_estimate``)."""

from __future__ import annotations

import itertools
import logging
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from detectron2.config import CfgNode

from ... import model_zoo
from ...d2 import valid_norm_names
from ...engine.launch import load_cfg
from ...pretraining.cache import cached_backbone_folder
from ...pretraining.model import PRETRAINED_AS
from ...pretraining.train import LOG_PERIOD, trained_iterations
from ..backbones import with_pretrain_overrides
from ..jobs import WORK_FOLDER, checkpointed_iterations, child_environment, read_job_record, threads_of
from ..labels import format_duration

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = os.path.join(model_zoo.CONFIG_DIR, "demo_finetune_norms.yaml")
DEFAULT_NORMS = ("BN", "GN", "SN", "DN", "MGN")
DEFAULT_LRS = (0.05, 0.1, 0.2, 0.4)
DEFAULT_OUTPUT_DIR = os.path.join("output", "pretrain_grid")
DEFAULT_ESTIMATE_STEPS = 3


@dataclass(frozen=True)
class Cell:
    """A norm and a setting: the PRETRAIN overrides (key -> value) of the grid's varied keys."""

    norm: str
    overrides: tuple[tuple[str, object], ...]

    @property
    def setting(self) -> str:
        names = {
            "PRETRAIN.BASE_LR": "LR",
            "PRETRAIN.WARMUP_ITERS": "warm-up",
            "PRETRAIN.STOP_ITER": "stopped at",
            "PRETRAIN.STOP_TOP1": "stopped at top-1",
            "PRETRAIN.EVAL_PERIOD": "evaluated every",
        }
        return ", ".join(f"{names.get(key, key)} {value}" for key, value in self.overrides)

    @property
    def name(self) -> str:
        short = {
            "PRETRAIN.BASE_LR": "lr",
            "PRETRAIN.WARMUP_ITERS": "warmup",
            "PRETRAIN.STOP_ITER": "stop",
            "PRETRAIN.STOP_TOP1": "top1-",
            "PRETRAIN.EVAL_PERIOD": "eval",
        }
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


def plan_cells(norms: Sequence[str], lrs: Sequence[float], warmups: Sequence[int] | None = None) -> list[Cell]:
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
    the norm and the cell's PRETRAIN overrides, made as ``compare_norms.plan.pretraining_configs`` makes it."""
    return with_pretrain_overrides(cfg, cell.norm, dict(cell.overrides))


def plan_grid(args) -> tuple[CfgNode, list[Cell], dict]:
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
        logger.info(
            "PRETRAIN.EVAL_PERIOD is 0: iterations to %g %% are known only at the end of training", args.target_top1
        )
    cells = plan_cells(args.norms, args.lrs, args.warmups)
    configs = {cell: cell_cfg(cfg, cell) for cell in cells}
    return cfg, cells, configs


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


def measured_step_seconds(cfg: CfgNode, steps: int, threads: int) -> float:
    """The median of ``steps`` pretraining steps of ``cfg`` (after one untimed) on a random batch at
    ``threads`` intra-op threads: the trainer, network and optimizer of pretraining, without its data."""
    import torch

    from ...benchmarks.pretrain import Setting, random_batch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        setting = Setting(cfg, random_batch(cfg, cfg.PRETRAIN.IMS_PER_BATCH, 24), 24)
        setting.train_step()
        return statistics.median(setting.train_step() for _ in range(steps))
    finally:
        torch.set_num_threads(previous)


def estimate(
    cells_to_run,
    results,
    configs,
    jobs: int,
    steps: int,
    done: Callable[[Cell], int] = lambda cell: 0,
    iterations: Callable[[Cell], int] | None = None,
) -> tuple[float, dict[str, tuple[float, str]]]:
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


def print_estimate(
    what: str, todo: Sequence[Cell], results: dict, configs: dict, args, iterations: dict | None = None, stop: str = ""
) -> None:
    """``estimate`` printed; ``iterations`` ({cell: iterations it trains}, default its config's): ``stop``
    says where those come from."""
    done = {
        cell: checkpointed_iterations(os.path.join(cell_folder(args.output_dir, cell), WORK_FOLDER)) for cell in todo
    }
    seconds, basis = estimate(
        todo,
        list(results.values()),
        configs,
        args.jobs,
        args.estimate_steps,
        done.__getitem__,
        iterations.__getitem__ if iterations else None,
    )
    resumed = ", ".join(f"{cell.name} after {done[cell]}" for cell in todo if done[cell])
    print(
        f"Estimated wall time of {what}: {format_duration(seconds)} = the sum over cells of s/iter x their "
        f"iterations still to run{f' ({stop})' if stop else ''}{f' (resumed: {resumed})' if resumed else ''}, / "
        f"{min(args.jobs, len(todo))} "
        "job(s) at once; start-up, batch average and evaluations not included. s/iter per norm:",
        flush=True,
    )
    for norm, (per_iter, source) in basis.items():
        print(f"  {norm}: {per_iter:.3f} s/iter ({source})", flush=True)
