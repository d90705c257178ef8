"""The SN authors' ImageNet checkpoint -> detectron2: the converted backbone computes the source's features."""

import pytest
import torch
from detectron2.modeling.backbone import FPN
from detectron2.modeling.backbone.fpn import LastLevelMaxPool
from resnet_sources import (
    FEATURES,
    assert_loaded,
    assert_same_features,
    detectron2_resnet,
    load_with_checkpointer,
    read_converted,
    sn_authors_checkpoint,
    torchvision_resnet,
)
from torch import nn

from sn_detection.conversion import convert_file, write_checkpoint
from sn_detection.layers import SwitchableNorm2d


@pytest.fixture(scope="module")
def converted(sn_file, tmp_path_factory):
    state, report = convert_file("sn", str(sn_file))
    path = tmp_path_factory.mktemp("sn_out") / "r50_sn.pkl"
    write_checkpoint(state, str(path), author="test")
    return path, report


def test_features_match_the_source_network(sn_net, converted):
    backbone = detectron2_resnet(norm=SwitchableNorm2d)
    warnings = load_with_checkpointer(backbone, converted[0])
    assert warnings == []
    assert_same_features(sn_net, backbone)


def test_sn_layout_is_ours_flat_with_logits_kept(sn_net, converted):
    state = read_converted(converted[0])
    source = sn_net.state_dict()
    assert state["stem.conv1.norm.weight"].shape == (64,)
    assert state["res2.0.shortcut.norm.running_var"].shape == (256,)
    # logits stay logits (no softmax), running statistics are copied unchanged
    torch.testing.assert_close(state["res3.1.conv2.norm.mean_weight"], source["layer2.1.bn2.mean_weight"])
    torch.testing.assert_close(state["res4.0.shortcut.norm.running_mean"], source["layer3.0.downsample.1.running_mean"])
    # the authors' layer has no counter; ours starts at 0
    assert int(state["res5.2.conv3.norm.num_batches_tracked"]) == 0


def test_report(converted):
    report = converted[1]
    assert report.architecture == "ResNet-50" and report.norm == "SN"
    # 53 convs, 53 SN layers with 6 tensors each
    assert len(report.converted) == 53 * 7
    assert ("module.layer1.0.sn1.var_weight", "res2.0.conv1.norm.var_weight") in report.converted
    assert ("module.layer1.0.downsample.1.weight", "res2.0.shortcut.norm.weight") in report.converted
    assert sorted(key for key, _ in report.skipped) == ["module.fc.bias", "module.fc.weight"]
    assert {key.rsplit(".", 1)[1] for key, _ in report.initialised} == {"num_batches_tracked"}
    assert report.mismatched == [] and report.missing == []


def test_bare_state_dict_without_module_prefix(sn_net, tmp_path):
    path = tmp_path / "bare.pth"
    torch.save(sn_authors_checkpoint(sn_net, prefix="")["state_dict"], path)
    state, report = convert_file("sn", str(path))
    assert ("layer4.2.sn3.bias", "res5.2.conv3.norm.bias") in report.converted
    assert len(state) == 53 + 53 * 7


def test_resnet18_without_bn_branch_in_the_legacy_file_format(tmp_path):
    """The authors' (8, 1) models drop the BN branch: 2 logits, no running statistics. Their files
    predate torch.save's zip format (PyTorch 0.4), so this one is written in the legacy format."""
    net = torchvision_resnet(18, norm_layer=lambda c: SwitchableNorm2d(c, use_bn=False), seed=2)
    path = tmp_path / "sn_nobn.pth"
    torch.save(sn_authors_checkpoint(net, with_bn=False), path, _use_new_zipfile_serialization=False)
    state, report = convert_file("sn", str(path))
    assert report.architecture == "ResNet-18"
    assert state["res2.0.conv1.norm.mean_weight"].shape == (2,)
    assert not any("running" in key or "num_batches" in key for key in state)
    assert any("use_bn=False" in note for note in report.notes)
    out = tmp_path / "out.pth"
    write_checkpoint(state, str(out), author="test")
    backbone = detectron2_resnet(norm=lambda c: SwitchableNorm2d(c, use_bn=False), depth=18)
    assert load_with_checkpointer(backbone, out) == []
    assert_same_features(net, backbone)


class _Model(nn.Module):
    """A model whose backbone is detectron2's FPN over an SN ResNet-50: keys backbone.bottom_up.*,
    as in a full R-CNN built with an SN norm."""

    def __init__(self):
        super().__init__()
        bottom_up = detectron2_resnet(norm=SwitchableNorm2d)
        self.backbone = FPN(
            bottom_up=bottom_up, in_features=list(FEATURES), out_channels=32, top_block=LastLevelMaxPool()
        )


def test_loads_into_fpn_backbone_by_name_matching(converted):
    model = _Model()
    warnings = load_with_checkpointer(model, converted[0])
    assert_loaded(model, read_converted(converted[0]), prefixes=("backbone.bottom_up.",))
    assert not any("bottom_up" in message or "not used" in message for message in warnings), warnings
