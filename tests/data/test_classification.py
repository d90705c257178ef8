import hashlib
import os

import numpy as np
import pytest
from PIL import Image

from sn_detection.data import classification
from sn_detection.data.cache import MANIFEST
from sn_detection.data.classification import (
    CLASSES,
    ClassificationSpec,
    class_outline,
    list_image_folder,
    prepare_classification_set,
    render_sample,
    write_split,
)
from sn_detection.data.shapes import CATEGORIES

TINY = ClassificationSpec(train_seed=3, train_per_class=2, val_seed=4, val_per_class=1, image_size=48)


def _digests(folder):
    digests = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            if name == MANIFEST:
                continue
            with open(path, "rb") as f:
                digests[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def test_classes_include_the_detection_categories():
    assert CLASSES[: len(CATEGORIES)] == CATEGORIES
    assert len(set(CLASSES)) == len(CLASSES) >= 20


@pytest.mark.parametrize("name", CLASSES)
def test_every_outline_is_centred_with_radius_one(name):
    outer, holes = class_outline(name, np.random.default_rng(0))
    assert np.isclose(np.linalg.norm(outer, axis=1).max(), 1.0)
    assert np.allclose((outer.min(axis=0) + outer.max(axis=0)) / 2, 0.0, atol=1e-9)
    # holes cut into the shape (a crescent's hole reaches outside it) but leave a sizeable part
    mask = classification._shape_mask(np.random.default_rng(0), name, 20.0, np.array([32.0, 32.0]), 64)
    assert mask.sum() > 0.15 * np.pi * 20**2


def test_split_layout_is_balanced_and_labelled(tmp_path):
    write_split(str(tmp_path), seed=3, per_class=2, image_size=48)
    classes, samples = list_image_folder(str(tmp_path))
    assert classes == sorted(CLASSES)
    assert len(samples) == 2 * len(CLASSES)
    for path, label in samples:
        index = int(os.path.splitext(os.path.basename(path))[0])
        assert CLASSES[index % len(CLASSES)] == classes[label]
        with Image.open(path) as image:
            assert image.size == (48, 48) and image.mode == "RGB"


def test_generation_is_deterministic_and_independent_of_processes(tmp_path):
    write_split(str(tmp_path / "one"), seed=3, per_class=2, image_size=48, processes=1)
    write_split(str(tmp_path / "two"), seed=3, per_class=2, image_size=48, processes=2)
    first = _digests(tmp_path / "one")
    assert first == _digests(tmp_path / "two")
    jpeg, label = render_sample(3, 29, image_size=48)
    assert CLASSES[label] == CLASSES[29 % len(CLASSES)]
    with open(tmp_path / "one" / CLASSES[label] / "000029.jpg", "rb") as f:
        assert f.read() == jpeg
    assert render_sample(4, 29, image_size=48)[0] != jpeg  # another split seed, another image


def test_prepared_set_is_cached_and_verified(tmp_path, monkeypatch):
    folder = prepare_classification_set(str(tmp_path), TINY, processes=1)
    assert sorted(os.listdir(folder)) == sorted([MANIFEST, "train", "val"])
    digests = _digests(folder)
    calls = []
    monkeypatch.setattr(classification, "write_classification_set", lambda *a, **k: calls.append(a))
    assert prepare_classification_set(str(tmp_path), TINY) == folder
    assert not calls  # reused, not regenerated
    monkeypatch.undo()
    victim = os.path.join(folder, "train", "circle", "000000.jpg")
    open(victim, "wb").close()  # a truncated file: regenerated, identical
    assert prepare_classification_set(str(tmp_path), TINY, processes=1) == folder
    assert _digests(folder) == digests
