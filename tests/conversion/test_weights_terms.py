"""The terms of each source's weights: the converter prints them beside the file it writes, and
docs/pretrained_weights.md's table states the same licence for every ``--source``."""

import os
import re

import pytest
import torch
from resnet_sources import (
    detectron_gn_blobs,
    sn_authors_checkpoint,
    ssn_authors_checkpoint,
    torchvision_resnet,
    write_pickle,
)
from torch import nn

from sn_detection.conversion import SOURCES, weights_terms
from sn_detection.conversion.cli import main
from sn_detection.layers import SparseSwitchableNorm2d, SwitchableNorm2d

DOC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "pretrained_weights.md"
)
# the licence each source's terms name, as the doc's table names it
LICENCES = {"sn": "CC BY-NC 4.0", "ssn": "names no licence", "gn": "CC BY-SA 3.0", "torchvision": "no licence"}


@pytest.fixture(scope="module")
def source_files(tmp_path_factory):
    """A ResNet-18 file of each source's layout (small and quick)."""
    directory = tmp_path_factory.mktemp("sources")
    torch.save(torchvision_resnet(18, seed=7).state_dict(), directory / "torchvision.pth")
    torch.save(sn_authors_checkpoint(torchvision_resnet(18, norm_layer=SwitchableNorm2d, seed=8)), directory / "sn.pth")
    gn_net = torchvision_resnet(18, norm_layer=lambda c: nn.GroupNorm(32, c), seed=9)
    write_pickle({"blobs": detectron_gn_blobs(gn_net)}, directory / "gn.pkl")
    ssn_net = torchvision_resnet(18, norm_layer=SparseSwitchableNorm2d, seed=10)
    torch.save(ssn_authors_checkpoint(ssn_net), directory / "ssn.pth")
    return {
        "torchvision": directory / "torchvision.pth",
        "sn": directory / "sn.pth",
        "ssn": directory / "ssn.pth",
        "gn": directory / "gn.pkl",
    }


@pytest.mark.parametrize("source", list(SOURCES))
def test_the_converter_prints_the_terms_of_the_weights_beside_the_file(source, source_files, tmp_path, capsys):
    destination = tmp_path / "out.pkl"
    assert main([str(source_files[source]), str(destination), "--source", source]) == 0
    out = capsys.readouterr().out
    wrote = f"wrote {destination}\n"
    assert wrote in out and destination.is_file()
    after = out.split(wrote, 1)[1]
    assert after.startswith("licence: ") and " ".join(after.split()) == f"licence: {weights_terms(source)}"
    assert LICENCES[source] in weights_terms(source)
    assert all(len(line) <= 100 for line in after.splitlines())


def test_the_docs_state_the_licence_each_source_prints():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Licences of the weights", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[2]):
            rows[cells[2].strip("`")] = cells[1]
    assert set(rows) == set(SOURCES)
    for source, stated in rows.items():
        assert LICENCES[source] in stated, (source, stated)
    assert "the use of the database only for non-commercial research and educational purposes" in " ".join(
        section.split()
    )
    assert "ImageNet-1k, whose terms of access allow" in weights_terms("torchvision")
