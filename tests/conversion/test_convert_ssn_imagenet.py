"""The SSN authors' ImageNet checkpoint -> detectron2: the converted backbone computes the source's features,
with the source's fixed branches and radius."""

import pytest
import torch
from resnet_sources import (
    assert_same_features,
    detectron2_resnet,
    load_with_checkpointer,
    read_converted,
    sn_authors_checkpoint,
    ssn_authors_checkpoint,
    torchvision_resnet,
)

from sn_detection.conversion import ConversionError, convert_file, write_checkpoint
from sn_detection.layers import SparseSwitchableNorm2d, SwitchableNorm2d


def ssn_net(depth=50, use_bn=True, seed=5):
    """A torchvision ResNet with SSN layers in every state of a trained one: most weight vectors fixed (to
    every branch), some free at the radius the file was saved at."""
    net = torchvision_resnet(depth, norm_layer=lambda c: SparseSwitchableNorm2d(c, use_bn=use_bn), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    k = 3 if use_bn else 2
    for index, layer in enumerate(m for m in net.modules() if isinstance(m, SparseSwitchableNorm2d)):
        layer.set_radius(0.35)
        if index % 4:  # three layers in four fixed: the mean and the variance to branches of their own
            layer.mean_fixed.fill_(int(torch.randint(k, (), generator=generator)))
            layer.var_fixed.fill_(int(torch.randint(k, (), generator=generator)))
            layer.mean_fixed_at.fill_(1000 * index)  # what the authors' file does not hold
    return net.eval()


@pytest.fixture(scope="module")
def source_net():
    return ssn_net()


@pytest.fixture(scope="module")
def converted(source_net, tmp_path_factory):
    path = tmp_path_factory.mktemp("ssn") / "ssn_8x32.pth"
    torch.save(ssn_authors_checkpoint(source_net), path)
    state, report = convert_file("ssn", str(path))
    out = path.parent / "r50_ssn.pkl"
    write_checkpoint(state, str(out), author="test")
    return out, report, path


def test_features_match_the_source_network(source_net, converted):
    backbone = detectron2_resnet(norm=SparseSwitchableNorm2d)
    assert load_with_checkpointer(backbone, converted[0]) == []
    assert_same_features(source_net, backbone)
    ours = {name: m for name, m in backbone.named_modules() if isinstance(m, SparseSwitchableNorm2d)}
    assert len(ours) == 53 and {int(m.radius * 100) for m in ours.values()} == {35}


def test_the_fixed_flags_become_the_chosen_branches(source_net, converted):
    state = read_converted(converted[0])
    source = source_net.state_dict()
    for ours, theirs in [("res3.1.conv2", "layer2.1.bn2"), ("res4.0.shortcut", "layer3.0.downsample.1")]:
        for name in ("mean_fixed", "var_fixed"):
            assert state[f"{ours}.norm.{name}"].shape == ()
            assert state[f"{ours}.norm.{name}"].item() == source[f"{theirs}.{name}"].item()
        assert state[f"{ours}.norm.mean_fixed_at"].item() == -1  # the authors' file does not tell when
    fixed = [v.item() for key, v in state.items() if key.endswith("norm.mean_fixed")]
    assert sum(branch == -1 for branch in fixed) == 14 and {0, 1, 2} <= set(fixed)  # 53 layers, every 4th free


def test_report(converted):
    report = converted[1]
    assert report.architecture == "ResNet-50" and report.norm == "SSN"
    assert len(report.converted) == 53 + 53 * 9  # the convs, and 9 tensors of each SSN layer
    assert ("module.layer1.0.sn1.mean_fixed", "res2.0.conv1.norm.mean_fixed") in report.converted
    assert ("module.layer1.0.sn1.radius", "res2.0.conv1.norm.radius") in report.converted
    initialised = {key.rsplit(".", 1)[1] for key, _ in report.initialised}
    assert initialised == {"num_batches_tracked", "mean_fixed_at", "var_fixed_at", "iteration"}
    assert sorted(key for key, _ in report.skipped) == ["module.fc.bias", "module.fc.weight"]
    assert any("28 of the 106 weight vectors" in note for note in report.notes), report.notes


def test_resnet18_without_the_bn_branch_and_a_bare_state_dict(tmp_path):
    net = ssn_net(18, use_bn=False, seed=6)
    path = tmp_path / "ssn_nobn.pth"
    torch.save(ssn_authors_checkpoint(net, prefix="", with_bn=False)["state_dict"], path)
    state, report = convert_file("ssn", str(path))
    assert report.architecture == "ResNet-18" and state["res2.0.conv1.norm.mean_weight"].shape == (2,)
    assert not any("running" in key or "num_batches" in key for key in state)
    assert any("use_bn=False" in note for note in report.notes)
    out = tmp_path / "out.pth"
    write_checkpoint(state, str(out), author="test")
    backbone = detectron2_resnet(norm=lambda c: SparseSwitchableNorm2d(c, use_bn=False), depth=18)
    assert load_with_checkpointer(backbone, out) == []
    assert_same_features(net, backbone)


def test_each_source_refuses_the_others_file_naming_the_right_one(converted, tmp_path):
    with pytest.raises(
        ConversionError, match="a buffer of Sparse Switchable Normalization: convert it with --source ssn"
    ):
        convert_file("sn", str(converted[2]))
    sn_file = tmp_path / "sn.pth"
    torch.save(sn_authors_checkpoint(torchvision_resnet(18, norm_layer=SwitchableNorm2d)), sn_file)
    with pytest.raises(ConversionError, match=r"looks? like an SN ImageNet checkpoint \(--source sn\)"):
        convert_file("ssn", str(sn_file))


def test_a_flag_that_is_not_0_or_1_is_named(source_net, tmp_path):
    checkpoint = ssn_authors_checkpoint(source_net)
    checkpoint["state_dict"]["module.layer1.0.sn2.var_fixed"] = torch.tensor([3])
    path = tmp_path / "bad.pth"
    torch.save(checkpoint, path)
    with pytest.raises(ConversionError, match=r"module\.layer1\.0\.sn2\.var_fixed is 3: a fixed flag is 0 or 1"):
        convert_file("ssn", str(path))
