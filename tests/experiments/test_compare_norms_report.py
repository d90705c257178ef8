"""The results of the norm comparison from hand-made runs: reading a run folder, mean ± std per setting,
the markdown table, differences within a backbone, the CSV and the plots."""

import csv
import dataclasses
import json
import math

import pytest

from sn_detection.engine.trainer import RESULTS_FILE
from sn_detection.experiments.compare_norms import plots, report
from sn_detection.experiments.compare_norms.runs import RunResult, loss_curve, read_result, write_record


def result(
    setting, seed, box_ap, mask_ap, batch_average=0, wall_s=100.0, backbone_top1=math.nan, weights=None, code=("git a",)
):
    backbone, _, head = setting.partition("/")
    metrics = dict.fromkeys(("box_AP50", "box_AP75", "mask_AP50", "mask_AP75"), math.nan)
    metrics.update(box_AP=box_ap, mask_AP=mask_ap)
    metrics.update(box_AP50=2 * box_ap, mask_AP50=2 * mask_ap)
    return RunResult(
        setting,
        backbone,
        head or backbone,
        seed,
        400,
        batch_average,
        metrics,
        wall_s,
        0.25,
        1.5,
        "x",
        backbone_top1,
        weights,
        code=code,
    )


RESULTS = [
    result("SN", 1, 10.0, 8.0, batch_average=20, wall_s=120.0),
    result("GN", 2, 9.0, 7.5),
    result("SN", 2, 12.0, 9.0, batch_average=20, wall_s=180.0),
    result("GN", 1, 7.0, 6.5),
    result("SN", 3, 14.0, 10.0, batch_average=20, wall_s=150.0),
    result("SN/GN", 1, 5.0, 4.0, batch_average=20),
]


def test_mean_and_sample_std():
    assert report.mean_std([10.0, 12.0, 14.0]) == (12.0, 2.0)  # sample std: sqrt(8 / 2)
    mean, std = report.mean_std([3.5])
    assert mean == 3.5 and math.isnan(std)
    assert all(math.isnan(x) for x in report.mean_std([1.0, math.nan]))  # no detection at all: NaN AP
    with pytest.raises(ValueError):
        report.mean_std([])


def test_summaries_per_setting_in_the_given_order():
    summaries = report.summarize(RESULTS, ["GN", "SN", "BN", "SN/GN"])
    assert [s.setting for s in summaries] == ["GN", "SN", "SN/GN"]  # BN has no result
    gn, sn, mixed = summaries
    assert gn.seeds == (1, 2) and sn.seeds == (1, 2, 3) and mixed.runs == 1
    assert sn.mean["box_AP"] == 12.0 and sn.std["box_AP"] == 2.0
    assert sn.mean["mask_AP"] == 9.0 and sn.std["mask_AP"] == 1.0
    assert gn.mean["box_AP"] == 8.0 and gn.std["box_AP"] == pytest.approx(math.sqrt(2))
    assert sn.mean["wall_s"] == 150.0 and sn.batch_average == 20 and gn.batch_average == 0
    assert (mixed.backbone, mixed.head) == ("SN", "GN") and math.isnan(mixed.std["box_AP"])


def test_markdown_table():
    table = report.markdown_table(report.summarize(RESULTS, ["GN", "SN", "SN/GN"]))
    lines = table.splitlines()
    assert lines[0].startswith("| setting | backbone | FPN + heads | test statistics | runs | box AP |")
    gn = "| GN | GN | GN | – (none) | 2 | 8.0 ± 1.4 | 16.0 ± 2.8 | 7.0 ± 0.7 | 14.0 ± 1.4 | 0.25 | 1.7 |"
    sn = "| SN | SN | SN | batch average (20) | 3 | 12.0 ± 2.0 | 24.0 ± 4.0 | 9.0 ± 1.0 | 18.0 ± 2.0 | 0.25 | 2.5 |"
    assert lines[2:4] == [gn, sn]
    assert lines[4].startswith("| SN/GN | SN | GN | batch average (20) | 1 | 5.0 | 10.0 | 4.0 | 8.0 |")  # no spread


def test_the_backbone_top1_column_is_there_where_a_backbone_is_known():
    known = [
        *(
            result("SN", seed, 10.0, 8.0, backbone_top1=55.58333333333333) for seed in (1, 2, 3)
        ),  # one backbone: one figure
        result("GN", 1, 7.0, 6.5, backbone_top1=60.0),  # a backbone per seed: its spread
        result("GN", 2, 9.0, 7.5, backbone_top1=64.0),
        result("BN", 1, 5.0, 4.0),  # trained from scratch
    ]
    lines = report.markdown_table(report.summarize(known, ["SN", "GN", "BN"])).splitlines()
    assert lines[0].startswith(
        "| setting | backbone | FPN + heads | test statistics | runs | backbone top-1 | box AP |"
    )
    assert [line.split(" | ")[5] for line in lines[2:]] == ["55.6 %", "62.0 ± 2.8 %", "–"]
    assert "backbone top-1" not in report.markdown_table(report.summarize(RESULTS, ["GN"]))
    assert "backbone iterations" not in "\n".join(lines)


def test_the_backbone_iterations_column_is_there_where_a_backbone_stopped_at_a_top1():
    stopped = [
        *(
            dataclasses.replace(result("SN", seed, 10.0, 8.0, backbone_top1=52.0), backbone_iterations=its)
            for seed, its in ((1, 240.0), (2, 360.0))
        ),
        result("GN", 1, 7.0, 6.5, backbone_top1=60.0),  # a backbone that trained its schedule
    ]
    lines = report.markdown_table(report.summarize(stopped, ["SN", "GN"])).splitlines()
    assert "| runs | backbone top-1 | backbone iterations | box AP |" in lines[0]
    assert [line.split(" | ")[6] for line in lines[2:]] == ["300 ± 85", "–"]


def test_the_table_says_where_a_backbone_never_reached_its_stop():
    """A backbone that never reached its PRETRAIN.STOP_TOP1 trained its whole schedule: its iterations are
    not those of that top-1, and the table says how many of a setting's backbones were short of it."""

    def stopped(setting, seed, its, short):
        run = result(setting, seed, 10.0, 8.0, backbone_top1=52.0)
        return dataclasses.replace(run, backbone_iterations=its, backbone_short_of_stop=short)

    runs = [
        stopped("SN", 1, 480.0, 0.0),
        stopped("SN", 2, 480.0, 0.0),
        stopped("BN", 1, 720.0, 0.0),
        stopped("BN", 2, 840.0, 1.0),
        stopped("BN", 3, 840.0, 1.0),
        stopped("MGN", 1, 840.0, 1.0),
    ]
    lines = report.markdown_table(report.summarize(runs, ["SN", "BN", "MGN"])).splitlines()
    assert [line.split(" | ")[6] for line in lines[2:]] == [
        "480 ± 0",
        "800 ± 69 (2 of 3 short of the top-1)",
        "840 (top-1 not reached)",
    ]


def test_settings_that_start_from_the_same_weights_are_compared_seed_by_seed(tmp_path):
    """Each seed draws its own backbone (its AP moves with it); the heads' difference is paired within it."""
    runs = [
        result("FrozenBN/-", 1, 20.0, 19.0, weights="bn-seed1.pth"),
        result("FrozenBN/-", 2, 14.0, 13.0, weights="bn-seed2.pth"),
        result("FrozenBN/-", 3, 17.0, 16.0, weights="bn-seed3.pth"),
        result("FrozenBN/SN", 1, 25.0, 23.0, weights="bn-seed1.pth"),
        result("FrozenBN/SN", 2, 17.0, 16.0, weights="bn-seed2.pth"),
        result("FrozenBN/SN", 3, 15.0, 17.0, weights="another.pth"),  # not the same backbone: not paired
        result("GN", 1, 30.0, 29.0, weights="gn-seed1.pth"),  # another backbone
        result("SN", 1, 9.0, 8.0),  # from scratch, as is the next
        result("SN/GN", 1, 8.0, 7.0),
    ]
    order = ["FrozenBN/-", "FrozenBN/SN", "GN", "SN", "SN/GN"]
    (pair,) = report.within_backbone_differences(runs, order)
    assert (pair.setting, pair.baseline, pair.seeds) == ("FrozenBN/SN", "FrozenBN/-", (1, 2))
    assert pair.differences == {"box_AP": (5.0, 3.0), "mask_AP": (4.0, 3.0)}
    assert pair.mean_std("box_AP") == (4.0, pytest.approx(math.sqrt(2)))

    path = tmp_path / "table.md"
    report.write_markdown(str(path), "What was run.", report.summarize(runs, order), [], [pair])
    text = path.read_text()
    assert "#### Within a backbone" in text
    assert "| FrozenBN/SN − FrozenBN/- | 1, 2 | +4.0 ± 1.4 | +3.5 ± 0.7 | 2 of 2 | 2 of 2 |" in text
    report.write_markdown(
        str(path),
        "What was run.",
        report.summarize(RESULTS, ["SN", "GN"]),
        [],
        report.within_backbone_differences(RESULTS, ["SN", "GN"]),
    )
    assert "Within a backbone" not in path.read_text()  # trained from scratch: nothing shared

    # a run without any detection has NaN AP: its difference is neither ahead nor behind
    blank = [
        result("FrozenBN/-", 1, 20.0, 19.0, weights="w1"),
        result("FrozenBN/SN", 1, math.nan, math.nan, weights="w1"),
        result("FrozenBN/-", 2, 14.0, 13.0, weights="w2"),
        result("FrozenBN/SN", 2, 17.0, 12.0, weights="w2"),
    ]
    table = report.differences_table(report.within_backbone_differences(blank, order))
    assert "| FrozenBN/SN − FrozenBN/- | 1, 2 | – | – | 1 of 1 | 0 of 1 |" in table


def test_markdown_file_names_unfinished_runs(tmp_path):
    path = tmp_path / "table.md"
    report.write_markdown(str(path), "What was run.", report.summarize(RESULTS, ["SN"]), ["DN seed 2"])
    text = path.read_text()
    assert text.startswith("What was run.\n\n| setting |")
    assert text.endswith("Failed or unfinished runs (left out above): DN seed 2\n")


def test_the_code_the_runs_ran_is_one_version_or_each_with_its_runs():
    assert report.code_sentence(RESULTS) == "*Code*: every run on git a."
    mixed = [
        result("SN", 2, 1.0, 1.0, code=("git b",)),
        result("SN", 1, 1.0, 1.0, code=("not recorded", "git a")),
        result("GN", 1, 1.0, 1.0),
    ]
    sentence = report.code_sentence(mixed)
    assert sentence.startswith("*Code* (of each run's attempts;")
    assert sentence.endswith(": git a (GN seed 1, SN seed 1); not recorded (SN seed 1); git b (SN seed 2).")
    assert report.code_sentence([result("GN", 1, 1.0, 1.0, code=("not recorded",))]) == "*Code*: not recorded."
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert report.code_sentence([result("GN", 1, 1.0, 1.0, code=(f"git {commit} + changes",))]) == (
        "*Code*: every run on git 0123456789ab + changes."
    )  # a commit shortened as people quote it


def test_csv_has_every_run_then_mean_and_std(tmp_path):
    summaries = report.summarize(RESULTS, ["GN", "SN", "SN/GN"])
    path = tmp_path / "results.csv"
    report.write_csv(str(path), RESULTS, summaries)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [row["kind"] for row in rows] == ["run"] * 6 + ["mean", "std"] * 3
    assert rows[0]["setting"] == "SN" and rows[0]["seed"] == "1" and float(rows[0]["box_AP"]) == 10.0
    sn_mean, sn_std = rows[8], rows[9]
    assert sn_mean["setting"] == sn_std["setting"] == "SN" and sn_mean["runs"] == "3"
    assert float(sn_mean["box_AP"]) == 12.0 and float(sn_std["box_AP"]) == 2.0 and float(sn_mean["wall_s"]) == 150.0
    assert math.isnan(float(rows[-1]["box_AP"]))  # std of the single SN/GN run


def test_plots_are_written(tmp_path):
    summaries = report.summarize(RESULTS, ["GN", "SN", "SN/GN"])
    plots.plot_ap(summaries, RESULTS, str(tmp_path / "ap.png"))
    curves = {"GN": {1: [(19, 2.0), (39, 1.5)], 2: [(19, 2.1)]}, "SN": {1: [(19, 2.2), (39, 1.4)]}}
    plots.plot_loss_curves(curves, str(tmp_path / "curves.png"))
    for name in ("ap.png", "curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_run(folder, metrics_rows, attempts, train_args=()):
    write_record(
        str(folder),
        {
            "setting": "SN/GN",
            "backbone": "SN",
            "head": "GN",
            "seed": 3,
            "iterations": 40,
            "batch_average": 20,
            "train_args": list(train_args),
            "attempts": attempts,
        },
    )
    with open(folder / "metrics.json", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in metrics_rows)


def test_a_run_folder_is_read(tmp_path):
    # a run restarted from its checkpoint at iteration 20: iteration 39 was logged twice, the later counts
    rows = [
        {"iteration": 19, "total_loss": 3.0, "time": 0.4},
        {"iteration": 39, "total_loss": 2.5, "time": 0.6},
        {"iteration": 39, "total_loss": 2.4, "time": 0.5},
        {"iteration": 39, "bbox/AP": 1.0},
    ]
    backbone = tmp_path / "backbone"
    backbone.mkdir()
    (backbone / "pretrained.json").write_text(json.dumps({"val_top1": 68.25}))
    train_args = ["MODEL.WEIGHTS", "elsewhere.pth", "SEED", "3", "MODEL.WEIGHTS", str(backbone / "backbone.pth")]
    attempts = [{"wall_s": 30.0, "returncode": -9}, {"wall_s": 20.5, "returncode": 0, "code": "git c0de"}]
    write_run(tmp_path, rows, attempts, train_args)
    with pytest.raises(ValueError, match="no finished run"):
        read_result(str(tmp_path), RESULTS_FILE)
    tasks = {"bbox": {"AP": 6.0, "AP50": 12.0, "AP75": 5.0}, "segm": {"AP": 4.0, "AP50": 9.0, "AP75": 3.0}}
    (tmp_path / RESULTS_FILE).write_text(json.dumps({"sn_shapes_val": tasks}))

    run = read_result(str(tmp_path), RESULTS_FILE)
    assert (run.setting, run.backbone, run.head, run.seed) == ("SN/GN", "SN", "GN", 3)
    assert (run.iterations, run.batch_average) == (40, 20)
    expected = {"box_AP": 6.0, "box_AP50": 12.0, "box_AP75": 5.0, "mask_AP": 4.0, "mask_AP50": 9.0, "mask_AP75": 3.0}
    assert run.metrics == expected
    assert run.wall_s == 50.5 and run.s_per_iter == 0.5 and run.final_loss == 2.4
    assert run.code == ("not recorded", "git c0de")  # the first attempt predates the record of the code
    assert loss_curve(str(tmp_path)) == [(19, 3.0), (39, 2.4)]
    # the backbone's top-1 from the file pretraining left beside the weights the run loaded (the last given)
    assert math.isnan(run.backbone_top1)
    assert read_result(str(tmp_path), RESULTS_FILE, "pretrained.json").backbone_top1 == 68.25
    assert math.isnan(read_result(str(tmp_path), RESULTS_FILE, "missing.json").backbone_top1)
    assert math.isnan(read_result(str(tmp_path), RESULTS_FILE, "pretrained.json").backbone_iterations)
    assert math.isnan(read_result(str(tmp_path), RESULTS_FILE, "pretrained.json").backbone_short_of_stop)
    # reached at a periodic evaluation (it stopped), at the final one only (after its whole schedule), or not
    for reached, top1, short in ((True, 52.5, 0.0), (False, 52.5, 0.0), (False, 51.5, 1.0)):
        (backbone / "pretrained.json").write_text(
            json.dumps({"val_top1": top1, "iterations": 360, "stop_top1": 52.0, "stop_top1_reached": reached})
        )
        stopped = read_result(str(tmp_path), RESULTS_FILE, "pretrained.json")
        assert stopped.backbone_iterations == 360 and stopped.backbone_short_of_stop == short
    assert run.weights == str(backbone / "backbone.pth")  # what pairs it with runs from the same backbone


def test_a_run_without_masks_is_refused(tmp_path):
    write_run(tmp_path, [], [{"wall_s": 1.0, "returncode": 0}])
    (tmp_path / RESULTS_FILE).write_text(json.dumps({"sn_shapes_val": {"bbox": {"AP": 1.0, "AP50": 2.0, "AP75": 0.5}}}))
    with pytest.raises(ValueError, match=r"no \['segm'\] results"):
        read_result(str(tmp_path), RESULTS_FILE)
