"""Source networks and their files, built once per session (a ResNet-50 file is ~100 MB)."""

import pytest
import torch
from resnet_sources import detectron_gn_blobs, sn_authors_checkpoint, torchvision_resnet, write_pickle
from torch import nn

from sn_detection.layers import SwitchableNorm2d


@pytest.fixture(scope="session")
def bn_net():
    return torchvision_resnet(seed=3)


@pytest.fixture(scope="session")
def bn_file(bn_net, tmp_path_factory):
    path = tmp_path_factory.mktemp("torchvision") / "resnet50.pth"
    torch.save(bn_net.state_dict(), path)
    return path


@pytest.fixture(scope="session")
def sn_net():
    return torchvision_resnet(norm_layer=SwitchableNorm2d, seed=1)


@pytest.fixture(scope="session")
def sn_file(sn_net, tmp_path_factory):
    path = tmp_path_factory.mktemp("sn") / "resnetv1sn50.pth.tar"
    torch.save(sn_authors_checkpoint(sn_net), path)
    return path


@pytest.fixture(scope="session")
def gn_net():
    return torchvision_resnet(norm_layer=lambda c: nn.GroupNorm(32, c), seed=4)


@pytest.fixture(scope="session")
def gn_file(gn_net, tmp_path_factory):
    path = tmp_path_factory.mktemp("gn") / "R-50-GN.pkl"
    write_pickle({"blobs": detectron_gn_blobs(gn_net)}, path)
    return path
