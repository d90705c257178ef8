"""detectron2 module names -> components, on the tiny FPN and C4 models; the per-component analysis of a
model whose SN logits, DN gates and MGN gates are set by hand reports exactly those."""

import math

import pytest
import torch
from detectron2.modeling import build_model
from detectron2.utils.events import EventStorage
from tiny_rcnn import synthetic_batch, tiny_cfg

from sn_detection.analysis import GateRecorder, learned_choices
from sn_detection.d2.components import COMPONENTS, component_of
from sn_detection.d2.norm_analysis import component_summaries
from sn_detection.layers import DynamicNorm2d, ModeGroupNorm2d, SwitchableNorm2d

# Norm layers per component of the tiny R50 models (bottlenecks: 3 norms + 1 shortcut norm per stage).
FPN_LAYERS = {"stem": 1, "res2": 10, "res3": 13, "res4": 19, "res5": 10, "FPN": 8, "box head": 4, "mask head": 4}
C4_LAYERS = {"stem": 1, "res2": 10, "res3": 13, "res4": 19, "box head": 10}


@pytest.mark.parametrize(
    "name, component",
    [
        ("backbone.bottom_up.stem.conv1.norm", "stem"),
        ("backbone.stem.conv1.norm", "stem"),
        ("backbone.bottom_up.res3.0.shortcut.norm", "res3"),
        ("backbone.res4.5.conv2.norm", "res4"),
        ("backbone.fpn_lateral2.norm", "FPN"),
        ("backbone.fpn_output5.norm", "FPN"),
        ("proposal_generator.rpn_head.conv", "RPN"),
        ("roi_heads.res5.2.conv3.norm", "box head"),
        ("roi_heads.box_head.conv4.norm", "box head"),
        ("roi_heads.mask_head.mask_fcn1.norm", "mask head"),
        ("module.roi_heads.mask_head.mask_fcn1.norm", "mask head"),
        ("roi_heads.keypoint_head.conv_fcn1", "other"),
        ("backbone.stemless.norm", "other"),
    ],
)
def test_component_of_a_module_name(name, component):
    assert component_of(name) == component


def layers_per_component(model, layer_type):
    counts = {}
    for name, module in model.named_modules():
        if isinstance(module, layer_type):
            counts[component_of(name)] = counts.get(component_of(name), 0) + 1
    return counts


@pytest.mark.parametrize("arch, expected", [("fpn", FPN_LAYERS), ("c4", C4_LAYERS)])
def test_every_norm_of_the_tiny_models_has_its_component(arch, expected):
    model = build_model(tiny_cfg("SN", arch))
    assert layers_per_component(model, SwitchableNorm2d) == expected


def component_logits(component):
    """Different, known logits for each component."""
    i = COMPONENTS.index(component)
    return torch.tensor([0.1 * i, 0.0, -0.2 * i])


def test_hand_set_sn_logits_per_component_are_reported_exactly():
    model = build_model(tiny_cfg("SN", "fpn"))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, SwitchableNorm2d):
                module.mean_weight.copy_(component_logits(component_of(name)))
                module.var_weight.copy_(component_logits(component_of(name)).flip(0))
    summaries = component_summaries(learned_choices(model))
    assert [(s.kind, s.component, s.layers) for s in summaries] == [("SN", c, n) for c, n in FPN_LAYERS.items()]
    for summary in summaries:
        weights = torch.softmax(component_logits(summary.component).double(), 0).tolist()
        means = [summary.metrics[f"mean_{s}"] for s in ("IN", "LN", "BN")]
        variances = [summary.metrics[f"var_{s}"] for s in ("BN", "LN", "IN")]
        assert means == pytest.approx(weights, abs=1e-6) and variances == pytest.approx(weights, abs=1e-6)


def test_dn_groupings_per_component():
    model = build_model(tiny_cfg("DN", "c4"))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, DynamicNorm2d) and component_of(name) == "box head":
                module.channel_gates.fill_(1.0)  # one group: LN
                module.batch_gate.fill_(1.0)
    summaries = {s.component: s for s in component_summaries(learned_choices(model))}
    assert set(summaries) == set(C4_LAYERS)
    assert summaries["box head"].metrics["LN"] == 1.0 and summaries["box head"].metrics["pools_batch"] == 1.0
    assert summaries["box head"].metrics["median_groups"] == 1.0
    # the rest keep their initial GN with 8 groups (MODEL.SN.DN_INIT_GROUPS), without batch pooling
    assert summaries["res3"].metrics["GN"] == 1.0 and summaries["res3"].metrics["pools_batch"] == 0.0
    assert summaries["res3"].metrics["median_groups"] == 8.0


def test_mgn_gates_per_component_on_a_forward():
    cfg = tiny_cfg("GN", "fpn", "MODEL.ROI_BOX_HEAD.NORM", "MGN", "MODEL.ROI_MASK_HEAD.NORM", "MGN")
    model = build_model(cfg)
    probabilities = {"box head": [0.9, 0.1], "mask head": [0.25, 0.75]}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, ModeGroupNorm2d):
                module.gate.weight.zero_()
                module.gate.bias.copy_(torch.tensor(probabilities[component_of(name)]).log())
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with GateRecorder(model) as recorder, torch.no_grad(), EventStorage():
            model(synthetic_batch())
    finally:
        torch.set_num_threads(threads)
    summaries = component_summaries(recorder.results())
    assert [(s.kind, s.component, s.layers) for s in summaries] == [("MGN", "box head", 4), ("MGN", "mask head", 4)]
    for summary in summaries:
        p = probabilities[summary.component]
        assert [summary.metrics["mode_1"], summary.metrics["mode_2"]] == pytest.approx(p, abs=1e-6)
        assert summary.metrics["entropy"] == pytest.approx(-sum(q * math.log(q) for q in p) / math.log(2), abs=1e-6)
