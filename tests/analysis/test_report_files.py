"""Averages per component, and the written report: markdown and CSV rows, valid PNG charts."""

import csv
import os

import numpy as np
import pytest
from PIL import Image

from sn_detection.analysis import DynamicChoice, ModeGates, SwitchableChoice, plot_evolution, summarize, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def part(name):
    """Test component naming: the first dotted part of the layer name."""
    return name.split(".")[0]


def sn(layer, mean, var):
    return SwitchableChoice(layer, 8, dict(zip(("IN", "LN", "BN"), mean)), dict(zip(("IN", "LN", "BN"), var)))


RECORDS = [
    sn("head.0", (0.1, 0.7, 0.2), (0.2, 0.6, 0.2)),
    sn("body.0", (0.2, 0.2, 0.6), (0.4, 0.2, 0.4)),
    sn("body.1", (0.4, 0.2, 0.4), (0.2, 0.2, 0.6)),
    SwitchableChoice("body.2", 8, {"IN": 0.6, "LN": 0.4}, {"IN": 0.3, "LN": 0.7}),  # no BN branch
    DynamicChoice("body.3", 16, num_groups=4, group_size=4, contiguous=True, pools_batch=True),
    DynamicChoice("body.4", 16, num_groups=16, group_size=1, contiguous=True, pools_batch=False),
    DynamicChoice("body.5", 16, num_groups=8, group_size=2, contiguous=False, pools_batch=False),
    ModeGates("head.1", "MGN", 8, 2, 40, (0.8, 0.2), 0.5, 0.8),
    ModeGates("head.2", "MGN", 8, 2, 10, (0.4, 0.6), 0.9, 0.6),
    ModeGates("tail.0", "MN", 8, 2),  # never observed
]


def by_key(summaries):
    return {(s.kind, s.component): s for s in summaries}


def test_per_component_averages():
    summaries = summarize(RECORDS, part, components=["body", "head"])
    assert [(s.kind, s.component, s.layers) for s in summaries] == [
        ("SN", "body", 3),
        ("SN", "head", 1),
        ("DN", "body", 3),
        ("MN", "tail", 1),
        ("MGN", "head", 2),
    ]
    found = by_key(summaries)
    body = found["SN", "body"].metrics
    assert body == pytest.approx(
        {"mean_IN": 0.4, "mean_LN": 0.8 / 3, "mean_BN": 1 / 3, "var_IN": 0.3, "var_LN": 1.1 / 3, "var_BN": 1 / 3}
    )
    assert found["DN", "body"].metrics == pytest.approx(
        {"IN": 1 / 3, "GN": 2 / 3, "LN": 0.0, "pools_batch": 1 / 3, "strided": 1 / 3, "median_groups": 8.0}
    )
    # every observed layer counts once, whatever its number of assignments
    mgn = {"mode_1": 0.6, "mode_2": 0.4, "entropy": 0.7, "dominant": 0.7}
    assert found["MGN", "head"].metrics == pytest.approx(mgn)
    assert found["MN", "tail"].metrics == {}


def test_components_not_in_the_order_come_last_in_order_of_appearance():
    summaries = summarize(RECORDS[:4], part, components=["head"])
    assert [s.component for s in summaries] == ["head", "body"]


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def assert_valid_png(path, min_side=200):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, path
    image = np.asarray(Image.open(path).convert("RGB"))
    assert min(image.shape[:2]) >= min_side, image.shape
    assert image.std() > 10, "a blank picture"


def test_report_files(tmp_path):
    paths = write_report(RECORDS, part, str(tmp_path), components=["body", "head"], title="Test", notes=["A note."])
    names = [os.path.basename(p) for p in paths]
    assert names == [
        "norm_analysis.md",
        "norm_analysis.csv",
        "norm_layers.csv",
        "sn_importance.png",
        "dn_grouping.png",
        "mode_gates.png",
    ]
    for path in paths[3:]:
        assert_valid_png(path)

    text = (tmp_path / "norm_analysis.md").read_text(encoding="utf-8")
    assert text.startswith("# Test\n\nA note.\n")
    lines = text.splitlines()
    assert "| body | 3 | 0.400 | 0.267 | 0.333 | 0.300 | 0.367 | 0.333 |" in lines
    assert "| head | 1 | 0.100 | 0.700 | 0.200 | 0.200 | 0.600 | 0.200 |" in lines
    assert "| body | 3 | 0.333 | 0.667 | 0.000 | 0.333 | 0.333 | 8 |" in lines
    assert "| body.5 | 16 | 8 | 2 | GN | no | no |" in lines
    assert "| head | MGN | 2 | 0.600 / 0.400 | 0.700 | 0.700 |" in lines
    assert "| tail | MN | 1 | not observed | – | – |" in lines
    for chart in names[3:]:
        assert f"]({chart})" in text

    rows = read_csv(tmp_path / "norm_analysis.csv")
    assert rows[0] == ["kind", "component", "layers", "metric", "value"]
    values = {tuple(row[:4]): float(row[4]) for row in rows[1:]}
    assert values["SN", "body", "3", "mean_IN"] == pytest.approx(0.4)
    assert values["DN", "body", "3", "median_groups"] == 8.0
    assert values["MGN", "head", "2", "mode_2"] == pytest.approx(0.4)
    assert len(values) == 6 + 6 + 6 + 4 == len(rows) - 1  # SN body, SN head, DN body, MGN head; MN: none

    layers = read_csv(tmp_path / "norm_layers.csv")
    assert layers[0] == ["kind", "component", "layer", "metric", "value"]
    assert ["SN", "body", "body.2", "mean_BN", "0.0"] in layers
    assert ["DN", "body", "body.5", "strided", "1.0"] in layers
    assert len(layers) - 1 == 4 * 6 + 3 * 6 + 2 * 4


def test_a_model_without_learned_norms(tmp_path):
    paths = write_report([], part, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["norm_analysis.md", "norm_analysis.csv", "norm_layers.csv"]
    assert "nothing to analyse" in (tmp_path / "norm_analysis.md").read_text(encoding="utf-8")
    assert read_csv(tmp_path / "norm_analysis.csv") == [["kind", "component", "layers", "metric", "value"]]


def test_evolution_chart(tmp_path):
    history = []
    for iteration, bn in ((9, 0.3), (19, 0.5), (29, 0.7)):
        history.append((iteration, summarize([sn("body.0", (0.1, 0.9 - bn, bn), (0.2, 0.8 - bn, bn))], part)))
    path = str(tmp_path / "evolution.png")
    plot_evolution(history, "SN", path)
    assert_valid_png(path)
