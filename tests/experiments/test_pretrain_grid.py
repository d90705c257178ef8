"""tools/pretrain_grid.py: bad input refused up front; a cell's config is the one compare_norms --finetune
asks for (so the grid's backbones are the sweep's); the top-1 curve and the iterations to a target; a tiny
2 norms x 2 LR grid end to end (table with the best marked, best.json, a re-run skips done cells, a
removed cell is redone, a killed cell resumes from its checkpoint), and best.json feeding
compare_norms --finetune --backbones; other draws of a best setting beside its cell; --equal-top1
stopping each norm's best where its cell reached the target. The numbers of a few iterations mean
nothing and are not checked."""

import csv
import json
import os
import re
import shutil
import subprocess

import pytest
from tiny_pretraining import pretrain_killed_at, tiny_pretrain_keys

from sn_detection.engine.launch import load_cfg
from sn_detection.experiments import backbones, jobs
from sn_detection.experiments.compare_norms import cli as compare_norms
from sn_detection.experiments.compare_norms import plan as compare_plan
from sn_detection.experiments.compare_norms import report as compare_report
from sn_detection.experiments.compare_norms.plan import Setting, parse_setting
from sn_detection.experiments.pretrain_grid import cli as pretrain_grid
from sn_detection.experiments.pretrain_grid import plan as grid_plan
from sn_detection.experiments.pretrain_grid import publish as grid_publish
from sn_detection.experiments.pretrain_grid import report as grid_report
from sn_detection.experiments.pretrain_grid import results as grid_results
from sn_detection.experiments.pretrain_grid.plan import Cell, cell_cfg, plan_cells
from sn_detection.experiments.pretrain_grid.results import iterations_to_reach
from sn_detection.pretraining import train as pretraining_train
from sn_detection.pretraining.cache import cached_backbone, cached_backbone_folder, cached_backbone_path
from sn_detection.pretraining.top1_stop import top1_curve
from sn_detection.pretraining.train import pretrain

CONFIG = grid_plan.DEFAULT_CONFIG


@pytest.mark.parametrize(
    "arguments, problem",
    [
        (["--norms", "BN,XN"], "--norms: unknown norm(s) ['XN']; valid norms: ["),
        (["--norms", ","], "--norms is empty"),
        (["--lrs", ""], "--lrs is empty: the grid needs at least one value"),
        (["--lrs", "0.1,-0.2"], "--lrs: -0.2 is invalid: each value must be a learning rate > 0"),
        (["--lrs", "0.1,0"], "--lrs: 0 is invalid: each value must be a learning rate > 0"),
        (["--lrs", "0.1,0.1"], "--lrs: values repeat"),
        (["--lrs", "fast"], "--lrs: 'fast' is not a number"),
        (["--warmups", "-1"], "--warmups: -1 is invalid: each value must be an int >= 0"),
        (["--jobs", "0"], "--jobs must be >= 1, got 0"),
        (["--target-top1", "0"], "--target-top1 must be a top-1 in (0, 100] %"),
        (["--publish", os.path.join(CONFIG, "grid.md")], f"{CONFIG} is a file, not a folder"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(arguments, problem, capsys):
    with pytest.raises(SystemExit):
        pretrain_grid.parse_args(arguments)
    assert problem in capsys.readouterr().err


def test_an_evaluation_period_that_metrics_json_would_thin_out_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="PRETRAIN.EVAL_PERIOD=5: metrics.json is written every 20 iterations"):
        pretrain_grid.main(["--output-dir", str(tmp_path), "--plan-only", "PRETRAIN.EVAL_PERIOD", "5"])
    assert list(tmp_path.iterdir()) == []


def test_frozen_bn_is_the_bn_cell_and_cells_are_norms_then_settings():
    args = pretrain_grid.parse_args(["--norms", "FrozenBN,SN,BN", "--lrs", "0.1,0.2", "--warmups", "0,40"])
    assert args.norms == ["BN", "SN"]
    cells = plan_cells(args.norms, args.lrs, args.warmups)
    assert [cell.name for cell in cells[:4]] == [
        "BN-lr0.1-warmup0",
        "BN-lr0.1-warmup40",
        "BN-lr0.2-warmup0",
        "BN-lr0.2-warmup40",
    ]
    assert cells[1].setting == "LR 0.1, warm-up 40" and len(cells) == 8


def test_the_grids_cells_are_the_backbones_the_finetune_sweep_asks_for(tmp_path, monkeypatch):
    """With best.json's overrides, compare_norms --finetune plans exactly the grid's cached backbones
    (FrozenBN from BN's best); with the config's own LR, the grid's cell is the sweep's default backbone."""
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    cfg = load_cfg(CONFIG, ["PRETRAIN.MAX_ITER", "30"])
    cells = {cell.name: cell for cell in plan_cells(["BN", "SN"], [0.1, cfg.PRETRAIN.BASE_LR], [0, 40])}
    best = {
        "BN": {"PRETRAIN.BASE_LR": 0.1, "PRETRAIN.WARMUP_ITERS": 40},
        "SN": {"PRETRAIN.BASE_LR": cfg.PRETRAIN.BASE_LR, "PRETRAIN.WARMUP_ITERS": 0},
    }
    settings = [compare_plan.parse_setting(s) for s in ("FrozenBN/GN", "BN", "SN")]
    configs = compare_plan.pretraining_configs(cfg, settings, best)
    paths = {norm: cached_backbone_path(config) for norm, config in configs.items()}
    bn = cached_backbone_path(cell_cfg(cfg, cells["BN-lr0.1-warmup40"]))
    assert paths == {"FrozenBN": bn, "BN": bn, "SN": cached_backbone_path(cell_cfg(cfg, cells["SN-lr0.2-warmup0"]))}
    assert len({cached_backbone_folder(cell_cfg(cfg, cell)) for cell in cells.values()}) == len(cells)
    # the config's own warm-up and LR: the backbone the sweep finetunes from without --backbones
    default = compare_plan.pretraining_configs(cfg, settings[1:2])["BN"]
    own = Cell("BN", (("PRETRAIN.BASE_LR", cfg.PRETRAIN.BASE_LR), ("PRETRAIN.WARMUP_ITERS", cfg.PRETRAIN.WARMUP_ITERS)))
    assert cached_backbone_path(cell_cfg(cfg, own)) == cached_backbone_path(default)
    with pytest.raises(ValueError, match=r"--backbones: no pretraining setting for BN \(the backbone of FrozenBN\)"):
        compare_plan.pretraining_configs(cfg, settings[:1], {"SN": {}})
    with pytest.raises(ValueError, match="only PRETRAIN keys select a pretraining setting"):
        compare_plan.pretraining_configs(cfg, settings[1:2], {"BN": {"SOLVER.BASE_LR": 0.1}})


def test_backbones_needs_finetune_and_a_best_json(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare_norms.parse_args(["--backbones", str(tmp_path / "best.json")])
    assert "--backbones chooses the pretrained backbones of --finetune" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_norms.parse_args(["--finetune", "--backbones", str(tmp_path / "best.json")])
    error = capsys.readouterr().err
    assert f"--backbones {tmp_path / 'best.json'}: No such file or directory" in error
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(SystemExit):
        compare_norms.parse_args(["--finetune", "--backbones", str(tmp_path / "empty.json")])
    assert "names no norm" in capsys.readouterr().err
    (tmp_path / "best.json").write_text('{"BN": {"PRETRAIN.BASE_LR": 0.4}}')
    args = compare_norms.parse_args(["--finetune", "--backbones", str(tmp_path / "best.json")])
    assert args.backbone_settings == {"BN": {"PRETRAIN.BASE_LR": 0.4}}
    assert args.output_dir == compare_norms.DEFAULT_BEST_OUTPUT_DIR
    assert compare_norms.parse_args(["--finetune"]).output_dir == compare_norms.DEFAULT_FINETUNE_OUTPUT_DIR


def test_stop_top1_puts_one_target_in_place_of_the_files(tmp_path, capsys):
    """--stop-top1 X: every norm's backbone of --backbones stops at X, its other PRETRAIN settings kept."""
    (tmp_path / "equal.json").write_text(
        json.dumps(
            {
                "BN": {"PRETRAIN.BASE_LR": 0.1, "PRETRAIN.STOP_TOP1": 55.0, "PRETRAIN.EVAL_PERIOD": 120},
                "GN": {"PRETRAIN.BASE_LR": 0.2, "PRETRAIN.EVAL_PERIOD": 120},
            }
        )
    )
    common = ["--finetune", "--backbones", str(tmp_path / "equal.json")]
    args = compare_norms.parse_args([*common, "--stop-top1", "45"])
    assert args.backbone_settings == {
        "BN": {"PRETRAIN.BASE_LR": 0.1, "PRETRAIN.STOP_TOP1": 45.0, "PRETRAIN.EVAL_PERIOD": 120},
        "GN": {"PRETRAIN.BASE_LR": 0.2, "PRETRAIN.EVAL_PERIOD": 120, "PRETRAIN.STOP_TOP1": 45.0},
    }
    cfg = load_cfg(CONFIG, [])
    configs = compare_plan.pretraining_configs(
        cfg, [parse_setting("FrozenBN/GN"), parse_setting("GN")], args.backbone_settings
    )
    assert {norm: (c.PRETRAIN.STOP_TOP1, c.PRETRAIN.BASE_LR) for norm, c in configs.items()} == {
        "FrozenBN": (45.0, 0.1),
        "GN": (45.0, 0.2),
    }
    runs = compare_plan.plan_runs(
        cfg, CONFIG, [parse_setting("GN")], [1], str(tmp_path / "sweep"), backbones={("GN", 1): "backbone.pth"}
    )
    text = compare_report.describe(
        cfg, CONFIG, runs, (str(tmp_path / "equal.json"), args.backbone_settings), stop_top1=args.stop_top1
    )
    assert text.startswith("### Norm settings finetuned from the backbones of `equal.json`, stopped at 45 % top-1")
    assert "its PRETRAIN.STOP_TOP1 replaced by `--stop-top1 45`" in text
    for arguments, problem in (
        (["--finetune", "--stop-top1", "45"], "--stop-top1 replaces the PRETRAIN.STOP_TOP1 of --backbones' settings"),
        ([*common, "--stop-top1", "0"], "--stop-top1 must be a top-1 in (0, 100] %, got 0"),
    ):
        with pytest.raises(SystemExit):
            compare_norms.parse_args(arguments)
        assert problem in capsys.readouterr().err


def test_the_top1_curve_counts_iterations_trained_and_keeps_a_resumed_runs_latest(tmp_path):
    rows = [
        {"iteration": 19, "time": 0.5, "total_loss": 3.0},
        {"iteration": 39, "val_top1": 20.0},
        {"iteration": 79, "val_top1": 40.0},  # killed after this evaluation, before its checkpoint
        {"iteration": 79, "val_top1": 41.0},  # the resumed run evaluates again
        {"iteration": 100, "val_top1": 55.0},  # the end (MAX_ITER 100), after the batch average
    ]
    (tmp_path / "metrics.json").write_text("".join(json.dumps(row) + "\n" for row in rows))
    curve = top1_curve(str(tmp_path / "metrics.json"), 100)
    assert curve == [(40, 20.0), (80, 41.0), (100, 55.0)]
    assert [iterations_to_reach(curve, target) for target in (10, 41, 50, 60)] == [40, 80, 100, None]
    assert top1_curve(str(tmp_path / "missing.json"), 100) == []


def test_tiny_grid_runs_resumes_and_feeds_the_finetune_sweep(tmp_path, monkeypatch, capsys, tiny_classification_set):
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    calls, call = [], subprocess.call
    monkeypatch.setattr(jobs.subprocess, "call", lambda command, **kw: calls.append(command) or call(command, **kw))
    output, published = tmp_path / "grid", tmp_path / "grid.md"
    options = [
        "--norms",
        "BN,GN",
        "--lrs",
        "0.1,0.2",
        "--jobs",
        "2",
        "--target-top1",
        "1",
        "--output-dir",
        str(output),
        "--publish",
        str(published),
    ]
    arguments = [*options, "--estimate-steps", "1", *tiny_pretrain_keys(tiny_classification_set)]
    assert pretrain_grid.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "4 cells, 3 iterations each at batch 4; 0 done (in the cache), 4 to run, --jobs 2." in printed
    assert "BN: " in printed and "(1 steps measured now on a random batch, 1 thread(s))" in printed
    names = ["BN-lr0.1", "BN-lr0.2", "GN-lr0.1", "GN-lr0.2"]
    assert sorted(command[command.index("--work-dir") + 1] for command in calls) == [
        str(output / "cells" / name / "training") for name in names
    ]
    assert not any((output / "cells" / name / "training").exists() for name in names)  # moved into the cache

    table = (output / "results.md").read_text()
    assert published.read_text() == table and "| norm | LR 0.1 | LR 0.2 |" in table
    # without --equal-top1 only best.json is published beside the table
    assert sorted(os.listdir(tmp_path)) == ["cache", "grid", "grid.best.json", "grid.md"]
    assert json.loads((tmp_path / "grid.best.json").read_text()) == json.loads((output / "best.json").read_text())
    assert "Each cell is one run (SEED 1)" in table  # a reader is told what one draw per cell can and cannot show
    with open(output / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(row["norm"], row["setting"]) for row in rows] == [
        ("BN", "LR 0.1"),
        ("BN", "LR 0.2"),
        ("GN", "LR 0.1"),
        ("GN", "LR 0.2"),
    ]
    best = json.loads((output / "best.json").read_text())
    for norm in ("BN", "GN"):
        norm_rows = [row for row in rows if row["norm"] == norm]
        top = max(float(row["val_top1"]) for row in norm_rows)
        (marked,) = [row for row in norm_rows if row["best"] == "True"]
        assert float(marked["val_top1"]) == top and best[norm] == {"PRETRAIN.BASE_LR": float(marked["setting"][3:])}
        assert f"| {norm} | {marked['setting']} (best) |" in table
        (matrix_row,) = [line for line in table.splitlines() if line.startswith(f"| {norm} | ") and "LR" not in line]
        assert matrix_row.count("**") == 2  # one setting in bold
    for row in rows:
        assert int(row["iterations"]) == 3 and float(row["wall_s"]) > 0 and float(row["s_per_iter"]) > 0
        # the end is evaluated (EVAL_PERIOD 0): reached at 3 iterations, or not
        assert row["iterations_to_target"] == ("3" if float(row["val_top1"]) >= 1 else "not reached")
    results = json.loads((output / "results.json").read_text())
    assert all(cell["top1_curve"] == [[3, cell["val_top1"]]] for cell in results["cells"])

    # re-run: every cell is in the cache, nothing runs
    calls.clear()
    assert pretrain_grid.main(arguments) == 0
    assert calls == [] and "4 done (in the cache), 0 to run" in capsys.readouterr().out

    # one cell's backbone gone: made again; another killed after its checkpoint at iteration 1: resumed
    cfg = load_cfg(CONFIG, tiny_pretrain_keys(tiny_classification_set))
    redone, killed = Cell("BN", (("PRETRAIN.BASE_LR", 0.1),)), Cell("GN", (("PRETRAIN.BASE_LR", 0.2),))
    for cell in (redone, killed):
        shutil.rmtree(cached_backbone_folder(cell_cfg(cfg, cell)))

    pretrain_killed_at(
        monkeypatch, cell_cfg(cfg, killed), 2, output_dir=str(output / "cells" / killed.name / "training")
    )
    # and before that, a grid was killed with that cell: its attempt never saw its end
    record_path = output / "cells" / killed.name / "cell.json"
    record = json.loads(record_path.read_text())
    log_changed = os.path.getmtime(output / "cells" / killed.name / "pretrain.log")
    record["attempts"].append({"started": log_changed - 12.5, "wall_s": None, "returncode": None, "resumed": False})
    record_path.write_text(json.dumps(record))
    calls.clear()
    assert pretrain_grid.main([*options, "--estimate-steps", "0", *tiny_pretrain_keys(tiny_classification_set)]) == 0
    printed = capsys.readouterr().out
    assert "2 done (in the cache), 2 to run" in printed and "(median of 1 finished cell(s)' metrics.json)" in printed
    assert "iterations still to run (resumed: GN-lr0.2 after 2)," in printed  # its checkpoint at iteration 1
    assert sorted(command[command.index("--work-dir") + 1] for command in calls) == [
        str(output / "cells" / name / "training") for name in ("BN-lr0.1", "GN-lr0.2")
    ]
    records = {
        cell.name: json.loads((output / "cells" / cell.name / "cell.json").read_text()) for cell in (redone, killed)
    }
    assert [a["resumed"] for a in records["BN-lr0.1"]["attempts"]] == [False, False]
    assert [a["resumed"] for a in records["GN-lr0.2"]["attempts"]] == [False, False, True]
    assert [a.get("threads") for a in records["GN-lr0.2"]["attempts"]] == [1, None, 1]  # OMP_NUM_THREADS 1 / 2 jobs
    cut_off = records["GN-lr0.2"]["attempts"][1]
    assert cut_off["interrupted"] and cut_off["wall_s"] == 12.5  # up to its output's end, the log's last change
    assert all(a["wall_s"] > 0 and a["returncode"] == 0 for a in records["GN-lr0.2"]["attempts"][::2])
    assert "iterations 2-3" in (output / "cells" / killed.name / "pretrain.log").read_text()

    # the same output folder with another budget is refused before anything runs
    calls.clear()
    with pytest.raises(SystemExit, match="holds a cell pretrained into .*, not the planned"):
        pretrain_grid.main([*arguments, "PRETRAIN.MAX_ITER", "4"])
    assert calls == []

    # best.json feeds compare_norms --finetune --backbones: each setting from its norm's best backbone
    planned = {}
    original = compare_norms.plan_runs
    monkeypatch.setattr(
        compare_norms, "plan_runs", lambda *a, **kw: planned.update(backbones=a[8]) or original(*a, **kw)
    )
    sweep = [
        "--finetune",
        "--backbones",
        str(output / "best.json"),
        "--settings",
        "FrozenBN/GN",
        "GN",
        "--report-only",
        "--output-dir",
        str(tmp_path / "sweep"),
        *tiny_pretrain_keys(tiny_classification_set),
    ]
    assert compare_norms.main(sweep) == 0
    expected = {
        norm: cached_backbone_path(cell_cfg(cfg, Cell(norm, tuple(best[norm].items())))) for norm in ("BN", "GN")
    }
    seeds = backbones.DEFAULT_SEEDS  # each finetunes the same backbone: the grid's, of the config's SEED
    assert planned["backbones"] == {
        **{("FrozenBN", seed): expected["BN"] for seed in seeds},
        **{("GN", seed): expected["GN"] for seed in seeds},
    }
    assert all(os.path.isfile(path) for path in planned["backbones"].values())


def test_the_table_shows_each_norms_best_setting_drawn_again(tmp_path, monkeypatch, tiny_classification_set):
    """The best setting's backbone pretrained with another SEED (as compare_norms --backbone-seeds makes it)
    is shown beside its cell, with the spread of the draws: how far one cell is from another draw of it."""
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    opts = tiny_pretrain_keys(tiny_classification_set)
    cfg = load_cfg(CONFIG, opts)
    worse, best = (Cell("GN", (("PRETRAIN.BASE_LR", lr),)) for lr in (0.1, 0.2))
    # the draw as compare_norms --finetune --backbones best.json --backbone-seeds --seeds 1 2 asks for it
    per_norm = compare_plan.pretraining_configs(cfg, [Setting("GN", "GN")], {"GN": {"PRETRAIN.BASE_LR": 0.2}})
    second_draw = backbones.backbone_configs(per_norm, [1, 2], per_seed=True)["GN", 2]
    # the grid's cells and one draw of the best, made here with known top-1: in the cache, whoever made them
    for config, top1 in ((cell_cfg(cfg, worse), 30.0), (cell_cfg(cfg, best), 40.0), (second_draw, 36.0)):
        with monkeypatch.context() as patch:
            patch.setattr(pretraining_train, "top1", lambda *args, value=top1: value)
            cached_backbone(config)
    output = tmp_path / "grid"
    arguments = ["--norms", "GN", "--lrs", "0.1,0.2", "--report-only", "--output-dir", str(output), *opts]
    assert pretrain_grid.main(arguments) == 0
    table = (output / "results.md").read_text()
    assert "| norm | setting | SEED 1 (the cell) | SEED 2 | mean ± std |" in table
    assert "| GN | LR 0.2 | 40.00 % | 36.00 % | 38.0 ± 2.8 % |" in table
    assert json.loads((output / "results.json").read_text())["best_draws"] == {"GN": {"1": 40.0, "2": 36.0}}

    # a norm with a cell still to run has no best yet: not in the table, the CSV or the JSON, as best.json
    partial = tmp_path / "partial"
    assert (
        pretrain_grid.main(
            ["--norms", "GN", "--lrs", "0.1,0.2,0.4", "--report-only", "--output-dir", str(partial), *opts]
        )
        == 0
    )
    table = (partial / "results.md").read_text()
    assert re.search(r"\| GN \| 30\.0 % \([^)]*\) \| 40\.0 % \([^)]*\) \| – \|", table) and "(best)" not in table
    with open(partial / "results.csv") as f:
        assert [row["best"] for row in csv.DictReader(f)] == ["False", "False"]
    assert not any(cell["best"] for cell in json.loads((partial / "results.json").read_text())["cells"])
    assert json.loads((partial / "best.json").read_text()) == {}

    # without another draw of a best setting there is no such table
    shutil.rmtree(cached_backbone_folder(second_draw))
    assert pretrain_grid.main(arguments) == 0
    assert "drawn again" not in (output / "results.md").read_text()
    assert json.loads((output / "results.json").read_text())["best_draws"] == {}


def test_a_cell_evaluated_only_at_its_end_bounds_its_first_reach():
    """A cell made elsewhere without PRETRAIN.EVAL_PERIOD (the demo's backbone) has only its final top-1:
    its iterations to a target are a bound (and its equal-top-1 cell is trained, not made from its run:
    ``same_run_stop``, tests/pretraining)."""
    assert grid_results.evaluated_throughout([(20, 30.0), (21, 40.0)], 20, 21)
    assert not grid_results.evaluated_throughout([(21, 40.0)], 20, 21)
    assert not grid_results.evaluated_throughout([(21, 40.0)], 0, 21)
    cell = Cell("SN", (("PRETRAIN.BASE_LR", 0.2),))
    result = {
        "norm": "SN",
        "setting": cell.setting,
        "overrides": dict(cell.overrides),
        "val_top1": 40.0,
        "iterations": 21,
        "wall_s": 60.0,
        "s_per_iter": 1.0,
        "top1_curve": [(21, 40.0)],
        "evaluated_throughout": False,
        "iterations_to_target": 21,
    }
    table = grid_report.markdown("grid", [cell], {cell: result}, 35.0)
    assert "| SN | LR 0.2 (best) | 40.00 % | 21 | 60 s | 1.000 | ≤ 21 (evaluated at the end only) |" in table
    equal, _ = grid_results.equal_top1_cells([cell], {cell: result}, 35.0, 20)
    text = grid_report.equal_markdown(35.0, equal, [], {}, {"SN": result})
    assert "| SN | LR 0.2 | ≤ 21 (evaluated at the end only) | – | not done |  |" in text


def test_an_equal_eval_period_finer_than_the_logs_is_refused(capsys):
    with pytest.raises(SystemExit):
        pretrain_grid.main(["--equal-top1", "--equal-eval-period", "10", "--plan-only"])
    assert "--equal-eval-period must be >= 20 (metrics.json is written every 20 iterations), got 10" in (
        capsys.readouterr().err
    )


def test_the_estimate_counts_the_iterations_a_cell_still_trains():
    """s/iter (the median of the norm's finished cells) x iterations: the config's, or those given (an
    equal-top-1 cell stops where its grid cell reached the target), less those checkpointed; / jobs."""
    cfg = load_cfg(CONFIG, ["PRETRAIN.MAX_ITER", "21"])
    cells = [Cell("GN", (("PRETRAIN.BASE_LR", lr),)) for lr in (0.1, 0.2)]
    configs = {cell: cell_cfg(cfg, cell) for cell in cells}
    finished = [{"norm": "GN", "s_per_iter": 2.0}, {"norm": "GN", "s_per_iter": 4.0}, {"norm": "GN", "s_per_iter": 3.0}]
    seconds, basis = grid_plan.estimate(cells, finished, configs, jobs=2, steps=0)
    assert seconds == 3.0 * 42 / 2 and basis["GN"][0] == 3.0
    done = {cells[0]: 10, cells[1]: 0}.__getitem__
    iterations = {cells[0]: 20, cells[1]: 15}.__getitem__
    assert grid_plan.estimate(cells, finished, configs, 1, 0, done, iterations)[0] == 3.0 * (10 + 15)


def test_pretrainings_own_metrics_give_the_curve(tmp_path, tiny_classification_set):
    """What pretraining logs: an evaluation every EVAL_PERIOD iterations and one at the end."""
    opts = [
        *tiny_pretrain_keys(tiny_classification_set),
        "PRETRAIN.MAX_ITER",
        "21",
        "PRETRAIN.EVAL_PERIOD",
        "20",
        "PRETRAIN.CHECKPOINT_PERIOD",
        "100",
        "PRETRAIN.BASE_LR",
        "0.01",
    ]
    results = pretrain(load_cfg(CONFIG, opts), output_dir=str(tmp_path))
    curve = top1_curve(str(tmp_path / "metrics.json"), 21)
    assert [iterations for iterations, _ in curve] == [20, 21] and curve[-1][1] == results["val_top1"]


SCRIPTED_TOP1 = """from sn_detection.pretraining import train
values = iter({values!r})
train.top1 = lambda *args: next(values)
"""


def scripted_top1_in_jobs(monkeypatch, folder, values):
    """The grid's backbone jobs (subprocesses) evaluate ``values`` in turn, as the cells made in this process
    with a patched top-1: a ``sitecustomize`` on their import path patches it at start-up."""
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(SCRIPTED_TOP1.format(values=list(values)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))


def test_equal_top1_stops_each_norms_best_where_its_cell_reached_the_target(
    tmp_path, monkeypatch, capsys, tiny_classification_set
):
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    opts = [
        *tiny_pretrain_keys(tiny_classification_set),
        "PRETRAIN.MAX_ITER",
        "21",
        "PRETRAIN.EVAL_PERIOD",
        "20",
        "PRETRAIN.CHECKPOINT_PERIOD",
        "100",
        "PRETRAIN.BASE_LR",
        "0.01",
    ]
    cfg = load_cfg(CONFIG, opts)
    grid_cell = Cell("GN", (("PRETRAIN.BASE_LR", 0.1),))
    # the grid's only cell, made here with a known curve (30 % after 20 iterations, 40 % at the end): a cell
    # in the cache is done, whoever made it; the jobs the grid starts see the same curve
    with monkeypatch.context() as patch:
        values = iter([30.0, 40.0])
        patch.setattr(pretraining_train, "top1", lambda *args: next(values))
        cached_backbone(cell_cfg(cfg, grid_cell))
    scripted_top1_in_jobs(monkeypatch, tmp_path / "scripted", [30.0, 40.0])
    calls, call = [], subprocess.call
    monkeypatch.setattr(jobs.subprocess, "call", lambda command, **kw: calls.append(command) or call(command, **kw))
    output = tmp_path / "grid"

    def grid(target, *more_opts, publish=None):
        options = [
            "--norms",
            "GN",
            "--lrs",
            "0.1",
            "--target-top1",
            str(target),
            "--equal-top1",
            "--output-dir",
            str(output),
            "--estimate-steps",
            "0",
            *(["--publish", str(publish)] if publish else []),
            *opts,
            *more_opts,
        ]
        assert pretrain_grid.main(options) == 0
        equal = json.loads((output / "equal_top1.json").read_text())
        return capsys.readouterr().out, (output / "results.md").read_text(), equal

    # reached only at the end: its job copies the best cell's backbone, nothing trains
    printed, table, equal = grid(35)
    assert "Trained to 35 % (--equal-top1): 1 norm(s) with all cells done, 1 to run" in printed
    assert "0 for one made from the grid cell's run" in printed and len(calls) == 1
    assert equal == {"GN": {"PRETRAIN.BASE_LR": 0.1, "PRETRAIN.STOP_TOP1": 35.0, "PRETRAIN.EVAL_PERIOD": 20}}
    # best.json: a draw of the best setting is evaluated as the cell was
    assert json.loads((output / "best.json").read_text()) == {
        "GN": {"PRETRAIN.BASE_LR": 0.1, "PRETRAIN.EVAL_PERIOD": 20}
    }
    assert "| GN | LR 0.1 | 21 | 40.00 % | 40.00 % |" in table
    copy = cached_backbone_folder(cell_cfg(cfg, Cell("GN", tuple(equal["GN"].items()))))
    with open(os.path.join(copy, "results.json")) as f:
        assert json.load(f)["same_run_as"] == cached_backbone_folder(cell_cfg(cfg, grid_cell))
    assert "0 to run" in grid(35)[0]
    calls.clear()

    # reached after 20 iterations: the same run stopped there by its top-1, in a cell of its own
    printed, table, equal = grid(25)
    assert "1 norm(s) with all cells done, 1 to run" in printed
    work_dirs = [command[command.index("--work-dir") + 1] for command in calls]
    assert work_dirs == [str(output / "cells" / "GN-lr0.1-top1-25.0-eval20" / "training")]
    assert equal == {"GN": {"PRETRAIN.BASE_LR": 0.1, "PRETRAIN.STOP_TOP1": 25.0, "PRETRAIN.EVAL_PERIOD": 20}}
    stopped = cell_cfg(cfg, Cell("GN", tuple(equal["GN"].items())))
    with open(os.path.join(cached_backbone_folder(stopped), "results.json")) as f:
        results = json.load(f)
    assert results["iterations"] == 20 and results["schedule_iterations"] == 21 and results["stop_top1_reached"]
    assert "| GN | LR 0.1 | 20 | 30.00 % | 40.00 % |" in table  # the final evaluation: the script's 40 %
    calls.clear()
    assert "0 to run" in grid(25)[0] and calls == []

    # a grid cell that kept its models (PRETRAIN.KEEP_EVALUATED_MODELS): an equal cell that stops after 20
    # iterations is made by its job from the model kept there; nothing trains
    shutil.rmtree(cached_backbone_folder(cell_cfg(cfg, grid_cell)))
    keep = ("PRETRAIN.KEEP_EVALUATED_MODELS", "True")
    with monkeypatch.context() as patch:
        values = iter([30.0, 40.0])
        patch.setattr(pretraining_train, "top1", lambda *args: next(values))
        cached_backbone(cell_cfg(load_cfg(CONFIG, [*opts, *keep]), grid_cell))
    (tmp_path / "stop28.json").write_text(
        json.dumps({"GN": {"PRETRAIN.BASE_LR": 0.1, "PRETRAIN.STOP_TOP1": 28.0, "PRETRAIN.EVAL_PERIOD": 20}})
    )
    sweep = [
        "--finetune",
        "--backbones",
        str(tmp_path / "stop28.json"),
        "--settings",
        "GN",
        "--plan-only",
        "--output-dir",
        str(tmp_path / "sweep28"),
        *opts,
    ]
    assert compare_norms.main(sweep) == 0
    assert (
        "  GN, SEED 1: made without training from the cached run it cuts short (top-1 28 % first reached after "
        f"20 iterations): {cached_backbone_folder(cell_cfg(cfg, grid_cell))}"
    ) in capsys.readouterr().out
    calls.clear()
    printed, table, equal = grid(28, *keep)
    assert "0 for one made from the grid cell's run" in printed
    assert [command[command.index("--work-dir") + 1] for command in calls] == [
        str(output / "cells" / "GN-lr0.1-top1-28.0-eval20" / "training")
    ]
    made = cached_backbone_folder(cell_cfg(cfg, Cell("GN", tuple(equal["GN"].items()))))
    with open(os.path.join(made, "results.json")) as f:
        results = json.load(f)
    assert results["iterations"] == 20 and results["stop_top1_reached"]
    assert results["same_run_as"] == cached_backbone_folder(cell_cfg(cfg, grid_cell))
    assert "| GN | LR 0.1 | 20 | 30.00 % |" in table
    assert json.loads((output / "best.json").read_text()) == {
        "GN": {"PRETRAIN.BASE_LR": 0.1, "PRETRAIN.EVAL_PERIOD": 20, "PRETRAIN.KEEP_EVALUATED_MODELS": True}
    }

    # not reached
    printed, table, equal = grid(50)
    assert "not reached by: GN" in printed and equal == {}
    assert "| GN | LR 0.1 | not reached in 21 | best 40.00 % |" in table

    # without --target-top1: the lowest best, rounded down, once every norm's cells are done
    two_norms = [
        "--norms",
        "GN,BN",
        "--lrs",
        "0.1",
        "--equal-top1",
        "--output-dir",
        str(output),
        "--estimate-steps",
        "0",
        "--plan-only",
        *opts,
    ]
    assert pretrain_grid.main(two_norms) == 0
    assert "that target is known once every norm's cells are done" in capsys.readouterr().out
    with monkeypatch.context() as patch:
        values = iter([50.0, 52.5])
        patch.setattr(pretraining_train, "top1", lambda *args: next(values))
        cached_backbone(cell_cfg(cfg, Cell("BN", (("PRETRAIN.BASE_LR", 0.1),))))
    assert pretrain_grid.main(two_norms) == 0
    printed = capsys.readouterr().out  # GN reached 40 % at the end (its best itself), BN after 20 iterations
    assert "Trained to 40 % (--equal-top1): 2 norm(s) with all cells done, 2 to run" in printed
    assert "  BN-lr0.1-top1-40.0-eval20: to run" in printed and "  GN-lr0.1-top1-40.0-eval20: to run" in printed
    # checked more often than the grid evaluated: cells of their own, which train
    assert pretrain_grid.main(["--equal-eval-period", "40", *two_norms]) == 0
    printed = capsys.readouterr().out
    assert "  BN-lr0.1-top1-40.0-eval40: to run" in printed and "  GN-lr0.1-top1-40.0-eval40: to run" in printed

    # equal_top1.json feeds compare_norms --finetune --backbones as best.json does; published, both settings
    # files lie beside the table, so that a sweep needs the repository only, not the grid's output
    published = tmp_path / "zoo" / "1_grid.md"  # its folder made by the grid
    grid(25, publish=published)
    assert sorted(os.listdir(published.parent)) == ["1_grid.best.json", "1_grid.equal_top1.json", "1_grid.md"]
    for name in ("best.json", "equal_top1.json"):
        assert json.loads((published.parent / f"1_grid.{name}").read_text()) == json.loads((output / name).read_text())
    planned = {}
    original = compare_norms.plan_runs
    monkeypatch.setattr(
        compare_norms, "plan_runs", lambda *a, **kw: planned.update(backbones=a[8]) or original(*a, **kw)
    )
    sweep = [
        "--finetune",
        "--backbones",
        str(published.parent / "1_grid.equal_top1.json"),
        "--settings",
        "GN",
        "--report-only",
        "--output-dir",
        str(tmp_path / "sweep"),
        *opts,
    ]
    assert compare_norms.main(sweep) == 0
    assert planned["backbones"] == {("GN", seed): cached_backbone_path(stopped) for seed in backbones.DEFAULT_SEEDS}

    # compare_norms --backbone-seeds draws of an equal-top-1 setting stop at the target too, each after its
    # own iterations: the grid shows them, and the spread of the iterations of those that reached it
    draws = backbones.backbone_configs({"GN": stopped}, [2, 3], per_seed=True)
    assert [(c.SEED, c.PRETRAIN.STOP_TOP1) for c in draws.values()] == [(2, 25.0), (3, 25.0)]
    for config, curve in zip(draws.values(), ([20.0, 27.0], [24.0, 24.0])):
        with monkeypatch.context() as patch:
            values = iter(curve)
            patch.setattr(pretraining_train, "top1", lambda *args: next(values))
            cached_backbone(config)
    table = grid(25)[1]
    assert "| norm | setting | SEED 1 (the cell) | SEED 2 | SEED 3 | iterations, mean ± std |" in table
    assert "| GN | LR 0.1 | 20, 40.0 % | 21 (at the end), 27.0 % | 21 (not reached), 24.0 % | 20 ± 1 |" in table
    assert json.loads((output / "results.json").read_text())["equal_top1_draws"] == {
        "GN": {
            "1": {"iterations": 20, "val_top1": 40.0, "reached": True},
            "2": {"iterations": 21, "val_top1": 27.0, "reached": True},  # at the end
            "3": {"iterations": 21, "val_top1": 24.0, "reached": False},
        }
    }


def test_the_published_settings_files_are_the_published_grids_choice():
    """model_zoo/sections/1_pretrain_grid.{best,equal_top1}.json, which sweeps on a machine without the grid's
    output read, name each norm's setting in bold in the published grid, and the published equal-top-1 target."""
    from sn_detection.model_zoo import SECTIONS_DIR

    table_path = os.path.join(SECTIONS_DIR, "1_pretrain_grid.md")
    settings = grid_publish.published_settings(table_path)
    table = open(table_path).read()
    with open(settings["best.json"]) as f:
        best = json.load(f)
    with open(settings["equal_top1.json"]) as f:
        equal = json.load(f)
    header = next(line for line in table.splitlines() if line.startswith("| norm | LR "))
    lrs = [float(column.strip()[3:]) for column in header.strip("|").split("|")[1:]]
    bold = {}
    for line in table.splitlines():
        columns = [column.strip() for column in line.strip("|").split("|")]
        if len(columns) == len(lrs) + 1 and columns[0] in grid_plan.DEFAULT_NORMS:
            (chosen,) = [lr for lr, column in zip(lrs, columns[1:]) if column.startswith("**")]
            bold[columns[0]] = chosen
    assert list(bold) == list(grid_plan.DEFAULT_NORMS) == list(best) == list(equal)
    (target,) = re.findall(r"#### Trained to (\d+) %", table)
    for norm, lr in bold.items():
        periodic = {"PRETRAIN.EVAL_PERIOD": 120, "PRETRAIN.KEEP_EVALUATED_MODELS": True}
        assert best[norm] == {"PRETRAIN.BASE_LR": lr, **periodic}
        assert equal[norm] == {"PRETRAIN.BASE_LR": lr, "PRETRAIN.STOP_TOP1": float(target), "PRETRAIN.EVAL_PERIOD": 120}
    assert "PRETRAIN.EVAL_PERIOD 120" in table  # the period the files name is the grid's
