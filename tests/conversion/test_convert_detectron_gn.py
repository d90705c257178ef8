"""Detectron's Caffe2 GN pickle -> detectron2: GN features equal the source network's, and the result
equals what detectron2's own Caffe2 loader makes of the same pickle."""

import pytest
import torch
from resnet_sources import (
    assert_same_features,
    detectron2_resnet,
    detectron_gn_blobs,
    load_with_checkpointer,
    write_pickle,
)

from sn_detection.conversion import convert_file, write_checkpoint


@pytest.fixture(scope="module")
def converted(gn_file, tmp_path_factory):
    state, report = convert_file("gn", str(gn_file))
    path = tmp_path_factory.mktemp("gn_out") / "r50_gn.pkl"
    write_checkpoint(state, str(path), author="test")
    return path, report


def test_features_match_the_source_network(gn_net, converted):
    backbone = detectron2_resnet(norm="GN")
    assert load_with_checkpointer(backbone, converted[0]) == []
    assert_same_features(gn_net, backbone)


def test_same_as_detectron2_loading_the_caffe2_pickle_itself(gn_file, converted):
    ours, theirs = detectron2_resnet(norm="GN"), detectron2_resnet(norm="GN")
    load_with_checkpointer(ours, converted[0])
    load_with_checkpointer(theirs, gn_file)
    theirs_state = theirs.state_dict()
    for key, value in ours.state_dict().items():
        assert torch.equal(value, theirs_state[key]), key


def test_report(converted):
    report = converted[1]
    assert report.norm == "GN" and report.architecture == "ResNet-50"
    assert len(report.converted) == 53 * 3
    assert ("res3_0_branch2b_gn_s", "res3.0.conv2.norm.weight") in report.converted
    assert ("res5_0_branch1_w", "res5.0.shortcut.weight") in report.converted
    assert ("conv1_gn_b", "stem.conv1.norm.bias") in report.converted
    reasons = dict(report.skipped)
    assert reasons["fc1000_w"] == "the classifier"
    assert reasons["res2_0_branch2a_w_momentum"] == "SGD momentum"
    assert len(report.skipped) == 2 + 53 * 3 + 2
    assert report.ok


def test_bare_blob_dict_from_a_python2_style_pickle(gn_net, tmp_path):
    """ImageNet pickles may hold the blob dict itself; Python 2 pickles are read with latin1."""
    path = tmp_path / "bare.pkl"
    write_pickle(detectron_gn_blobs(gn_net), path, protocol=2)
    state, _ = convert_file("gn", str(path))
    torch.testing.assert_close(state["res4.3.conv1.norm.weight"], gn_net.layer3[3].bn1.weight.detach())
