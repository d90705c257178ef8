import json
import os

import numpy as np
import pycocotools.mask as mask_util
import pytest
from PIL import Image
from pycocotools.coco import COCO

from sn_detection.data.shapes import CATEGORIES, render_image, write_split


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    json_path = write_split(str(folder), seed=5, num_images=24)
    return folder, json_path


def test_json_is_valid_coco(split):
    folder, json_path = split
    coco = COCO(json_path)
    assert len(coco.getImgIds()) == 24
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == list(CATEGORIES)
    for image in coco.loadImgs(coco.getImgIds()):
        assert 128 <= image["width"] <= 320 and 128 <= image["height"] <= 320
        with Image.open(os.path.join(folder, "images", image["file_name"])) as pil:
            assert pil.size == (image["width"], image["height"])
            assert pil.mode == "RGB"


def test_masks_lie_inside_tight_boxes(split):
    _, json_path = split
    coco = COCO(json_path)
    annotations = coco.loadAnns(coco.getAnnIds())
    assert annotations
    for annotation in annotations:
        mask = coco.annToMask(annotation).astype(bool)
        ys, xs = np.nonzero(mask)
        x, y, w, h = annotation["bbox"]
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (x, y, x + w, y + h)
        assert annotation["area"] == mask.sum() >= 40
        assert annotation["iscrowd"] == 0


def test_variety_of_categories_sizes_and_occlusions(split):
    _, json_path = split
    coco = COCO(json_path)
    annotations = coco.loadAnns(coco.getAnnIds())
    assert {a["category_id"] for a in annotations} == set(range(1, len(CATEGORIES) + 1))
    areas = np.array([a["area"] for a in annotations])
    assert areas.max() > 20 * areas.min()
    assert max(len(coco.getAnnIds(imgIds=i)) for i in coco.getImgIds()) >= 3
    assert _count_overlapping_box_pairs(coco) > 0


def _count_overlapping_box_pairs(coco):
    count = 0
    for image_id in coco.getImgIds():
        rles = [coco.annToRLE(a) for a in coco.loadAnns(coco.getAnnIds(imgIds=image_id))]
        boxes = [mask_util.toBbox(r) for r in rles]
        if len(boxes) > 1:
            ious = mask_util.iou(boxes, boxes, [0] * len(boxes))
            count += int((np.triu(ious, k=1) > 0).sum())
    return count


def test_generation_is_deterministic_and_order_free(split, tmp_path):
    folder, json_path = split
    again = write_split(str(tmp_path), seed=5, num_images=24)
    with open(json_path, "rb") as a, open(again, "rb") as b:
        assert a.read() == b.read()
    for name in sorted(os.listdir(os.path.join(folder, "images"))):
        with open(os.path.join(folder, "images", name), "rb") as a, open(tmp_path / "images" / name, "rb") as b:
            assert a.read() == b.read()
    jpeg, width, height, annotations = render_image(seed=5, index=17)
    with open(os.path.join(folder, "images", "000017.jpg"), "rb") as f:
        assert f.read() == jpeg
    recorded = json.load(open(json_path))["annotations"]
    assert [a["segmentation"] for a in annotations] == [a["segmentation"] for a in recorded if a["image_id"] == 18]


def test_seeds_give_different_images():
    assert render_image(seed=5, index=0)[0] != render_image(seed=6, index=0)[0]
