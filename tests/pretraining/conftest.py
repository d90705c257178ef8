import pytest
import torch

from sn_detection.data.classification import ClassificationSpec, prepare_classification_set

TINY_SET = ClassificationSpec(train_seed=3, train_per_class=3, val_seed=4, val_per_class=1, image_size=32)


@pytest.fixture(scope="session")
def tiny_classification_set(tmp_path_factory):
    """A tiny embedded classification set (24 classes, 3 train and 1 val image each, 32 px), in the
    ImageFolder layout."""
    return prepare_classification_set(root=str(tmp_path_factory.mktemp("classification")), spec=TINY_SET, processes=1)


@pytest.fixture(autouse=True)
def one_thread():
    """Small models on a shared 2-core machine: one thread, and bit-exact reductions for the resume test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
