"""What SSN layers chose, read by the analysis and written by tools/analyze_norms.py: the normalizer of the means
and of the variances of each layer, the iteration each became one-hot, and the weights of free ones."""

import csv

import pytest
import torch
from torch import nn

from sn_detection.analysis import SparseSwitchableChoice, choices_from_state_dict, learned_choices, summarize
from sn_detection.engine.analyze_norms import main
from sn_detection.layers import SparseSwitchableNorm2d, SwitchableNorm2d, SyncSparseSwitchableNorm2d
from sn_detection.layers.sparse_switchable import sparsestmax


class Trained(nn.Module):
    """SSN layers as training leaves them: both fixed, one fixed, none fixed (at radius 0.3); and an SN layer."""

    def __init__(self):
        super().__init__()
        self.stem = SparseSwitchableNorm2d(8)
        self.body = SyncSparseSwitchableNorm2d(16, use_bn=False)
        self.head = SparseSwitchableNorm2d(8)
        self.sn = SwitchableNorm2d(8)
        with torch.no_grad():
            self.head.mean_weight.copy_(torch.tensor([0.9, 1.3, 0.8]))
            self.head.var_weight.copy_(torch.tensor([0.4, 0.3, 0.1]))
        for layer in (self.stem, self.body, self.head):
            layer.set_radius(0.3, iteration=90)
        self.stem.mean_fixed.fill_(2)
        self.stem.mean_fixed_at.fill_(40)
        self.stem.var_fixed.fill_(1)
        self.stem.var_fixed_at.fill_(75)
        self.body.var_fixed.fill_(0)  # fixed, at an iteration nobody recorded (converted weights)


def test_the_choices_and_when_they_were_made():
    records = learned_choices(Trained())
    assert [type(r).__name__ for r in records] == ["SparseSwitchableChoice"] * 3 + ["SwitchableChoice"]
    stem, body, head = records[:3]
    assert (stem.mean_choice, stem.mean_fixed_at, stem.var_choice, stem.var_fixed_at) == ("BN", 40, "LN", 75)
    assert stem.mean_weights == {"IN": 0.0, "LN": 0.0, "BN": 1.0} and stem.radius == pytest.approx(0.3)
    assert (body.mean_choice, body.var_choice, body.var_fixed_at) == (None, "IN", None)
    assert set(body.mean_weights) == {"IN", "LN"}
    assert head.mean_choice is None and head.var_choice is None
    expected = sparsestmax(torch.tensor([0.9, 1.3, 0.8], dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64))
    assert list(head.mean_weights.values()) == pytest.approx(expected.tolist())


def test_a_state_dict_gives_the_same_choices():
    model = Trained()
    from_model = [r for r in learned_choices(model) if isinstance(r, SparseSwitchableChoice)]
    assert choices_from_state_dict(model.state_dict())[:3] == from_model


def test_the_summary_counts_the_fixed_layers():
    summaries = summarize(learned_choices(Trained()), lambda name: "all")
    ssn = next(s for s in summaries if s.kind == "SSN")
    assert ssn.layers == 3
    assert ssn.metrics["mean_fixed"] == pytest.approx(1 / 3) and ssn.metrics["var_fixed"] == pytest.approx(2 / 3)
    assert "mean_fixed_at" not in ssn.metrics  # an iteration is not averaged


def test_the_tool_writes_each_layers_choices(tmp_path):
    path = tmp_path / "model_final.pth"
    torch.save({"model": Trained().state_dict(), "iteration": 99}, path)
    written = main(["--checkpoint", str(path), "--output-dir", str(tmp_path / "report")])
    markdown = open(written[0], encoding="utf-8").read()
    assert "## Sparse Switchable Normalization: choices" in markdown
    assert "| stem | 8 | BN (iteration 40) | LN (iteration 75) | 0.300 |" in markdown
    # equal logits at r = 0.3: towards IN, 0.3 / sqrt(2) from the centre on each axis
    assert "| body | 16 | free: 0.712 / 0.288 / 0.000 | IN (iteration unknown) | 0.300 |" in markdown
    assert any(p.endswith("ssn_importance.png") for p in written)
    with open(tmp_path / "report" / "norm_layers.csv", newline="") as f:
        rows = {(row["layer"], row["metric"]): float(row["value"]) for row in csv.DictReader(f) if row["kind"] == "SSN"}
    assert rows["stem", "mean_fixed_at"] == 40 and rows["stem", "var_fixed_at"] == 75
    assert ("body", "var_fixed_at") not in rows and rows["body", "var_fixed"] == 1
