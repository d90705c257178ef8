"""torchvision's BN ResNet-50 -> detectron2: FrozenBN features equal torchvision's; SN and GN initialised from BN."""

import torch
from resnet_sources import (
    assert_loaded,
    assert_same_features,
    detectron2_resnet,
    load_with_checkpointer,
    read_converted,
)

from sn_detection.conversion import convert_file, write_checkpoint
from sn_detection.layers import GroupNorm2d, SwitchableNorm2d


def convert_to(tmp_path, bn_file, norm=None, name="out.pkl"):
    state, report = convert_file("torchvision", str(bn_file), norm)
    path = tmp_path / name
    write_checkpoint(state, str(path), author="test")
    return path, report


def test_frozen_bn_features_match_torchvision(bn_net, bn_file, tmp_path):
    path, _ = convert_to(tmp_path, bn_file)
    backbone = detectron2_resnet(norm="FrozenBN")
    assert load_with_checkpointer(backbone, path) == []
    assert_same_features(bn_net, backbone)


def test_pth_output_holds_the_same_as_pkl_and_loads(bn_file, tmp_path):
    state, _ = convert_file("torchvision", str(bn_file))
    for suffix in (".pkl", ".pth"):
        write_checkpoint(state, str(tmp_path / f"r50{suffix}"), author="test")
    pkl, pth = read_converted(tmp_path / "r50.pkl"), read_converted(tmp_path / "r50.pth")
    assert pkl.keys() == pth.keys() and all(torch.equal(pkl[key], pth[key]) for key in pkl)
    backbone = detectron2_resnet(norm="FrozenBN")
    assert load_with_checkpointer(backbone, tmp_path / "r50.pth") == []
    assert_loaded(backbone, pth, prefixes=("",))


def test_report(bn_file, tmp_path):
    _, report = convert_to(tmp_path, bn_file)
    assert report.norm == "BN" and report.architecture == "ResNet-50"
    assert len(report.converted) == 53 * 5
    assert ("layer3.5.bn3.running_var", "res4.5.conv3.norm.running_var") in report.converted
    assert ("layer1.0.downsample.0.weight", "res2.0.shortcut.weight") in report.converted
    reasons = dict(report.skipped)
    assert reasons["fc.weight"] == "the classifier"
    assert reasons["layer1.0.bn1.num_batches_tracked"] == "BN's training counter"
    assert len(report.skipped) == 2 + 53
    assert report.initialised == [] and report.ok


def test_sn_from_bn_takes_affine_and_bn_branch_statistics(bn_net, bn_file, tmp_path):
    path, report = convert_to(tmp_path, bn_file, norm="SN")
    state = read_converted(path)
    source = bn_net.state_dict()
    for name in ("weight", "bias", "running_mean", "running_var"):
        torch.testing.assert_close(state[f"res3.0.shortcut.norm.{name}"], source[f"layer2.0.downsample.1.{name}"])
    # logits are the layer's own initialisation, and the report says so
    fresh = SwitchableNorm2d(64)
    torch.testing.assert_close(state["stem.conv1.norm.mean_weight"], fresh.mean_weight.detach())
    initialised = {key.rsplit(".", 1)[1] for key, _ in report.initialised}
    assert initialised == {"mean_weight", "var_weight", "num_batches_tracked"}
    assert any("initialisation" in note for note in report.notes)


def test_sn_from_bn_with_logits_on_the_bn_branch_is_the_bn_network(bn_net, bn_file, tmp_path):
    """The running statistics went into SN's BN branch: with all weight on that branch (eval mode), the
    SN backbone computes torchvision's BN features."""
    path, _ = convert_to(tmp_path, bn_file, norm="SN")
    backbone = detectron2_resnet(norm=SwitchableNorm2d)
    assert load_with_checkpointer(backbone, path) == []
    with torch.no_grad():
        for module in backbone.modules():
            if isinstance(module, SwitchableNorm2d):
                module.mean_weight.copy_(torch.tensor([-40.0, -40.0, 40.0]))
                module.var_weight.copy_(torch.tensor([-40.0, -40.0, 40.0]))
    assert_same_features(bn_net, backbone)


def test_gn_from_bn_takes_affine_and_skips_statistics(bn_net, bn_file, tmp_path):
    path, report = convert_to(tmp_path, bn_file, norm="GN")
    backbone = detectron2_resnet(norm=GroupNorm2d)
    assert load_with_checkpointer(backbone, path) == []
    torch.testing.assert_close(backbone.res5[2].conv3.norm.bias, bn_net.layer4[2].bn3.bias)
    assert "layer4.2.bn3.running_var" in {key for key, _ in report.skipped}
    assert not any("running" in key for key in read_converted(path))


def test_wrapped_and_prefixed_state_dict(bn_net, tmp_path):
    path = tmp_path / "wrapped.pth"
    torch.save({"state_dict": {"module." + k: v for k, v in bn_net.state_dict().items()}, "epoch": 90}, path)
    state, report = convert_file("torchvision", str(path))
    assert ("module.conv1.weight", "stem.conv1.weight") in report.converted
    torch.testing.assert_close(state["res2.1.conv2.weight"], bn_net.layer1[1].conv2.weight.detach())
