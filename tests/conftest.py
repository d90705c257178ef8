"""Helpers shared by test folders (tests/helpers) are imported by module name, like each folder's own;
fixtures shared by test folders."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))


def pytest_configure(config):
    """Under pytest-xdist (``make test``), each worker takes its share of the cores for torch's intra-op
    threads: with torch's default, every worker's threads would spin on every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, then torch's count as it was. The models and tensors of the tests
    that use it are tiny: one thread is fastest, several spin on a loaded shared CPU, and one thread also
    makes CPU reductions bit-exact from run to run (the pretraining resume test). A module takes it for
    all its tests with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_classification_set(tmp_path_factory):
    """A tiny embedded classification set (24 classes, 3 train and 1 val image each, 32 px), in the
    ImageFolder layout."""
    from sn_detection.data.classification import ClassificationSpec, prepare_classification_set

    spec = ClassificationSpec(train_seed=3, train_per_class=3, val_seed=4, val_per_class=1, image_size=32)
    return prepare_classification_set(root=str(tmp_path_factory.mktemp("classification")), spec=spec, processes=1)
