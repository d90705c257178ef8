"""docs/custom_dataset.md holds: its script registers a COCO-format dataset that
configs/custom_dataset/mask_rcnn_sn.yaml trains on, in one process and in the processes of --num-gpus 2, the
config's model has the dataset's classes, and the page says, before its training commands, how to make the
pretrained file the config starts from."""

import copy
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from detectron2.data import DatasetCatalog, DatasetMapper, MetadataCatalog
from detectron2.utils.events import EventStorage
from PIL import Image

from sn_detection.data.datasets import check_datasets
from sn_detection.engine.launch import load_cfg
from sn_detection.engine.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "custom_dataset.md")
CONFIG = "configs/custom_dataset/mask_rcnn_sn.yaml"
NAMES = ("my_dataset_train", "my_dataset_val")
# non-contiguous ids, listed out of order: detectron2 maps them, sorted, to 0..2
CATEGORIES = [{"id": 7, "name": "triangle"}, {"id": 2, "name": "square"}, {"id": 4, "name": "bar"}]
# CPU size for a training run: small images, few proposals and RoIs (the model is the config's)
SMALL = [
    "MODEL.DEVICE", "cpu", "MODEL.WEIGHTS", "", "SOLVER.IMS_PER_BATCH", "2", "DATALOADER.NUM_WORKERS", "0",
    "INPUT.MIN_SIZE_TRAIN", "(64,)", "INPUT.MAX_SIZE_TRAIN", "96", "INPUT.MIN_SIZE_TEST", "64",
    "INPUT.MAX_SIZE_TEST", "96", "MODEL.RPN.POST_NMS_TOPK_TRAIN", "32", "MODEL.RPN.POST_NMS_TOPK_TEST", "16",
    "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", "16", "TEST.BATCH_AVERAGE.NUM_BATCHES", "1",
]  # fmt: skip
# and a narrower network for the runs of the script (a ResNet-18 with 16-wide FPN and heads)
NARROW = [
    "MODEL.RESNETS.DEPTH", "18", "MODEL.RESNETS.RES2_OUT_CHANNELS", "64", "MODEL.FPN.OUT_CHANNELS", "16",
    "MODEL.ROI_BOX_HEAD.CONV_DIM", "16", "MODEL.ROI_BOX_HEAD.FC_DIM", "32", "MODEL.ROI_MASK_HEAD.CONV_DIM", "16",
    "SOLVER.MAX_ITER", "2", "SOLVER.STEPS", "()", "SOLVER.WARMUP_ITERS", "1", "TEST.EVAL_PERIOD", "0",
    "TEST.DETECTIONS_PER_IMAGE", "5", "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0",
]  # fmt: skip


def fenced(language: str) -> list[str]:
    with open(PAGE, encoding="utf-8") as f:
        return re.findall(rf"^```{language}\n(.*?)^```", f.read(), flags=re.MULTILINE | re.DOTALL)


def annotation(index: int, image_id: int, category_id: int, box: list, segmentation, crowd: int = 0) -> dict:
    area = box[2] * box[3]
    return {
        "id": index,
        "image_id": image_id,
        "category_id": category_id,
        "bbox": box,
        "area": area,
        "segmentation": segmentation,
        "iscrowd": crowd,
    }


def write_split(folder, split: str, num_images: int, seed: int) -> None:
    """A COCO json of ``num_images`` 64 x 80 images, each with a polygon object of every category and a
    crowd annotation (uncompressed RLE, which detectron2 skips in training), and the images."""
    rng = np.random.default_rng(seed)
    (folder / split).mkdir(parents=True)
    images, annotations = [], []
    crowd = {"size": [64, 80], "counts": [0, 4, 60, 4, 60, 4, 60, 4, 4924]}  # a 4 x 4 corner, column-major
    for image_id in range(num_images):
        name = f"{image_id:03d}.png"
        pixels = rng.integers(0, 60, (64, 80, 3), dtype=np.uint8)
        for k, category in enumerate(CATEGORIES):
            x, y = 6 + 24 * k, 10 + int(rng.integers(0, 20))
            pixels[y : y + 20, x : x + 18] = 80 + 60 * k
            polygon = [x, y, x + 18, y, x + 18, y + 20, x, y + 20]
            annotations.append(annotation(len(annotations) + 1, image_id, category["id"], [x, y, 18, 20], [polygon]))
        annotations.append(annotation(len(annotations) + 1, image_id, 2, [0, 0, 4, 4], crowd, crowd=1))
        Image.fromarray(pixels).save(folder / split / name)
        images.append({"id": image_id, "file_name": name, "height": 64, "width": 80})
    (folder / "annotations").mkdir(exist_ok=True)
    coco = {"images": images, "annotations": annotations, "categories": CATEGORIES}
    (folder / "annotations" / f"{split}.json").write_text(json.dumps(coco), encoding="utf-8")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder as the page sets one up: datasets/my_dataset, the checkout's configs/, the page's script."""
    root = tmp_path_factory.mktemp("custom_dataset")
    write_split(root / "datasets" / "my_dataset", "train", num_images=4, seed=1)
    write_split(root / "datasets" / "my_dataset", "val", num_images=2, seed=2)
    (root / "configs").symlink_to(os.path.join(ROOT, "configs"), target_is_directory=True)
    (script,) = fenced("python")
    (root / "train_my_dataset.py").write_text(script, encoding="utf-8")
    return root


@pytest.fixture
def registered(workspace, monkeypatch):
    """The page's script imported as a module (not as __main__) in the workspace: its datasets registered."""
    monkeypatch.chdir(workspace)
    script = (workspace / "train_my_dataset.py").read_text(encoding="utf-8")
    exec(compile(script, "train_my_dataset.py", "exec"), {"__name__": "train_my_dataset"})
    yield workspace
    for name in NAMES:
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)


@pytest.mark.usefixtures("one_thread")
def test_the_config_builds_and_trains_on_the_registered_dataset(registered):
    cfg = load_cfg(CONFIG, SMALL)  # what tools/train_net.py reads, with its checks of our keys
    assert (cfg.DATASETS.TRAIN, cfg.DATASETS.TEST) == ((NAMES[0],), (NAMES[1],))
    check_datasets(NAMES)  # what the tools check at startup
    dicts = DatasetCatalog.get(NAMES[0])
    metadata = MetadataCatalog.get(NAMES[0])
    assert metadata.thing_classes == ["square", "bar", "triangle"]  # ids 2, 4, 7
    assert cfg.MODEL.ROI_HEADS.NUM_CLASSES == len(metadata.thing_classes)
    assert cfg.INPUT.MASK_FORMAT == "polygon" and cfg.MODEL.RESNETS.NORM == "SN"

    torch.manual_seed(0)
    model = Trainer.build_model(cfg)
    assert model.roi_heads.box_predictor.cls_score.out_features == 3 + 1  # and background
    assert model.roi_heads.mask_head.predictor.out_channels == 3
    batch = [DatasetMapper(cfg, is_train=True)(copy.deepcopy(d)) for d in dicts[:2]]
    assert sorted(batch[0]["instances"].gt_classes.tolist()) == [0, 1, 2]  # the crowd annotation skipped
    with EventStorage(0):
        losses = model(batch)
    assert all(torch.isfinite(loss) for loss in losses.values()), losses


def test_rle_masks_need_the_bitmask_format(registered):
    """The error the page quotes for RLE segmentations under MASK_FORMAT polygon, and bitmask reading them."""
    (record,) = DatasetCatalog.get(NAMES[1])[:1]
    record["annotations"] = [dict(a, iscrowd=0) for a in record["annotations"] if a["iscrowd"]]
    with pytest.raises(ValueError, match=re.escape("Failed to use mask_format=='polygon' from the given")):
        DatasetMapper(load_cfg(CONFIG, SMALL), is_train=True)(copy.deepcopy(record))
    mapped = DatasetMapper(load_cfg(CONFIG, [*SMALL, "INPUT.MASK_FORMAT", "bitmask"]), is_train=True)(record)
    assert mapped["instances"].gt_masks.tensor.shape[0] == 1


def test_the_script_trains_and_evaluates_in_two_processes(workspace):
    """The page's command with --num-gpus 2 on the CPU: each spawned process registers the datasets
    by importing the script, trains 2 iterations and evaluates box and mask AP."""
    (commands,) = [block for block in fenced("bash") if "train_my_dataset.py" in block]
    train = commands.splitlines()[0].split()
    assert train == ["python", "train_my_dataset.py", "--config-file", CONFIG, "--num-gpus", "8"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    output = workspace / "output"
    command = [sys.executable, *train[1:-1], "2", "--dist-url", "auto", *SMALL, *NARROW, "OUTPUT_DIR", str(output)]
    result = subprocess.run(command, cwd=workspace, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert (output / "model_final.pth").is_file()
    results = json.loads((output / "eval_results.json").read_text())[NAMES[1]]
    assert {"bbox", "segm"} <= set(results) and "AP" in results["segm"], results


def test_the_page_makes_the_weights_the_config_starts_from_before_training():
    weights = load_cfg(CONFIG, []).MODEL.WEIGHTS
    assert weights == "pretrained/R-50-SN.pkl"
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    blocks = fenced("bash")
    (convert,) = [i for i, block in enumerate(blocks) if "tools/convert_pretrained.py" in block]
    (train,) = [i for i, block in enumerate(blocks) if "train_my_dataset.py" in block]
    assert convert < train
    words = blocks[convert].split()
    assert words[words.index("--source") + 1] == "sn" and words[2] == weights  # SRC DST --source sn
    prose = page[: page.index(blocks[convert])]
    assert f"The config finetunes from `{weights}`" in prose and "download and convert once" in prose
