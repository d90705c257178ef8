"""Converted files load into full detectron2 models built by its stock builders and model-zoo configs:
every backbone key (FPN: backbone.bottom_up.*; C4: backbone.* and roi_heads.res5.*) gets its value
from the file through DetectionCheckpointer's name matching, and nothing in the file goes unused."""

import pytest
import torch
from detectron2 import model_zoo
from detectron2.modeling import build_model
from resnet_sources import (
    assert_loaded,
    load_with_checkpointer,
    read_converted,
    sn_authors_checkpoint,
    torchvision_resnet,
)
from torch import nn

from sn_detection import model_zoo as sn_model_zoo
from sn_detection.conversion import INPUT_CONVENTIONS, convert_file, write_checkpoint
from sn_detection.d2 import add_sn_config
from sn_detection.layers import SwitchableNorm2d

MASK_RCNN_FPN = "COCO-InstanceSegmentation/mask_rcnn_R_50_FPN_1x.yaml"
FASTER_RCNN_C4 = "COCO-Detection/faster_rcnn_R_50_C4_1x.yaml"
MASK_RCNN_FPN_GN = "Misc/mask_rcnn_R_50_FPN_3x_gn.yaml"


def converted_file(source: str, source_file, path):
    """source_file converted from ``source`` and written to path, as the tool would."""
    state, _ = convert_file(source, str(source_file))
    write_checkpoint(state, str(path), author="test")
    return path


@pytest.fixture(scope="module")
def torchvision_converted(bn_file, tmp_path_factory):
    return converted_file("torchvision", bn_file, tmp_path_factory.mktemp("full_tv") / "r50.pkl")


@pytest.fixture(scope="module")
def gn_converted(gn_file, tmp_path_factory):
    return converted_file("gn", gn_file, tmp_path_factory.mktemp("full_gn") / "r50_gn.pkl")


def build(config: str, source: str, norm: str | None = None):
    """detectron2's model-zoo config, with ``norm`` in the backbone: a stock config made to build our
    norms takes sn_detection's keys and SNMetaArch around its meta-architecture."""
    cfg = model_zoo.get_config(config)
    add_sn_config(cfg)
    cfg.merge_from_list(["MODEL.DEVICE", "cpu", "MODEL.WEIGHTS", ""])
    cfg.merge_from_list(INPUT_CONVENTIONS[source].config_overrides())
    if norm:
        cfg.merge_from_list(
            [
                "MODEL.RESNETS.NORM",
                norm,
                "MODEL.SN.META_ARCHITECTURE",
                cfg.MODEL.META_ARCHITECTURE,
                "MODEL.META_ARCHITECTURE",
                "SNMetaArch",
            ]
        )
    return build_model(cfg)


def assert_no_backbone_warning(warnings: list[str], markers: tuple[str, ...]):
    for message in warnings:
        assert "not used by the model" not in message, message
        assert "Skip loading" not in message and "Shape of" not in message, message
        assert not any(marker in line for line in message.splitlines() for marker in markers), message


def test_mask_rcnn_fpn_frozen_bn(torchvision_converted):
    model = build(MASK_RCNN_FPN, "torchvision")
    warnings = load_with_checkpointer(model, torchvision_converted)
    assert_loaded(model, read_converted(torchvision_converted), prefixes=("backbone.bottom_up.",))
    assert_no_backbone_warning(warnings, ("bottom_up",))


def test_faster_rcnn_c4_frozen_bn(torchvision_converted):
    model = build(FASTER_RCNN_C4, "torchvision")
    warnings = load_with_checkpointer(model, torchvision_converted)
    assert_loaded(model, read_converted(torchvision_converted), prefixes=("backbone.", "roi_heads.res5."))
    assert_no_backbone_warning(warnings, ("backbone.", "roi_heads.res5"))


def test_mask_rcnn_fpn_trainable_bn_lacks_only_the_counter(torchvision_converted):
    """A BN (not FrozenBN) backbone gets everything but num_batches_tracked, a counter left at 0."""
    model = build(MASK_RCNN_FPN, "torchvision", norm="BN")
    warnings = load_with_checkpointer(model, torchvision_converted)
    assert_loaded(
        model, read_converted(torchvision_converted), ("backbone.bottom_up.",), ignore=("num_batches_tracked",)
    )
    backbone_lines = [line for message in warnings for line in message.splitlines() if "bottom_up" in line]
    assert backbone_lines and all("num_batches_tracked" in line for line in backbone_lines)


def test_mask_rcnn_fpn_gn(gn_converted):
    model = build(MASK_RCNN_FPN_GN, "gn")
    warnings = load_with_checkpointer(model, gn_converted)
    assert_loaded(model, read_converted(gn_converted), prefixes=("backbone.bottom_up.",))
    assert_no_backbone_warning(warnings, ("bottom_up",))
    # the GN heads and FPN have "norm" modules too; none was matched by a backbone key
    assert isinstance(model.backbone.fpn_lateral2.norm, nn.GroupNorm)


@pytest.fixture(scope="module")
def sn_converted(sn_file, tmp_path_factory):
    return converted_file("sn", sn_file, tmp_path_factory.mktemp("full_sn") / "r50_sn.pkl")


def test_mask_rcnn_sn_2x_config(sn_converted):
    """The paper's SN/SN Mask R-CNN config, with MODEL.RESNETS.NORM "SN" built by SNMetaArch, takes every
    backbone tensor of the converted SN file, running statistics and logits included."""
    cfg = sn_model_zoo.get_config("mask_rcnn_sn_2x")
    cfg.merge_from_list(["MODEL.DEVICE", "cpu", "MODEL.WEIGHTS", ""])
    model = build_model(cfg)
    warnings = load_with_checkpointer(model, sn_converted)
    assert_loaded(model, read_converted(sn_converted), prefixes=("backbone.bottom_up.",))
    assert_no_backbone_warning(warnings, ("bottom_up",))
    assert isinstance(model.backbone.bottom_up.res3[0].conv2.norm, SwitchableNorm2d)


@pytest.fixture(scope="module")
def sn_without_bn_converted(tmp_path_factory):
    """An (8, 1)-style SN ResNet-18 (the authors' models without the BN branch: 2 logits, no running
    statistics), converted."""
    net = torchvision_resnet(18, norm_layer=lambda c: SwitchableNorm2d(c, use_bn=False), seed=5)
    directory = tmp_path_factory.mktemp("full_sn_nobn")
    torch.save(sn_authors_checkpoint(net, with_bn=False), directory / "resnet18_sn_8x1.pth")
    return converted_file("sn", directory / "resnet18_sn_8x1.pth", directory / "r18_sn_8x1.pkl")


def sn_r18_config(use_bn: bool):
    cfg = sn_model_zoo.get_config("mask_rcnn_sn_2x")
    cfg.merge_from_list(
        [
            "MODEL.DEVICE",
            "cpu",
            "MODEL.WEIGHTS",
            "",
            "MODEL.RESNETS.DEPTH",
            18,
            "MODEL.RESNETS.RES2_OUT_CHANNELS",
            64,
            "MODEL.SN.USE_BN",
            use_bn,
        ]
    )
    return build_model(cfg)


def test_a_model_without_the_bn_branch_needs_use_bn_false(sn_without_bn_converted):
    """docs/pretrained_weights.md: such a file loads whole into the config with MODEL.SN.USE_BN False; with
    the default True detectron2 only warns and leaves every SN layer's logits at their initial values."""
    model = sn_r18_config(use_bn=False)
    warnings = load_with_checkpointer(model, sn_without_bn_converted)
    assert_loaded(model, read_converted(sn_without_bn_converted), prefixes=("backbone.bottom_up.",))
    assert_no_backbone_warning(warnings, ("bottom_up",))
    model = sn_r18_config(use_bn=True)
    initial = {key: value.clone() for key, value in model.state_dict().items() if key.endswith("_weight")}
    warnings = "\n".join(load_with_checkpointer(model, sn_without_bn_converted))
    assert "res2.0.conv1.norm.mean_weight" in warnings and "running_var" in warnings
    for key, value in model.state_dict().items():
        if key.startswith("backbone.bottom_up.") and key.endswith(("norm.mean_weight", "norm.var_weight")):
            assert value.shape == (3,) and torch.equal(value, initial[key]), key
