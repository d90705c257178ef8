"""Helpers shared by test folders (tests/helpers) are imported by module name, like each folder's own;
fixtures shared by test folders."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))


@pytest.fixture(scope="session")
def tiny_classification_set(tmp_path_factory):
    """A tiny embedded classification set (24 classes, 3 train and 1 val image each, 32 px), in the
    ImageFolder layout."""
    from sn_detection.data.classification import ClassificationSpec, prepare_classification_set

    spec = ClassificationSpec(train_seed=3, train_per_class=3, val_seed=4, val_per_class=1, image_size=32)
    return prepare_classification_set(root=str(tmp_path_factory.mktemp("classification")), spec=spec, processes=1)
