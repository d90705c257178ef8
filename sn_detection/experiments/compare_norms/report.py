"""The results of the norm comparison: mean ± std over seeds per setting, as a markdown table and a CSV,
and the differences between settings within a backbone.

The spread is the sample standard deviation (n - 1 in the denominator) of the seeds' values; with a
single run it is undefined: NaN in the CSV, left out of the table. A setting's mean is over its
finished runs only, and the table says how many there were.

*Within a backbone*: for two settings whose runs of a seed started from the same pretrained weights,
the later setting's AP minus the earlier's, seed by seed (a paired difference), then mean ± std over
those seeds. The backbone's draw is common to both runs of a pair and cancels; what is left is the
settings' difference and the finetuning's seed. Where every seed draws its own backbone, the spread
of a setting's AP holds the backbone's draw, and only the paired difference separates settings that
share a backbone.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..labels import config_label
from .plan import RunSpec
from .runs import AP_METRICS, NOT_RECORDED, RunResult

# What is averaged: the AP columns, then the cost, the end of the learning curve, the backbone's top-1, the
# iterations of a backbone stopped at a top-1 and the share of backbones that never reached theirs.
SUMMARY_COLUMNS = (
    *AP_METRICS,
    "wall_s",
    "s_per_iter",
    "final_loss",
    "backbone_top1",
    "backbone_iterations",
    "backbone_short_of_stop",
)
CSV_COLUMNS = (
    "kind",
    "setting",
    "backbone",
    "head",
    "batch_average",
    "seed",
    "runs",
    "iterations",
    *SUMMARY_COLUMNS,
    "folder",
)
# markdown column -> summary column, for the value columns
_TABLE_VALUES = {"box AP": "box_AP", "box AP50": "box_AP50", "mask AP": "mask_AP", "mask AP50": "mask_AP50"}
_DIFFERENCE_VALUES = {"box AP": "box_AP", "mask AP": "mask_AP"}


@dataclass(frozen=True)
class SettingSummary:
    setting: str
    backbone: str
    head: str
    batch_average: int
    iterations: int
    seeds: tuple[int, ...]
    mean: dict[str, float]
    std: dict[str, float]  # NaN with a single run

    @property
    def runs(self) -> int:
        return len(self.seeds)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (NaN for a single value) of ``values``; a NaN value
    (a COCO AP without any detection) makes both NaN rather than failing."""
    if not values:
        raise ValueError("mean_std of no values")
    mean = math.fsum(values) / len(values)
    if len(values) == 1:
        return mean, math.nan
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def run_value(result: RunResult, column: str) -> float:
    return result.metrics[column] if column in result.metrics else getattr(result, column)


def summarize(results: Sequence[RunResult], order: Sequence[str]) -> list[SettingSummary]:
    """One summary per setting of ``order`` (a setting name) that has results, in that order."""
    summaries = []
    for setting in order:
        runs = sorted((r for r in results if r.setting == setting), key=lambda r: r.seed)
        if not runs:
            continue
        stats = {column: mean_std([run_value(r, column) for r in runs]) for column in SUMMARY_COLUMNS}
        first = runs[0]
        summaries.append(
            SettingSummary(
                setting=setting,
                backbone=first.backbone,
                head=first.head,
                batch_average=first.batch_average,
                iterations=first.iterations,
                seeds=tuple(r.seed for r in runs),
                mean={column: mean for column, (mean, _) in stats.items()},
                std={column: std for column, (_, std) in stats.items()},
            )
        )
    return summaries


@dataclass(frozen=True)
class PairedDifference:
    """``setting`` minus ``baseline``, over the seeds whose runs of both started from the same weights."""

    setting: str
    baseline: str
    seeds: tuple[int, ...]
    differences: dict[str, tuple[float, ...]]  # AP column -> one difference per seed

    def mean_std(self, column: str) -> tuple[float, float]:
        return mean_std(self.differences[column])


def within_backbone_differences(results: Sequence[RunResult], order: Sequence[str]) -> list[PairedDifference]:
    """For every two settings of ``order`` (the later minus the earlier) whose runs of some seed both
    started from the same pretrained weights, their paired differences; settings trained from scratch
    have none."""
    runs = {(r.setting, r.seed): r for r in results}
    seeds = sorted({r.seed for r in results})
    pairs = []
    for i, baseline in enumerate(order):
        for setting in order[i + 1 :]:
            shared = [
                seed
                for seed in seeds
                if (setting, seed) in runs
                and (baseline, seed) in runs
                and runs[setting, seed].weights
                and runs[setting, seed].weights == runs[baseline, seed].weights
            ]
            if shared:
                differences = {
                    column: tuple(
                        run_value(runs[setting, seed], column) - run_value(runs[baseline, seed], column)
                        for seed in shared
                    )
                    for column in _DIFFERENCE_VALUES.values()
                }
                pairs.append(PairedDifference(setting, baseline, tuple(shared), differences))
    return pairs


def format_mean_std(mean: float, std: float, digits: int = 1) -> str:
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def statistics_label(batch_average: int) -> str:
    """How a setting's batch-dependent test statistics were obtained, for the table."""
    return f"batch average ({batch_average})" if batch_average else "– (none)"


def format_top1(mean: float, std: float) -> str:
    """A backbone top-1 over the seeds: one figure where every seed had the same backbone (a spread of
    rounding error only: the mean of equal values need not be exactly that value)."""
    if math.isnan(mean):
        return "–"
    return f"{mean:.1f} %" if math.isnan(std) or std <= 1e-9 * max(1.0, abs(mean)) else f"{mean:.1f} ± {std:.1f} %"


def format_iterations(summary: SettingSummary) -> str:
    """A stopped backbone's pretraining iterations over the seeds, and how many of its backbones never
    reached the top-1 they were to stop at (those trained their whole schedule: not of that top-1)."""
    mean, std = summary.mean["backbone_iterations"], summary.std["backbone_iterations"]
    if math.isnan(mean):
        return "–"
    short_share = summary.mean["backbone_short_of_stop"]
    short = 0 if math.isnan(short_share) else round(short_share * summary.runs)
    if not short:
        return format_mean_std(mean, std, digits=0)
    which = "top-1 not reached" if summary.runs == 1 else f"{short} of {summary.runs} short of the top-1"
    return f"{format_mean_std(mean, std, digits=0)} ({which})"


def markdown_table(summaries: Sequence[SettingSummary]) -> str:
    """The table; a *backbone top-1* column where any setting started from a backbone of known top-1, and
    a *backbone iterations* column where any backbone stopped at a top-1 (PRETRAIN.STOP_TOP1), which says
    where backbones never reached it."""
    top1 = any(not math.isnan(s.mean["backbone_top1"]) for s in summaries)
    stopped = any(not math.isnan(s.mean["backbone_iterations"]) for s in summaries)
    header = [
        "setting",
        "backbone",
        "FPN + heads",
        "test statistics",
        "runs",
        *(["backbone top-1"] if top1 else []),
        *(["backbone iterations"] if stopped else []),
        *_TABLE_VALUES,
        "s/iter",
        "min/run",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        values = [format_mean_std(s.mean[column], s.std[column]) for column in _TABLE_VALUES.values()]
        cells = [
            s.setting,
            s.backbone,
            s.head,
            statistics_label(s.batch_average),
            str(s.runs),
            *([format_top1(s.mean["backbone_top1"], s.std["backbone_top1"])] if top1 else []),
            *([format_iterations(s)] if stopped else []),
            *values,
            f"{s.mean['s_per_iter']:.2f}",
            f"{s.mean['wall_s'] / 60:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def differences_table(pairs: Sequence[PairedDifference]) -> str:
    """The *within a backbone* table: per pair, mean ± std of the paired differences, and in how many
    seeds the setting was ahead."""
    header = [
        "setting − baseline",
        "seeds",
        *(f"{name} difference" for name in _DIFFERENCE_VALUES),
        *(f"{name} ahead in" for name in _DIFFERENCE_VALUES),
    ]
    lines = [
        "#### Within a backbone",
        "",
        (
            "Each seed's run of a setting minus the same seed's run of a baseline that started from the same "
            "pretrained weights, so that the backbone's draw cancels (where every seed started from one backbone, "
            "the differences are that backbone's): mean ± sample standard deviation of those differences over "
            "the seeds, and in how many of them the setting was ahead."
        ),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for pair in pairs:
        spreads, ahead = [], []
        for column in _DIFFERENCE_VALUES.values():
            mean, std = pair.mean_std(column)
            spreads.append(
                "–" if math.isnan(mean) else f"{mean:+.1f}" if math.isnan(std) else f"{mean:+.1f} ± {std:.1f}"
            )
            # a NaN AP (no detection at all) is neither ahead nor behind: counted out
            finite = [d for d in pair.differences[column] if not math.isnan(d)]
            ahead.append(f"{sum(d > 0 for d in finite)} of {len(finite)}")
        lines.append(
            f"| {pair.setting} − {pair.baseline} | {', '.join(map(str, pair.seeds))} | "
            + " | ".join([*spreads, *ahead])
            + " |"
        )
    return "\n".join(lines) + "\n"


def code_sentence(results: Sequence[RunResult]) -> str:
    """Which code the runs ran on (their attempts' ``code``): one version, or each with its runs. A change
    of the code that only rounds differently trains a run as differently as another seed does, so a table
    says where its runs did not all run the same code."""
    runs_of: dict[str, list[str]] = {}
    for r in sorted(results, key=lambda r: (r.setting, r.seed)):
        for code in dict.fromkeys(r.code):
            short = re.sub(r"\b([0-9a-f]{12})[0-9a-f]{28}\b", r"\1", code)  # a commit as people quote it
            runs_of.setdefault(short, []).append(f"{r.setting} seed {r.seed}")
    if len(runs_of) <= 1:
        code = next(iter(runs_of), NOT_RECORDED)
        return f"*Code*: every run on {code}." if code != NOT_RECORDED else "*Code*: not recorded."
    parts = "; ".join(f"{code} ({', '.join(runs)})" for code, runs in runs_of.items())
    return f"*Code* (of each run's attempts; another commit rounds differently, like another seed): {parts}."


def write_markdown(
    path: str,
    description: str,
    summaries: Sequence[SettingSummary],
    unfinished: Sequence[str],
    pairs: Sequence[PairedDifference] = (),
) -> None:
    """``description`` (a paragraph), the table, the runs that were started but did not finish, and the
    differences within a backbone, if any."""
    text = description.strip() + "\n\n" + markdown_table(summaries)
    if unfinished:
        text += "\nFailed or unfinished runs (left out above): " + ", ".join(unfinished) + "\n"
    if pairs:
        text += "\n" + differences_table(pairs)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_csv(path: str, results: Sequence[RunResult], summaries: Sequence[SettingSummary]) -> None:
    """One row per run (kind "run"), then a "mean" and a "std" row per setting."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in results:
            common = {"backbone": r.backbone, "head": r.head, "batch_average": r.batch_average}
            values = {column: run_value(r, column) for column in SUMMARY_COLUMNS}
            writer.writerow(
                {
                    "kind": "run",
                    "setting": r.setting,
                    **common,
                    "seed": r.seed,
                    "runs": 1,
                    "iterations": r.iterations,
                    **values,
                    "folder": r.folder,
                }
            )
        for s in summaries:
            common = {
                "setting": s.setting,
                "backbone": s.backbone,
                "head": s.head,
                "batch_average": s.batch_average,
                "seed": "",
                "runs": s.runs,
                "iterations": s.iterations,
                "folder": "",
            }
            writer.writerow({"kind": "mean", **common, **s.mean})
            writer.writerow({"kind": "std", **common, **s.std})


def describe(
    cfg,
    config_file: str,
    runs: Sequence[RunSpec],
    backbones: tuple[str, dict] | None = None,
    backbone_seeds: bool = False,
    stop_top1: float | None = None,
) -> str:
    """The paragraph above the results table: what was trained and evaluated, and how to read it;
    ``stop_top1``: the top-1 ``--stop-top1`` put in place of the ``backbones`` file's."""
    config = config_label(config_file)
    seeds = sorted({run.seed for run in runs})
    iterations = sorted({run.iterations for run in runs})
    init = "trained from scratch" if not cfg.MODEL.WEIGHTS else f"trained from `{cfg.MODEL.WEIGHTS}`"
    tool = "tools/compare_norms.py"
    finetuned = any("MODEL.WEIGHTS" in run.train_args for run in runs)
    if finetuned:
        tool += " --finetune"
        init = (
            f"finetuned (stages up to res{cfg.MODEL.BACKBONE.FREEZE_AT} frozen) "
            f"from a ResNet-{cfg.MODEL.RESNETS.DEPTH} "
            f"pretrained with the backbone's norm (FrozenBN: BN) on classification (`{cfg.PRETRAIN.DATA}`, "
            f"{cfg.PRETRAIN.MAX_ITER} iterations at batch {cfg.PRETRAIN.IMS_PER_BATCH}, {cfg.PRETRAIN.IMAGE_SIZE} px; "
            "`tools/pretrain_backbone.py`)"
        )
        if backbones:
            path, best = backbones
            chosen = "; ".join(
                f"{norm}: " + ", ".join(f"{key} {value}" for key, value in overrides.items())
                for norm, overrides in best.items()
            )
            replaced = (
                f", its PRETRAIN.STOP_TOP1 replaced by `--stop-top1 {stop_top1:g}`" if stop_top1 is not None else ""
            )
            init += f", each norm with its PRETRAIN setting in `{path}`{replaced} (`tools/pretrain_grid.py`: {chosen})"
        init += (
            "; each seed from a backbone pretrained with that seed (`--backbone-seeds`: the spread includes the "
            "backbone's draw),"
            if backbone_seeds
            else f"; every seed from the one backbone pretrained with SEED {cfg.SEED} (the spread is the finetuning's "
            "only),"
        )
    title = "Norm settings compared on this machine"
    if finetuned and backbones:
        title = f"Norm settings finetuned from the backbones of `{os.path.basename(backbones[0])}`"
        if stop_top1 is not None:
            title += f", stopped at {stop_top1:g} % top-1"
    return (
        f"### {title} (`{tool}`, measured here)\n\n"
        f"Mask R-CNN R{cfg.MODEL.RESNETS.DEPTH}-FPN (`{config}`: {cfg.INPUT.MIN_SIZE_TEST} px inputs, FPN and "
        f"heads {cfg.MODEL.FPN.OUT_CHANNELS} wide) {init} on `{cfg.DATASETS.TRAIN[0]}` at "
        f"{cfg.SOLVER.IMS_PER_BATCH} images per batch for {', '.join(map(str, iterations))} iterations "
        f"(LR {cfg.SOLVER.BASE_LR}), once per seed ({', '.join(map(str, seeds))}); COCO box and mask AP "
        f"on `{cfg.DATASETS.TEST[0]}`, mean ± sample standard deviation over the seeds. A setting is the "
        "backbone's norm, then that of the FPN and both heads (FrozenBN is the paper's BN†, - no norm). "
        "*Test statistics*: with *batch average (K)*, "
        "the batch-dependent statistics (BN's running statistics, SN's BN branch, DN's) are recomputed from "
        "K training batches before evaluation (`TEST.BATCH_AVERAGE`, the SN paper's batch average; for BN "
        "it replaces the moving average, as detectron2's PreciseBN would); *–*: the setting has none. "
        "s/iter (median over training) and min/run (start-up, training, batch average and evaluation) are "
        f"wall-clock times on {os.cpu_count()} CPU cores, noisy where other work shared the machine."
        + (
            " *Backbone top-1*, where known: the val top-1 of the pretrained backbone the runs started from (one "
            "figure where every seed started from the same one); *backbone iterations*, where a backbone stopped at "
            "a top-1 (PRETRAIN.STOP_TOP1): the pretraining iterations it took; *short of the top-1*: backbones that "
            "never reached it and trained their whole schedule."
            if finetuned
            else ""
        )
    )
