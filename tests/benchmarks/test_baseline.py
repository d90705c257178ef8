"""The benchmarks' ``--baseline REF``: the layers of another commit of this checkout import beside this one's,
and each layer's twin there has its class, options and state."""

import os
import subprocess
import sys

import pytest
import torch

from sn_detection.benchmarks.baseline import baseline_layers, baseline_twin, with_baseline_norms
from sn_detection.layers import NORM_NAMES, NormBase, build_norm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_commits_layers_import_as_a_package_of_their_own():
    label, package = baseline_layers("HEAD")
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert label == "@" + commit[:9]
    assert package.__name__ == "sn_layers_" + commit[:12] and package.NormBase is not NormBase
    assert baseline_layers(commit.strip()) == (label, package)  # imported once


@pytest.mark.parametrize("name", [name for name in NORM_NAMES if name != "GN"])
def test_a_twin_is_the_same_layer_in_the_baselines_code(name):
    _, package = baseline_layers("HEAD")
    torch.manual_seed(0)
    layer = build_norm(name, 16)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    layer(torch.randn(4, 16, 3, 3))  # running statistics off their initial values
    twin = baseline_twin(package, layer)
    assert type(twin).__module__.startswith(package.__name__) and type(twin).__name__ == type(layer).__name__
    torch.testing.assert_close(twin.state_dict(), layer.state_dict(), rtol=0, atol=0)
    x = torch.randn(2, 16, 5, 4)
    for training in (True, False):
        torch.testing.assert_close(twin.train(training)(x), layer.train(training)(x))


def test_a_model_takes_the_baselines_norms_in_place_of_its_own():
    _, package = baseline_layers("HEAD")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), build_norm("SN", 8), torch.nn.Sequential(build_norm("MN", 8)))
    with_baseline_norms(package, model, norm_base=NormBase)
    assert [type(m).__module__.split(".")[0] for m in (model[1], model[2][0])] == [package.__name__] * 2


def test_a_ref_that_names_no_commit_is_refused():
    with pytest.raises(ValueError, match="--baseline no-such-ref: no such commit in"):
        baseline_layers("no-such-ref")
    tool = os.path.join(REPO, "tools", "benchmark_norms.py")
    result = subprocess.run(
        [sys.executable, tool, "--baseline", "no-such-ref"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "--baseline no-such-ref: no such commit in" in result.stderr
