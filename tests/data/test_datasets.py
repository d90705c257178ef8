import os

import pytest
from detectron2.data import DatasetCatalog, MetadataCatalog, detection_utils
from detectron2.data.datasets import register_coco_instances

from sn_detection.data import shapes
from sn_detection.data.datasets import (
    SHAPES_SPLITS,
    SplitSpec,
    check_datasets,
    data_root,
    prepare_split,
    register_shapes_datasets,
    split_folder,
)
from sn_detection.data.shapes import CATEGORIES, render_image


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


# Bad data locations and damaged or interrupted generation (three-image splits: generated in a moment).
TINY_SPLIT = SplitSpec(seed=2, num_images=3)


@pytest.fixture
def tiny_val(monkeypatch):
    monkeypatch.setitem(SHAPES_SPLITS, "sn_shapes_val", TINY_SPLIT)
    return "sn_shapes_val"


def test_an_unwritable_data_root_is_named(tiny_val, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "datasets"
    not_a_folder.write_text("a file where the data folder should be")
    monkeypatch.setenv("SN_DETECTION_DATA", str(not_a_folder))
    with pytest.raises(OSError) as error:
        prepare_split(tiny_val, data_root())
    message = str(error.value)
    assert f"cannot generate dataset 'sn_shapes_val' in {not_a_folder}" in message
    assert "point SN_DETECTION_DATA" in message and "at a writable folder" in message


def test_a_corrupted_image_or_annotation_file_is_regenerated(tiny_val, tmp_path):
    folder = prepare_split(tiny_val, str(tmp_path))
    image = os.path.join(folder, "images", "000001.jpg")
    annotations = os.path.join(folder, "annotations.json")
    originals = {path: open(path, "rb").read() for path in (image, annotations)}
    with open(image, "r+b") as f:  # same size, other bytes: only the hash can tell
        f.seek(len(originals[image]) // 2)
        f.write(b"\0" * 16)
    with open(annotations, "r+b") as f:
        f.truncate(len(originals[annotations]) // 2)
    assert prepare_split(tiny_val, str(tmp_path)) == folder
    for path, content in originals.items():
        assert open(path, "rb").read() == content, path


def test_a_file_in_place_of_the_cache_folder_is_replaced(tiny_val, tmp_path):
    (tmp_path / os.path.basename(split_folder(tiny_val, str(tmp_path)))).write_text("not a folder")
    folder = prepare_split(tiny_val, str(tmp_path))
    assert sorted(os.listdir(os.path.join(folder, "images"))) == ["000000.jpg", "000001.jpg", "000002.jpg"]


def test_an_interrupted_generation_leaves_nothing(tiny_val, tmp_path, monkeypatch):
    def render_then_interrupt(seed, index):
        if index == 2:
            raise KeyboardInterrupt
        return render_image(seed, index)

    monkeypatch.setattr(shapes, "render_image", render_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_split(tiny_val, str(tmp_path))
    assert os.listdir(tmp_path) == []  # neither the split folder nor the temporary one


@pytest.fixture
def coco_dataset(tmp_path):
    """A dataset registered the usual way (register_coco_instances), removed afterwards."""
    name = "sn_test_coco_dataset"
    json_file, image_root = tmp_path / "instances.json", tmp_path / "images"
    register_coco_instances(name, {}, str(json_file), str(image_root))
    yield name, json_file, image_root
    DatasetCatalog.remove(name)
    MetadataCatalog.remove(name)


def test_check_datasets_names_a_missing_annotation_file_or_image_folder(coco_dataset):
    name, json_file, image_root = coco_dataset
    with pytest.raises(FileNotFoundError, match=f"dataset '{name}': its annotation file {json_file} does not exist"):
        check_datasets([name])
    json_file.write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"dataset '{name}': its image folder {image_root} does not exist"):
        check_datasets([name])
    image_root.mkdir()
    check_datasets([name])


def test_check_datasets_names_an_unregistered_dataset(registered_in_tmp):
    message = r"dataset 'coco_2017_tain' is not registered; registered datasets: \[.*'coco_2017_train'"
    with pytest.raises(ValueError, match=message):
        check_datasets(["coco_2017_tain"])
    check_datasets(list(SHAPES_SPLITS))  # generated when loaded: no file needed yet
    assert os.listdir(registered_in_tmp) == []
