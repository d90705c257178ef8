"""What a pretraining grid writes into its output folder: the markdown tables (the grid, each norm's best drawn
again, the equal-top-1 cells and their draws), the CSV and JSON of the cells, best.json and equal_top1.json;
with ``--publish``, copies of the tables and settings files (``publish``)."""

from __future__ import annotations

import csv
import os
import statistics
from collections.abc import Callable, Sequence

from detectron2.config import CfgNode

from ...pretraining.top1_stop import reached_stop
from ..jobs import write_json
from ..labels import config_label, format_duration
from .plan import Cell
from .publish import BEST_FILE, EQUAL_FILE, publish_outputs
from .results import iterations_to_reach, settled_best_cells

TABLE_FILE, CSV_FILE, JSON_FILE = "results.md", "results.csv", "results.json"
NOT_REACHED = "not reached"
CSV_COLUMNS = ("norm", "setting", "best", "val_top1", "iterations", "wall_s", "s_per_iter", "iterations_to_target")


def describe(cfg: CfgNode, config_file: str, cells: Sequence[Cell], target: float | None) -> str:
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


def _reach_text(reached: int | None, result: dict) -> str:
    if reached is None:
        return NOT_REACHED
    return f"{reached}" if result["evaluated_throughout"] else f"≤ {reached} (evaluated at the end only)"


def _top1_text(result: dict | None, best: bool) -> str:
    if result is None:
        return "–"
    text = f"{result['val_top1']:.1f} % ({format_duration(result['wall_s'])})"
    return f"**{text}**" if best else text


def markdown(description: str, cells: Sequence[Cell], results: dict, target: float | None) -> str:
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
            row = (
                f"| {cell.norm} | {cell.setting}{mark} | {result['val_top1']:.2f} % | {result['iterations']} | "
                f"{format_duration(result['wall_s'])} | {result['s_per_iter']:.3f} |"
            )
            if target is not None:
                row += f" {_reach_text(result['iterations_to_target'], result)} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def draws_markdown(draws: dict[str, dict[int, float]], settled: dict[str, dict]) -> str:
    """The table of ``best_draws``: each norm's best setting drawn again, and the spread of its draws."""
    cell_seed = next(iter(next(iter(draws.values()))))
    seeds = [cell_seed, *sorted({seed for found in draws.values() for seed in found} - {cell_seed})]
    lines = [
        "#### Each norm's best setting, drawn again",
        "",
        (
            "The backbone of each norm's best setting pretrained again with another SEED (the same recipe, another "
            "initialisation and data order), as `tools/compare_norms.py --finetune --backbone-seeds` makes it, where "
            "the cache has it: val top-1, then mean ± sample standard deviation over the draws. A difference between "
            "cells within about that spread is one a single draw per cell cannot tell."
        ),
        "",
        "| norm | setting | "
        + " | ".join(f"SEED {s}{' (the cell)' if s == cell_seed else ''}" for s in seeds)
        + " | mean ± std |",
        "|---" * (len(seeds) + 3) + "|",
    ]
    for norm, found in draws.items():
        values = " | ".join(f"{found[s]:.2f} %" if s in found else "–" for s in seeds)
        spread = f"{statistics.mean(found.values()):.1f} ± {statistics.stdev(found.values()):.1f} %"
        lines.append(f"| {norm} | {settled[norm]['setting']} | {values} | {spread} |")
    return "\n".join(lines) + "\n"


def equal_markdown(
    target: float, equal: dict[str, Cell], not_reached: Sequence[str], results: dict, settled: dict[str, dict]
) -> str:
    """The ``--equal-top1`` table: per norm, the iterations its best setting needed to reach ``target``."""
    lines = [
        f"#### Trained to {target:g} % (`--equal-top1`)",
        "",
        (
            f"Each norm's best setting trained again with PRETRAIN.STOP_TOP1 {target:g}: it stops at the first "
            f"evaluation (with the moving averages, every PRETRAIN.EVAL_PERIOD of its setting) at which val top-1 "
            f"reached {target:g} %; evaluated as often as its grid cell, the same run, that is where the cell first "
            "did. Then it is batch-averaged and evaluated as every cell is. Where the grid cell "
            f"reached {target:g} % only at its end, its backbone is copied: the same run would end alike; where the "
            "cell kept its model at the evaluation that first reached it (PRETRAIN.KEEP_EVALUATED_MODELS), that "
            "model is batch-averaged and evaluated, without training. `equal_top1.json` (published beside this "
            "table) holds these settings for `tools/compare_norms.py --finetune --backbones`."
        ),
        "",
        f"| norm | setting | iterations to {target:g} % | top-1 there (grid cell) | val top-1 | wall |",
        "|---|---|---|---|---|---|",
    ]
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
        lines.append(
            f"| {norm} | {settled[norm]['setting']} | {NOT_REACHED} in {settled[norm]['iterations']} | "
            f"best {settled[norm]['val_top1']:.2f} % | | |"
        )
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


def equal_draws_markdown(
    target: float, draws: dict[str, dict[int, dict]], settled: dict[str, dict], cell_seed: int
) -> str:
    """The table of the equal-top-1 settings' draws (``cell_draws``; the cell's own is SEED ``cell_seed``):
    how many iterations each needed."""
    seeds = [cell_seed, *sorted({seed for found in draws.values() for seed in found} - {cell_seed})]
    lines = [
        f"#### Trained to {target:g} %, drawn again",
        "",
        (
            "Each norm's equal-top-1 setting pretrained again with another SEED, as `tools/compare_norms.py --finetune "
            "--backbone-seeds --backbones equal_top1.json` makes it, where the cache has it: the iterations each draw "
            f"trained before its top-1 reached {target:g} % (at an evaluation, or *at the end* of its schedule), "
            f"then its val top-1; mean ± sample standard deviation of the iterations of the draws that reached "
            f"{target:g} %."
        ),
        "",
        "| norm | setting | "
        + " | ".join(f"SEED {s}{' (the cell)' if s == cell_seed else ''}" for s in seeds)
        + " | iterations, mean ± std |",
        "|---" * (len(seeds) + 3) + "|",
    ]
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


def write_outputs(
    output_dir,
    description,
    cells,
    results,
    target,
    publish=None,
    equal=None,
    draws: Callable[[dict], dict] | None = None,
    equal_draws: Callable[[dict], dict] | None = None,
    equal_seed: int = 1,
    periodic: dict | None = None,
) -> dict:
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
    with open(os.path.join(output_dir, TABLE_FILE), "w") as f:
        f.write(text)
    if publish:
        publish_outputs(publish, text, settings)
    with open(os.path.join(output_dir, CSV_FILE), "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for result in done:
            reached = result.get("iterations_to_target", "")
            writer.writerow(
                {
                    **result,
                    "best": settled.get(result["norm"]) is result,
                    "iterations_to_target": NOT_REACHED if reached is None else reached,
                }
            )
    write_json(
        os.path.join(output_dir, JSON_FILE),
        {
            "cells": [{**result, "best": settled.get(result["norm"]) is result} for result in done],
            "not_done": [{"norm": cell.norm, "setting": cell.setting} for cell in cells if cell not in results],
            "best_draws": {norm: {str(seed): top1 for seed, top1 in found.items()} for norm, found in drawn.items()},
            "target_top1": target,
            "equal_top1": [results[cell] for cell in equal[0].values() if cell in results] if equal is not None else [],
            "equal_top1_draws": {
                norm: {
                    str(seed): {"iterations": r["iterations"], "val_top1": r["val_top1"], "reached": reached_stop(r)}
                    for seed, r in found.items()
                }
                for norm, found in drawn_equal.items()
            },
        },
    )
    return best_overrides
