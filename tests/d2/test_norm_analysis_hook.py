"""The NormAnalysis hook in a real training loop: per-component values reach the EventStorage at the
logged iterations, equal to the layers' parameters then, and their evolution is drawn after training."""

import itertools

import pytest
import torch
from detectron2.engine import SimpleTrainer
from detectron2.modeling import build_model
from PIL import Image
from tiny_rcnn import synthetic_batch, tiny_cfg

from sn_detection.d2 import build_optimizer
from sn_detection.d2.components import component_of
from sn_detection.d2.norm_analysis import NormAnalysis, build_norm_analysis_hook
from sn_detection.layers import ModeGroupNorm2d, SwitchableNorm2d


def sn_weight(model, component, logits_name, index):
    """The average over the SN layers of ``component`` of softmax(logits)[index], computed here."""
    weights = [
        torch.softmax(getattr(m, logits_name).detach().double(), 0)[index].item()
        for name, m in model.named_modules()
        if isinstance(m, SwitchableNorm2d) and component_of(name) == component
    ]
    return sum(weights) / len(weights)


def train(cfg, model, hook, iterations):
    trainer = SimpleTrainer(model, itertools.repeat(synthetic_batch()), build_optimizer(cfg, model))
    trainer.register_hooks([hook])
    trainer.train(0, iterations)
    return trainer.storage


def test_the_hook_logs_sn_and_mgn_per_component(tmp_path, one_thread):
    cfg = tiny_cfg("SN", "fpn", "MODEL.ROI_BOX_HEAD.NORM", "MGN", "SOLVER.BASE_LR", 0.1, "OUTPUT_DIR", str(tmp_path))
    cfg.TEST.NORM_ANALYSIS.PERIOD = 2
    model = build_model(cfg)
    storage = train(cfg, model, build_norm_analysis_hook(cfg, model), iterations=3)

    # logged at iteration 1 (every 2) and 2 (the last), never at 0
    res3 = storage.history("norm/SN/res3/mean_BN").values()
    assert [iteration for _, iteration in res3] == [1, 2]
    assert res3[-1][0] == pytest.approx(sn_weight(model, "res3", "mean_weight", 2), abs=1e-12)
    assert res3[0][0] != res3[1][0], "the logits trained between the two logged iterations"
    fpn_var = storage.history("norm/SN/FPN/var_LN").latest()
    assert fpn_var == pytest.approx(sn_weight(model, "FPN", "var_weight", 1), abs=1e-12)
    # frozen stages (FREEZE_AT 2) are reported too, with their fixed initial weights
    assert storage.history("norm/SN/res2/mean_IN").latest() == pytest.approx(1 / 3)
    # the MGN gates of the box head come from the training forward of the logged iterations
    modes = [storage.history(f"norm/MGN/box_head/mode_{k}").values() for k in (1, 2)]
    assert [iteration for _, iteration in modes[0]] == [1, 2]
    assert [a + b for (a, _), (b, _) in zip(*modes)] == pytest.approx([1.0, 1.0])
    assert 0 <= storage.history("norm/MGN/box_head/entropy").latest() <= 1
    assert all(not m._forward_pre_hooks for m in model.modules() if isinstance(m, ModeGroupNorm2d))
    # the box head is MGN, the mask head SN
    assert not any(name.startswith("norm/SN/box_head") for name in storage.histories())
    assert "norm/SN/mask_head/mean_LN" in storage.histories()

    for kind in ("SN", "MGN"):
        image = Image.open(tmp_path / f"norm_evolution_{kind}.png")
        assert image.format == "PNG" and min(image.size) > 200


def test_no_hook_when_disabled_or_without_learned_norms():
    model = build_model(tiny_cfg("GN", "c4"))
    cfg = tiny_cfg("GN", "c4", "TEST.NORM_ANALYSIS.PERIOD", 5)
    assert build_norm_analysis_hook(cfg, model) is None
    sn_model = build_model(tiny_cfg("SN", "c4"))
    assert build_norm_analysis_hook(tiny_cfg("SN", "c4"), sn_model) is None  # PERIOD 0: off
    enabled = tiny_cfg("SN", "c4", "TEST.NORM_ANALYSIS.PERIOD", 5)
    assert isinstance(build_norm_analysis_hook(enabled, sn_model), NormAnalysis)
    with pytest.raises(ValueError, match="TEST.NORM_ANALYSIS.PERIOD must be >= 0"):
        build_norm_analysis_hook(tiny_cfg("SN", "c4", "TEST.NORM_ANALYSIS.PERIOD", -1), sn_model)
