"""tools/compare_norms.py's machinery: settings, planning, and a tiny sweep end to end (tables, CSV and
plots written; a second invocation skips finished runs and resumes an unfinished one; a failed run
does not stop the others). The numbers of a few iterations mean nothing and are not checked."""

import csv
import dataclasses
import json
import os
import re
import subprocess
import time

import pytest
import yaml
from tiny_pretraining import pretrain_killed_at, tiny_pretrain_keys

from sn_detection.engine.launch import load_cfg
from sn_detection.engine.trainer import RESULTS_FILE
from sn_detection.experiments import backbones, labels
from sn_detection.experiments.compare_norms import cli as compare_norms
from sn_detection.experiments.compare_norms import plan as compare_plan
from sn_detection.experiments.compare_norms import report as compare_report
from sn_detection.experiments.compare_norms import run as compare_run
from sn_detection.experiments.compare_norms.plan import Setting, parse_setting, plan_runs, scaled_schedule
from sn_detection.experiments.compare_norms.runs import read_record
from sn_detection.experiments.jobs import child_environment, code_version
from sn_detection.pretraining import cache as pretraining_cache

CONFIG = compare_plan.DEFAULT_CONFIG
# Few iterations of a shrunk model, and an evaluation that takes seconds.
TINY = [
    "INPUT.MIN_SIZE_TRAIN", "(64,)", "INPUT.MAX_SIZE_TRAIN", "96", "INPUT.MIN_SIZE_TEST", "64",
    "INPUT.MAX_SIZE_TEST", "96", "MODEL.RPN.PRE_NMS_TOPK_TEST", "100", "MODEL.RPN.POST_NMS_TOPK_TEST", "16",
    "TEST.DETECTIONS_PER_IMAGE", "5", "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0", "DATALOADER.NUM_WORKERS", "0",
]  # fmt: skip
SWEEP = ["--settings", "GN", "BN/GN", "--seeds", "7", "--iters", "2", "--batch-average-batches", "1"]


def test_settings_name_the_backbone_then_fpn_and_heads():
    assert parse_setting("SN") == Setting("SN", "SN")
    mixed = parse_setting("SN/GN")
    assert (mixed.backbone, mixed.head, mixed.name, mixed.folder_name) == ("SN", "GN", "SN/GN", "SN-GN")
    assert mixed.norm_overrides() == [
        "MODEL.RESNETS.NORM", "SN", "MODEL.FPN.NORM", "GN", "MODEL.ROI_BOX_HEAD.NORM", "GN",
        "MODEL.ROI_MASK_HEAD.NORM", "GN",
    ]  # fmt: skip


def test_a_config_of_the_package_is_named_by_its_checkout_path(tmp_path):
    """The default config (model_zoo's), the checkout's file reached by another path, the same config in
    another checkout (a worktree at the commit a sweep runs) and in an installed package read the same."""
    name = "configs/demo_compare_norms.yaml"
    assert labels.config_label(CONFIG) == name
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert labels.config_label(os.path.join(repo, "tools", "..", name)) == name
    (tmp_path / "worktree" / "sn_detection").mkdir(parents=True)
    assert labels.config_label(str(tmp_path / "worktree" / name)) == name
    installed = tmp_path / "site" / "sn_detection" / "configs" / "lazy" / "mask_rcnn_sn_2x.py"
    assert labels.config_label(str(installed)) == "configs/lazy/mask_rcnn_sn_2x.py"
    # any other config as given, a folder named configs included
    for elsewhere in (str(tmp_path / "mine.yaml"), str(tmp_path / "mine" / name)):
        assert labels.config_label(elsewhere) == elsewhere


@pytest.mark.parametrize("text", ["XN", "SN/GN/BN", "SN/", ""])
def test_a_bad_setting_lists_the_valid_norms(text):
    with pytest.raises(ValueError, match=r"expected NORM or BACKBONE/HEAD with norms from \[.*'SN'.*'BN'"):
        parse_setting(text)


def test_the_schedule_is_scaled_from_the_config():
    cfg = load_cfg(CONFIG, ["SOLVER.MAX_ITER", "400", "SOLVER.STEPS", "(300, 360)", "SOLVER.WARMUP_ITERS", "50"])
    half = ["SOLVER.MAX_ITER", "200", "SOLVER.STEPS", "(150, 180)", "SOLVER.WARMUP_ITERS", "25"]
    assert scaled_schedule(cfg, 200) == half
    # steps that would land on the last iteration or later are dropped
    assert scaled_schedule(cfg, 4)[:4] == ["SOLVER.MAX_ITER", "4", "SOLVER.STEPS", "(3,)"]
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        scaled_schedule(cfg, 0)


def test_batch_average_exactly_for_settings_with_batch_statistics(tmp_path):
    cfg = load_cfg(CONFIG, [])
    settings = [parse_setting(s) for s in compare_plan.DEFAULT_SETTINGS]
    runs = plan_runs(cfg, CONFIG, settings, [1, 2], str(tmp_path), batch_average_batches=5)
    averaged = {run.setting.name: run.batch_average for run in runs}
    assert averaged == {"BN": 5, "GN": 0, "SN": 5, "DN": 5, "MGN": 0, "SN/GN": 5, "GN/SN": 5}
    assert [(run.setting.name, run.seed) for run in runs[:3]] == [("BN", 1), ("GN", 1), ("SN", 1)]
    sn_gn = next(run for run in runs if run.setting.name == "SN/GN" and run.seed == 2)
    assert sn_gn.folder == str(tmp_path / "SN-GN" / "seed2")
    assert sn_gn.iterations == cfg.SOLVER.MAX_ITER
    args = sn_gn.train_args
    assert args[args.index("TEST.BATCH_AVERAGE.ENABLED") + 1] == "True" and args[args.index("SEED") + 1] == "2"
    assert "SOLVER.MAX_ITER" not in args  # the config's own schedule
    off = plan_runs(cfg, CONFIG, settings[:1], [1], str(tmp_path), batch_average_batches=0)
    assert off[0].batch_average == 0


def test_repeated_or_negative_seeds_are_refused(tmp_path):
    cfg = load_cfg(CONFIG, [])
    with pytest.raises(ValueError, match="must not repeat"):
        plan_runs(cfg, CONFIG, [Setting("GN", "GN")], [1, 1], str(tmp_path))
    with pytest.raises(ValueError, match="seeds must be >= 0"):
        plan_runs(cfg, CONFIG, [Setting("GN", "GN")], [-1], str(tmp_path))


def test_a_folder_not_made_by_the_sweep_is_refused(tmp_path):
    (tmp_path / "GN" / "seed1").mkdir(parents=True)
    (tmp_path / "GN" / "seed1" / "model_final.pth").write_bytes(b"")
    with pytest.raises(SystemExit, match="not made by this sweep"):
        compare_norms.main(["--settings", "GN", "--seeds", "1", "--output-dir", str(tmp_path)])


@pytest.fixture
def train_net_calls(monkeypatch):
    """The train_net commands the sweep starts (they still run); one intra-op thread, several times
    faster than two for these tiny models on a busy machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    calls, call = [], subprocess.call

    def counting_call(command, **kwargs):
        if "sn_detection.engine.train_net" in command:  # not the backbones' pretraining
            calls.append(command)
        return call(command, **kwargs)

    monkeypatch.setattr(compare_run.subprocess, "call", counting_call)
    return calls


def output_dirs_of(calls):
    return [command[command.index("OUTPUT_DIR") + 1] for command in calls]


def test_tiny_sweep_writes_its_outputs_and_resumes(tmp_path, train_net_calls):
    output_dir, published = tmp_path / "sweep", tmp_path / "zoo" / "compare_norms.md"  # a folder yet to make
    arguments = [*SWEEP, "--output-dir", str(output_dir), "--publish", str(published), *TINY]
    assert compare_norms.main(arguments) == 0
    gn, bn_gn = str(output_dir / "GN" / "seed7"), str(output_dir / "BN-GN" / "seed7")
    assert output_dirs_of(train_net_calls) == [gn, bn_gn]

    # each run trained the planned model: the norms reached train_net's config
    with open(os.path.join(bn_gn, "config.yaml")) as f:
        model = yaml.safe_load(f)["MODEL"]
    assert (model["RESNETS"]["NORM"], model["FPN"]["NORM"], model["ROI_MASK_HEAD"]["NORM"]) == ("BN", "GN", "GN")

    table = (output_dir / "results.md").read_text()
    assert "| GN | GN | GN | – (none) | 1 |" in table and "| BN/GN | BN | GN | batch average (1) | 1 |" in table
    ran = re.sub(r"([0-9a-f]{12})[0-9a-f]{28}", r"\1", code_version())  # the table quotes a commit short
    assert f"*Code*: every run on {ran}." in table  # what the runs' records say they ran
    assert published.read_text() == table
    with open(output_dir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(row["kind"], row["setting"]) for row in rows] == [
        ("run", "GN"),
        ("run", "BN/GN"),
        ("mean", "GN"),
        ("std", "GN"),
        ("mean", "BN/GN"),
        ("std", "BN/GN"),
    ]
    assert float(rows[0]["wall_s"]) > 0 and float(rows[0]["iterations"]) == 2
    for name in ("ap.png", "loss_curves.png"):
        assert (output_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # interrupted after training the second run: it is resumed (evaluation only), the first is skipped
    finished_at = os.path.getmtime(os.path.join(gn, RESULTS_FILE))
    os.remove(os.path.join(bn_gn, RESULTS_FILE))
    train_net_calls.clear()
    assert compare_norms.main(arguments) == 0
    assert output_dirs_of(train_net_calls) == [bn_gn]
    assert os.path.getmtime(os.path.join(gn, RESULTS_FILE)) == finished_at
    assert [a["resumed"] for a in read_record(bn_gn)["attempts"]] == [False, True]
    with open(os.path.join(bn_gn, "metrics.json")) as f:
        trained_iterations = [json.loads(line)["iteration"] for line in f if "total_loss" in line]
    assert trained_iterations == [1]  # not trained again

    # the same folder with another budget is refused before anything runs
    train_net_calls.clear()
    changed = [*arguments]
    changed[changed.index("--iters") + 1] = "3"
    with pytest.raises(SystemExit, match="other train_net arguments than planned"):
        compare_norms.main(changed)
    assert train_net_calls == []


def test_a_failed_run_does_not_stop_the_sweep(tmp_path, train_net_calls):
    cfg = load_cfg(CONFIG, [])
    planned = plan_runs(cfg, CONFIG, [Setting("GN", "GN"), Setting("SN", "SN")], [1], str(tmp_path))
    # both fail fast (an unknown config key), each after its own train_net start
    broken = [dataclasses.replace(run, train_args=(*run.train_args, "MODEL.NO_SUCH_KEY", "1")) for run in planned]
    assert compare_run.run_sweep(broken) == broken
    assert output_dirs_of(train_net_calls) == [run.folder for run in planned]
    for run in broken:
        (attempt,) = read_record(run.folder)["attempts"]
        assert attempt["returncode"] != 0
        assert "NO_SUCH_KEY" in open(os.path.join(run.folder, compare_run.TRAIN_LOG)).read()


def test_jobs_run_at_once_on_their_share_of_the_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert [child_environment(jobs)["OMP_NUM_THREADS"] for jobs in (1, 2, 3, 8)] == ["4", "2", "1", "1"]
    spans, call = {}, subprocess.call

    def timed_call(command, **kwargs):
        start = time.monotonic()
        returncode = call(command, **kwargs)
        spans[command[command.index("OUTPUT_DIR") + 1]] = (start, time.monotonic(), kwargs["env"]["OMP_NUM_THREADS"])
        return returncode

    monkeypatch.setattr(compare_run.subprocess, "call", timed_call)
    cfg = load_cfg(CONFIG, [])
    planned = plan_runs(
        cfg, CONFIG, [Setting("GN", "GN"), Setting("SN", "SN"), Setting("BN", "BN")], [1], str(tmp_path)
    )
    # each fails after its interpreter has started (an unknown config key): seconds, long enough to overlap
    broken = [dataclasses.replace(run, train_args=(*run.train_args, "MODEL.NO_SUCH_KEY", "1")) for run in planned]
    assert compare_run.run_sweep(broken, jobs=2) == broken
    (first, second, third) = (spans[run.folder] for run in broken)
    assert second[0] < first[1] and third[0] >= min(first[1], second[1])  # two at a time, in plan order
    assert {span[2] for span in spans.values()} == {"2"}
    assert [read_record(run.folder)["attempts"][0]["threads"] for run in broken] == [2, 2, 2]  # what it ran on
    assert {read_record(run.folder)["attempts"][0]["code"] for run in broken} == {code_version()}  # and which code
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        compare_run.run_sweep(broken, jobs=0)


def test_a_no_norm_head_is_a_setting():
    setting = parse_setting("FrozenBN/-")
    assert (setting.backbone, setting.head, setting.folder_name) == ("FrozenBN", "-", "FrozenBN--")
    assert setting.norm_overrides()[1::2] == ["FrozenBN", "", "", ""]


def test_finetuning_a_backbone_without_norm_is_refused_up_front(capsys):
    for settings in (["--settings=-/GN"], ["--settings", "SN", "--settings=-/GN"]):
        with pytest.raises(SystemExit):
            compare_norms.parse_args(["--finetune", *settings])
        error = capsys.readouterr().err
        assert "--finetune: setting '-/GN' has no backbone norm" in error and "'FrozenBN'" in error
    # from scratch it is a setting; one that starts with '-' is attached to its own, repeated --settings
    args = compare_norms.parse_args(["--settings", "SN", "FrozenBN/-", "--settings=-/GN", "--settings=-"])
    assert [setting.name for setting in args.settings] == ["SN", "FrozenBN/-", "-/GN", "-"]


def test_publish_where_nothing_can_be_written_is_refused_up_front(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("")
    under_a_file = tmp_path / "notes.txt" / "results.md"
    with pytest.raises(SystemExit):
        compare_norms.parse_args(["--publish", str(under_a_file)])
    assert f"argument --publish: '{under_a_file}': {under_a_file.parent} is a file" in capsys.readouterr().err
    missing = str(tmp_path / "missing" / "results.md")  # made when the table is written
    assert compare_norms.parse_args(["--publish", missing]).publish == missing
    with pytest.raises(SystemExit):
        compare_norms.parse_args(["--publish", str(tmp_path)])
    assert f"argument --publish: '{tmp_path}' is a folder" in capsys.readouterr().err
    assert compare_norms.parse_args(["--publish", str(tmp_path / "results.md")]).publish == str(tmp_path / "results.md")


def test_tiny_finetune_sweep_pretrains_each_backbone_once_and_finetunes_from_it(
    tmp_path, train_net_calls, tiny_classification_set, monkeypatch, capsys
):
    """The SN paper's protocol at a tiny budget: FrozenBN (BN†) from a BN-pretrained backbone, SN from an
    SN-pretrained one, each pretrained once (cached) and loaded by the runs. (The heads are normalized: a
    backbone pretrained for two iterations gives features no head without norm survives.)"""
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "backbones"))
    pretraining = [
        "PRETRAIN.DATA", tiny_classification_set, "PRETRAIN.IMAGE_SIZE", "32", "PRETRAIN.IMS_PER_BATCH", "4",
        "PRETRAIN.MAX_ITER", "2", "PRETRAIN.WARMUP_ITERS", "1", "PRETRAIN.NUM_WORKERS", "0",
        "PRETRAIN.BATCH_AVERAGE_BATCHES", "4",
    ]  # fmt: skip
    arguments = [
        "--finetune",
        "--config-file",
        CONFIG,
        "--settings",
        "FrozenBN/GN",
        "SN",
        "--seeds",
        "3",
        "--iters",
        "2",
        "--batch-average-batches",
        "1",
        "--output-dir",
        str(tmp_path / "sweep"),
        *TINY,
        *pretraining,
        "MODEL.BACKBONE.FREEZE_AT",
        "2",
    ]
    # the plan first: nothing made, nothing run
    assert compare_norms.main(["--plan-only", *arguments]) == 0
    assert train_net_calls == [] and not (tmp_path / "backbones").exists()
    plan = capsys.readouterr().out
    assert "Sweep: 2 setting(s) x 1 seed(s) = 2 runs of 2 iterations; 0 done, 2 to run, --jobs 1." in plan
    assert (
        "First 2 backbone(s) not in the cache are pretrained" in plan
        and "  SN, SEED 1, 2 iterations: unknown (no cached SN backbone" in plan
    )
    assert "Estimated wall time of the 2 run(s) to run: unknown (known once a run of this sweep has finished)" in plan

    assert compare_norms.main(arguments) == 0
    backbones = sorted(os.listdir(tmp_path / "backbones"))
    assert [name.split("-")[:2] for name in backbones] == [["resnet18", "BN"], ["resnet18", "SN"]]
    for command, norm in zip(train_net_calls, ("BN", "SN")):
        weights = command[command.index("MODEL.WEIGHTS") + 1]
        assert weights.startswith(str(tmp_path / "backbones" / f"resnet18-{norm}-")), weights
        folder = command[command.index("OUTPUT_DIR") + 1]
        log = open(os.path.join(folder, compare_run.TRAIN_LOG)).read()
        missing = log.split("not found in the checkpoint:")[1].split("\n[")[0]  # the keys detectron2 lists
        assert f"Loading from {weights}" in log and "backbone.fpn_lateral2" in missing and "bottom_up" not in missing
    table = (tmp_path / "sweep" / "results.md").read_text()
    assert "finetuned (stages up to res2 frozen) from a ResNet-18 pretrained" in table
    top1 = {
        norm: json.loads((tmp_path / "backbones" / name / "results.json").read_text())["val_top1"]
        for norm, name in zip(("BN", "SN"), backbones)
    }
    assert f"| FrozenBN/GN | FrozenBN | GN | – (none) | 1 | {top1['BN']:.1f} % |" in table
    assert f"| SN | SN | SN | batch average (1) | 1 | {top1['SN']:.1f} % |" in table

    train_net_calls.clear()
    capsys.readouterr()
    assert compare_norms.main(arguments) == 0  # everything finished: nothing trained, nothing pretrained
    assert train_net_calls == [] and sorted(os.listdir(tmp_path / "backbones")) == backbones
    plan = capsys.readouterr().out
    assert "2 done, 0 to run" in plan and "First" not in plan and "Estimated" not in plan
    os.remove(os.path.join(folder, RESULTS_FILE))  # the SN run to do again: timed by the finished one
    assert compare_norms.main(["--plan-only", *arguments]) == 0
    (finished,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Estimated")]
    assert "1 x " in finished and "the median wall time of the 1 finished run(s), / 1 at once" in finished
    assert train_net_calls == []


def test_a_sweep_killed_while_pretraining_a_backbone_resumes_it(
    tmp_path, train_net_calls, tiny_classification_set, monkeypatch, capsys
):
    """The backbone trains as a backbone job in the sweep's folder, checkpointed: a sweep killed there
    continues the backbone from its checkpoint, and the work folder goes once the backbone is cached."""
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    pretraining = tiny_pretrain_keys(tiny_classification_set)
    sweep = tmp_path / "sweep"
    arguments = [
        "--finetune",
        "--config-file",
        CONFIG,
        "--settings",
        "SN",
        "--seeds",
        "3",
        "--iters",
        "1",
        "--batch-average-batches",
        "1",
        "--output-dir",
        str(sweep),
        *TINY,
        *pretraining,
    ]
    config = compare_plan.pretraining_configs(load_cfg(CONFIG, [*TINY, *pretraining]), [Setting("SN", "SN")])["SN"]
    folder = (
        sweep / compare_plan.BACKBONE_WORK_FOLDER / os.path.basename(pretraining_cache.cached_backbone_folder(config))
    )

    # the sweep was killed at the backbone's iteration 2, after its checkpoint at iteration 1
    pretrain_killed_at(monkeypatch, config, 2, resume=True, output_dir=str(folder / "training"))
    assert compare_norms.main(["--plan-only", *arguments]) == 0
    assert "  SN, SEED 1, 3 iterations, resumed after 2 checkpointed: " in capsys.readouterr().out
    assert compare_norms.main(arguments) == 0
    (attempt,) = json.loads((folder / "cell.json").read_text())["attempts"]
    assert attempt["resumed"] and attempt["returncode"] == 0
    assert "iterations 2-3" in (folder / "pretrain.log").read_text()  # continued, not started over
    assert not (folder / "training").exists() and pretraining_cache.is_cached(config)
    assert len(train_net_calls) == 1 and pretraining_cache.cached_backbone_path(config) in train_net_calls[0]


def test_runs_whose_backbone_failed_are_left_out_and_the_others_run(
    tmp_path, train_net_calls, tiny_classification_set, monkeypatch
):
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    pretraining = [*tiny_pretrain_keys(tiny_classification_set), "PRETRAIN.MAX_ITER", "2"]
    arguments = [
        "--finetune",
        "--config-file",
        CONFIG,
        "--settings",
        "GN",
        "SN",
        "--seeds",
        "3",
        "--iters",
        "1",
        "--batch-average-batches",
        "1",
        "--output-dir",
        str(tmp_path / "sweep"),
        *TINY,
        *pretraining,
    ]
    make = compare_norms.make_backbones

    def sn_fails(configs, *args, **kwargs):  # GN's backbone is made, SN's pretraining fails
        assert make({key: config for key, config in configs.items() if key[0] != "SN"}, *args, **kwargs) == []
        return [configs["SN", 3]]

    monkeypatch.setattr(compare_norms, "make_backbones", sn_fails)
    assert compare_norms.main(arguments) == 1
    assert output_dirs_of(train_net_calls) == [str(tmp_path / "sweep" / "GN" / "seed3")]
    assert read_record(str(tmp_path / "sweep" / "SN" / "seed3")) is None  # never started
    assert "| GN | GN | GN |" in (tmp_path / "sweep" / "results.md").read_text()


def test_backbone_seeds_pretrain_a_backbone_per_seed_the_configs_seed_the_grids(tmp_path, monkeypatch, capsys):
    """--backbone-seeds: seed k finetunes a backbone pretrained with SEED k; the config's SEED gives the
    backbone a sweep without it uses (the grid's cell), and FrozenBN shares BN's."""
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    cfg = load_cfg(compare_plan.DEFAULT_FINETUNE_CONFIG, [])
    settings = [parse_setting(text) for text in ("FrozenBN/GN", "BN", "SN")]
    per_norm = compare_plan.pretraining_configs(cfg, settings)
    seeds = [cfg.SEED, cfg.SEED + 1, cfg.SEED + 5]
    shared = backbones.backbone_configs(per_norm, seeds, per_seed=False)
    own = backbones.backbone_configs(per_norm, seeds, per_seed=True)
    path = pretraining_cache.cached_backbone_path
    for norm in ("FrozenBN", "BN", "SN"):
        assert {path(shared[norm, seed]) for seed in seeds} == {path(per_norm[norm])}
        assert [own[norm, seed].SEED for seed in seeds] == seeds
        assert path(own[norm, cfg.SEED]) == path(per_norm[norm]) and len({path(own[norm, s]) for s in seeds}) == 3
    assert all(path(own["FrozenBN", seed]) == path(own["BN", seed]) for seed in seeds)
    assert per_norm["SN"].SEED == cfg.SEED  # the per-norm configs are not changed

    # the sweep plans from them, and its table says which spread it shows
    planned = {}
    original = compare_norms.plan_runs
    monkeypatch.setattr(
        compare_norms, "plan_runs", lambda *a, **kw: planned.update(backbones=a[8]) or original(*a, **kw)
    )
    common = ["--finetune", "--settings", "SN", "--seeds", *map(str, seeds[:2]), "--report-only"]
    for flag, expected in (([], shared), (["--backbone-seeds"], own)):
        assert compare_norms.main([*common, *flag, "--output-dir", str(tmp_path / f"sweep{len(flag)}")]) == 0
        assert planned["backbones"] == {("SN", seed): path(expected["SN", seed]) for seed in seeds[:2]}
    runs = plan_runs(
        cfg,
        compare_plan.DEFAULT_FINETUNE_CONFIG,
        settings[2:],
        seeds[:1],
        str(tmp_path),
        backbones={("SN", seeds[0]): "backbone.pth"},
    )
    assert "(`--backbone-seeds`: the spread includes the backbone's draw), on" in compare_report.describe(
        cfg, CONFIG, runs, backbone_seeds=True
    )
    shared_text = compare_report.describe(cfg, CONFIG, runs)
    assert f"pretrained with SEED {cfg.SEED} (the spread is the finetuning's only), on" in shared_text
    assert shared_text.startswith("### Norm settings compared on this machine (`tools/compare_norms.py --finetune`")
    from_grid = compare_report.describe(
        cfg, CONFIG, runs, backbones=("grid/best.json", {"SN": {"PRETRAIN.BASE_LR": 0.2}})
    )
    assert from_grid.startswith(
        "### Norm settings finetuned from the backbones of `best.json` (`tools/compare_norms.py"
    )
    assert "its PRETRAIN setting in `grid/best.json` (`tools/pretrain_grid.py`: SN: PRETRAIN.BASE_LR 0.2)" in from_grid
    with pytest.raises(SystemExit):
        compare_norms.parse_args(["--backbone-seeds"])
    assert "--backbone-seeds seeds the pretrained backbones of --finetune" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_norms.parse_args(["--plan-only", "--report-only"])
    assert "--plan-only prints what would run, --report-only writes what has run: give one" in capsys.readouterr().err


def test_a_finetune_sweep_checks_its_runs_before_pretraining_any_backbone(tmp_path, monkeypatch):
    """Pretraining is the longest part: a wrong argument or a foreign folder fails before it."""
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "backbones"))
    common = ["--finetune", "--config-file", CONFIG, "--settings", "SN", "--output-dir", str(tmp_path / "sweep")]
    with pytest.raises(SystemExit, match="seeds must be >= 0"):
        compare_norms.main([*common, "--seeds", "-1", "--iters", "2", *TINY])
    os.makedirs(tmp_path / "sweep" / "SN" / "seed1")
    (tmp_path / "sweep" / "SN" / "seed1" / "notes.txt").write_text("someone else's")
    with pytest.raises(SystemExit, match="is not empty and was not made by this sweep"):
        compare_norms.main([*common, "--seeds", "1", "--iters", "2", *TINY])
    assert not (tmp_path / "backbones").exists()
