"""Running a pretraining grid: its cells as backbone jobs (``jobs.execute_job``), ``--jobs`` at a time."""

from __future__ import annotations

import logging
import os

from ...pretraining.cache import cached_backbone_folder, is_cached
from ...pretraining.train import trained_iterations
from ..backbones import override_list
from ..jobs import JOB_LOG, backbone_command, execute_job, run_jobs
from .plan import Cell, cell_folder

logger = logging.getLogger(__name__)


def run_cells(todo, output_dir, config_file, opts, configs, jobs: int, after_each=None) -> list[Cell]:
    """Runs the cells ``todo`` as backbone jobs (``jobs.execute_job``), ``jobs`` at a time in order;
    returns those that failed."""

    def run(cell: Cell) -> bool:
        folder, cache = cell_folder(output_dir, cell), cached_backbone_folder(configs[cell])
        logger.info(
            "%s: pretraining %d iterations (log: %s)",
            cell.name,
            trained_iterations(configs[cell]),
            os.path.join(folder, JOB_LOG),
        )
        command = backbone_command(config_file, [*opts, *override_list(dict(cell.overrides))], cell.norm, folder, cache)
        record = {"norm": cell.norm, "overrides": dict(cell.overrides), "cache_folder": cache}
        return execute_job(command, folder, record, jobs)

    return run_jobs(
        todo,
        run,
        jobs,
        done=lambda cell: is_cached(configs[cell]),
        name=lambda cell: cell.name,
        log_of=lambda cell: os.path.join(cell_folder(output_dir, cell), JOB_LOG),
        after_each=after_each,
        outcome=lambda cell: f"done, backbone in {cached_backbone_folder(configs[cell])}",
    )
