"""What a norm comparison writes: in its output folder the table (with the paragraph of ``report.describe``),
the CSV and the figures of its finished runs, and the table also where ``--publish`` says (a section of
model_zoo/README.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from ...engine.arguments import create_folder_of
from ...engine.trainer import RESULTS_FILE
from ...pretraining.train import RESULTS_FILE as PRETRAINING_RESULTS_FILE
from . import plots, report
from .plan import RunSpec
from .runs import RunResult, is_finished, loss_curve, read_record, read_result

logger = logging.getLogger(__name__)

# what the sweep writes into its output folder
TABLE_FILE, CSV_FILE, AP_PLOT_FILE, CURVES_FILE = "results.md", "results.csv", "ap.png", "loss_curves.png"


def write_outputs(runs: Sequence[RunSpec], output_dir: str, description: str, publish: str | None) -> list[RunResult]:
    """The table, CSV and plots of the finished runs among ``runs`` (nothing before the first one);
    the table also to ``publish`` if given. Returns the results."""
    results = [
        read_result(run.folder, RESULTS_FILE, PRETRAINING_RESULTS_FILE)
        for run in runs
        if is_finished(run.folder, RESULTS_FILE)
    ]
    if not results:
        logger.info("No finished run yet: no table written")
        return results
    order = list(dict.fromkeys(run.setting.name for run in runs))
    summaries = report.summarize(results, order)
    pairs = report.within_backbone_differences(results, order)
    started = [run for run in runs if read_record(run.folder) is not None]
    unfinished = [f"{run.setting.name} seed {run.seed}" for run in started if not is_finished(run.folder, RESULTS_FILE)]
    description = f"{description.rstrip()} {report.code_sentence(results)}"
    os.makedirs(output_dir, exist_ok=True)
    report.write_markdown(os.path.join(output_dir, TABLE_FILE), description, summaries, unfinished, pairs)
    report.write_csv(os.path.join(output_dir, CSV_FILE), results, summaries)
    plots.plot_ap(summaries, results, os.path.join(output_dir, AP_PLOT_FILE))
    curves = {name: {} for name in order}
    for run in runs:
        curves[run.setting.name][run.seed] = loss_curve(run.folder)
    plots.plot_loss_curves(
        {name: seeds for name, seeds in curves.items() if any(seeds.values())}, os.path.join(output_dir, CURVES_FILE)
    )
    if publish:
        create_folder_of(publish)
        report.write_markdown(publish, description, summaries, unfinished, pairs)
    return results
