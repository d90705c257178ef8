"""The command line of tools/pretrain_grid.py: its options, checked before anything runs, and the grid run in
order: plan and estimate, the cells, the equal-top-1 cells once their norms are settled, the outputs after each
(the package's docstring says what each does and why)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence

from ...engine.arguments import output_file
from ...pretraining.cache import cached_backbone_folder, same_run_stop
from ...pretraining.train import LOG_PERIOD
from .plan import (
    DEFAULT_CONFIG,
    DEFAULT_ESTIMATE_STEPS,
    DEFAULT_LRS,
    DEFAULT_NORMS,
    DEFAULT_OUTPUT_DIR,
    Cell,
    cell_cfg,
    check_cell_folders,
    parse_norms,
    parse_values,
    plan_grid,
    print_estimate,
)
from .publish import BEST_FILE
from .report import describe, periodic_settings, write_outputs
from .results import (
    best_draws,
    cell_draws,
    cell_result,
    equal_top1_cells,
    iterations_to_reach,
    lowest_best_top1,
    settled_best_cells,
)
from .run import run_cells

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Pretrain every norm's backbone under a grid of PRETRAIN settings at one budget, into the "
        "backbone cache that tools/compare_norms.py --finetune reads; resumable by running it again."
    )
    parser.add_argument("--config-file", default=DEFAULT_CONFIG, metavar="FILE", help="default: %(default)s")
    parser.add_argument("--norms", default=",".join(DEFAULT_NORMS), help="comma-separated (default: %(default)s)")
    parser.add_argument(
        "--lrs",
        default=",".join(map(str, DEFAULT_LRS)),
        help="PRETRAIN.BASE_LR values, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--warmups", help="PRETRAIN.WARMUP_ITERS values, comma-separated (default: the config's)")
    parser.add_argument(
        "--target-top1",
        type=float,
        metavar="X",
        help="report the first evaluated iteration at which val top-1 reached X %%",
    )
    parser.add_argument(
        "--equal-top1",
        action="store_true",
        help="then train each norm's best setting again, stopped where its top-1 first reaches "
        "--target-top1 (default: the lowest best top-1, rounded down to a whole percent, once every "
        "norm's cells are done; PRETRAIN.STOP_TOP1 checked every --equal-eval-period), and write "
        "equal_top1.json for compare_norms",
    )
    parser.add_argument(
        "--equal-eval-period",
        type=int,
        metavar="N",
        help=f"with --equal-top1: check the stop every N iterations (>= {LOG_PERIOD}; default: the "
        "grid's PRETRAIN.EVAL_PERIOD, whose cells' kept models then give the equal cells without "
        "training)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="cells at once, the threads split between them (default: 1)"
    )
    parser.add_argument(
        "--estimate-steps",
        type=int,
        default=DEFAULT_ESTIMATE_STEPS,
        metavar="K",
        help="steps measured per norm without a finished cell for the estimate; 0: none (default: %(default)s)",
    )
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help="default: %(default)s")
    parser.add_argument(
        "--publish",
        metavar="FILE",
        type=output_file,
        help="also write the markdown table here, and beside it best.json (and equal_top1.json) as "
        "FILE's name with .best.json (.equal_top1.json) for .md",
    )
    parser.add_argument("--plan-only", action="store_true", help="print the plan and the estimate, run nothing")
    parser.add_argument("--report-only", action="store_true", help="only write the outputs of the done cells")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides for every cell")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.estimate_steps < 0:
        parser.error(f"--estimate-steps must be >= 0, got {args.estimate_steps}")
    if args.equal_eval_period is not None and args.equal_eval_period < LOG_PERIOD:
        parser.error(
            f"--equal-eval-period must be >= {LOG_PERIOD} (metrics.json is written every {LOG_PERIOD} "
            f"iterations), got {args.equal_eval_period}"
        )
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


def checked(function, *args):
    """``function(*args)``, a ValueError (a bad value, a folder that holds another cell) an exit with its message."""
    try:
        return function(*args)
    except ValueError as error:
        raise SystemExit(f"pretrain_grid: error: {error}") from None


class Grid:
    """A grid as the command line gives it: the loaded config, its cells and each cell's config, to which the
    equal-top-1 cells are added once planned (``plan_equal``)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cfg, self.cells, self.configs = plan_grid(args)
        check_cell_folders(args.output_dir, self.cells, self.configs)

    def results(self, extra: Sequence[Cell] = ()) -> dict:
        """{cell: its result} of the done cells among the grid's and ``extra``."""
        for cell in extra:
            self.configs.setdefault(cell, cell_cfg(self.cfg, cell))
        found = {
            cell: cell_result(self.args.output_dir, cell, self.configs[cell], self.args.target_top1)
            for cell in (*self.cells, *extra)
        }
        return {cell: result for cell, result in found.items() if result is not None}

    def plan_equal(self) -> tuple[dict[str, Cell], list[str]] | None:
        """The --equal-top1 cells of the norms settled so far (their configs and folders checked) and the norms
        whose best never reached the target, or None (no --equal-top1, or its target still unknown). The target,
        once known, is kept in ``args.target_top1``."""
        args = self.args
        if not args.equal_top1:
            return None
        results = self.results()
        if args.target_top1 is None:
            args.target_top1 = lowest_best_top1(self.cells, results, len(args.norms))
            if args.target_top1 is None:
                return None
        period = args.equal_eval_period or self.cfg.PRETRAIN.EVAL_PERIOD
        equal = equal_top1_cells(self.cells, results, args.target_top1, period)
        planned = list(equal[0].values())
        for cell in planned:
            self.configs.setdefault(cell, cell_cfg(self.cfg, cell))
        check_cell_folders(args.output_dir, planned, self.configs)
        return equal

    def draws(self, settled: dict[str, dict]) -> dict:
        return best_draws(settled, self.cells, self.configs, self.cfg.SEED)

    def equal_draws(self, chosen: dict[str, Cell]) -> dict:
        return cell_draws({norm: self.configs[cell] for norm, cell in chosen.items()}, self.cfg.SEED)

    def write(self) -> dict:
        """The outputs of what is done (``report.write_outputs``); returns best.json's content."""
        args, equal = self.args, self.plan_equal()
        results = self.results(list(equal[0].values()) if equal else ())
        description = describe(self.cfg, args.config_file, self.cells, args.target_top1)
        return write_outputs(
            args.output_dir,
            description,
            self.cells,
            results,
            args.target_top1,
            args.publish,
            equal,
            draws=self.draws,
            equal_draws=self.equal_draws,
            equal_seed=self.cfg.SEED,
            periodic=periodic_settings(self.cfg),
        )

    def run(self, cells: Sequence[Cell]) -> list[Cell]:
        """Runs ``cells`` (``run.run_cells``), the outputs written after each; returns those that failed."""
        if not cells:
            return []
        return run_cells(
            cells,
            self.args.output_dir,
            os.path.abspath(self.args.config_file),
            list(self.args.opts),
            self.configs,
            self.args.jobs,
            after_each=self.write,
        )


def print_plan(grid: Grid, results: dict, todo: Sequence[Cell]) -> None:
    """The cells done and to run, and the estimate of those to run."""
    args, cfg = grid.args, grid.cfg
    norms, settings = len(args.norms), len(grid.cells) // len(args.norms)
    print(
        f"Pretraining grid: {norms} norm(s) x {settings} setting(s) = {len(grid.cells)} cells, "
        f"{cfg.PRETRAIN.MAX_ITER} iterations each at batch {cfg.PRETRAIN.IMS_PER_BATCH}; {len(results)} done "
        f"(in the cache), {len(todo)} to run, --jobs {args.jobs}.",
        flush=True,
    )
    if todo and not args.report_only:
        print_estimate(f"the {len(todo)} cell(s) to run", todo, results, grid.configs, args)


def print_equal_plan(grid: Grid, equal: tuple[dict[str, Cell], list[str]] | None, results: dict) -> None:
    """The --equal-top1 cells: to run once the target is known, or done and to run, with the estimate of those
    to run (each stops where its grid cell first reached the target)."""
    args = grid.args
    if equal is None:
        print(
            "Trained to the lowest best top-1 (--equal-top1): that target is known once every norm's cells are done.",
            flush=True,
        )
        return
    equal_todo = [cell for cell in equal[0].values() if cell not in grid.results(list(equal[0].values()))]
    print(
        f"Trained to {args.target_top1:g} % (--equal-top1): {len(equal[0])} norm(s) with all cells done, "
        f"{len(equal_todo)} to run; not reached by: {', '.join(equal[1]) or 'none'}.",
        flush=True,
    )
    if equal_todo and not args.report_only:
        settled = settled_best_cells(grid.cells, results)
        expected = {
            cell: 0
            if same_run_stop(grid.configs[cell])
            else iterations_to_reach(settled[cell.norm]["top1_curve"], args.target_top1)
            for cell in equal_todo
        }
        print_estimate(
            "the equal-top-1 cell(s) to run",
            equal_todo,
            results,
            grid.configs,
            args,
            expected,
            f"where their grid cell reached {args.target_top1:g} %; 0 for one made from the grid cell's run",
        )


def print_cells(grid: Grid, equal: tuple[dict[str, Cell], list[str]] | None) -> None:
    """--plan-only: every cell, done or to run, and its cache folder."""
    planned = grid.cells + (list(equal[0].values()) if equal else [])
    done = grid.results(planned[len(grid.cells) :])
    for cell in planned:
        print(
            f"  {cell.name}: {'done' if cell in done else 'to run'} ({cached_backbone_folder(grid.configs[cell])})",
            flush=True,
        )


def run_grid(grid: Grid, todo: Sequence[Cell]) -> list[Cell]:
    """The cells to run, then the equal-top-1 cells of the norms settled so far, those just settled too;
    returns the cells that failed."""
    failed = grid.run(todo)
    equal = grid.plan_equal()
    if equal is not None:
        done = grid.results(list(equal[0].values()))
        failed += grid.run([cell for cell in equal[0].values() if cell not in done])
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    """Returns the exit status: 1 if a cell failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s pretrain_grid] %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    grid = checked(Grid, args)
    results = grid.results()
    todo = [cell for cell in grid.cells if cell not in results]
    print_plan(grid, results, todo)
    equal = checked(grid.plan_equal)
    if args.equal_top1:
        print_equal_plan(grid, equal, results)
    if args.plan_only:
        print_cells(grid, equal)
        return 0
    failed = [] if args.report_only else run_grid(grid, todo)
    best = grid.write()
    logger.info(
        "%d of %d cells done; results in %s; best settings (%s): %s",
        len(grid.results()),
        len(grid.cells),
        args.output_dir,
        BEST_FILE,
        best,
    )
    if failed:
        logger.error("failed cells: %s", ", ".join(cell.name for cell in failed))
    return 1 if failed else 0
