import os

import pytest
from detectron2.data import DatasetCatalog, MetadataCatalog, detection_utils

from sn_detection.data.datasets import SHAPES_SPLITS, register_shapes_datasets, split_folder
from sn_detection.data.shapes import CATEGORIES


@pytest.fixture
def registered_in_tmp(tmp_path):
    """The shapes splits registered under an empty data root; the registration is restored afterwards."""
    saved = {
        name: (DatasetCatalog[name], MetadataCatalog.get(name).as_dict())
        for name in SHAPES_SPLITS
        if name in DatasetCatalog.list()
    }
    _unregister()
    register_shapes_datasets(str(tmp_path))
    yield tmp_path
    _unregister()
    for name, (loader, metadata) in saved.items():
        DatasetCatalog.register(name, loader)
        MetadataCatalog.get(name).set(**{k: v for k, v in metadata.items() if k != "name"})


def _unregister():
    for name in SHAPES_SPLITS:
        if name in DatasetCatalog.list():
            DatasetCatalog.remove(name)
            MetadataCatalog.remove(name)


def test_registration_is_idempotent_and_lazy(registered_in_tmp):
    register_shapes_datasets(str(registered_in_tmp / "elsewhere"))
    for name in SHAPES_SPLITS:
        metadata = MetadataCatalog.get(name)
        assert metadata.thing_classes == list(CATEGORIES)
        assert metadata.evaluator_type == "coco"
        assert metadata.json_file == os.path.join(split_folder(name, str(registered_in_tmp)), "annotations.json")
    assert os.listdir(registered_in_tmp) == []


def test_loading_generates_the_split(registered_in_tmp):
    records = DatasetCatalog.get("sn_shapes_val")
    assert len(records) == SHAPES_SPLITS["sn_shapes_val"].num_images
    assert os.path.isfile(MetadataCatalog.get("sn_shapes_val").json_file)
    record = next(r for r in records if r["annotations"])
    instances = detection_utils.annotations_to_instances(
        record["annotations"], (record["height"], record["width"]), mask_format="bitmask"
    )
    assert instances.gt_masks.tensor.shape == (len(record["annotations"]), record["height"], record["width"])
    assert int(instances.gt_classes.max()) < len(CATEGORIES)
