"""Every config of configs/ loads, and, shrunk to CPU size, trains one step and runs inference."""

import copy
import glob
import math
import os

import pytest
import torch
from detectron2.config import get_cfg
from detectron2.data import DatasetCatalog, DatasetMapper
from detectron2.modeling import build_model
from detectron2.utils.events import EventStorage

from sn_detection import model_zoo  # importing sn_detection registers our norm names
from sn_detection.d2 import add_sn_config, build_optimizer
from sn_detection.data.datasets import register_shapes_datasets
from sn_detection.layers import update_batch_average
from sn_detection.pretraining.config import add_pretrain_config

CONFIG_DIR = model_zoo.CONFIG_DIR
CONFIGS = sorted(os.path.basename(path)[: -len(".yaml")] for path in glob.glob(os.path.join(CONFIG_DIR, "*.yaml")))
PAPER_CONFIGS = [name for name in CONFIGS if not name.startswith("demo_")]

# CPU size: pretrained files do not exist here, the embedded shapes replace COCO; small images, few RoIs
# and proposals, narrow FPN and heads (the ResNet-50 itself is the configured one).
SHRINK = [
    "MODEL.DEVICE", "cpu", "MODEL.WEIGHTS", "",
    "DATASETS.TRAIN", ("sn_shapes_train",), "DATASETS.TEST", ("sn_shapes_val",),
    "MODEL.ROI_HEADS.NUM_CLASSES", 5, "INPUT.MASK_FORMAT", "bitmask", "SOLVER.IMS_PER_BATCH", 2,
    "INPUT.MIN_SIZE_TRAIN", (64,), "INPUT.MAX_SIZE_TRAIN", 96, "INPUT.MIN_SIZE_TEST", 64, "INPUT.MAX_SIZE_TEST", 96,
    "MODEL.RPN.PRE_NMS_TOPK_TRAIN", 200, "MODEL.RPN.POST_NMS_TOPK_TRAIN", 32,
    "MODEL.RPN.PRE_NMS_TOPK_TEST", 100, "MODEL.RPN.POST_NMS_TOPK_TEST", 16,
    "MODEL.RPN.BATCH_SIZE_PER_IMAGE", 64, "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", 16,
    "TEST.DETECTIONS_PER_IMAGE", 5, "MODEL.ROI_HEADS.SCORE_THRESH_TEST", 0.0,
    "MODEL.FPN.OUT_CHANNELS", 64, "MODEL.ROI_BOX_HEAD.CONV_DIM", 64, "MODEL.ROI_BOX_HEAD.FC_DIM", 64,
    "MODEL.ROI_MASK_HEAD.CONV_DIM", 64, "DATALOADER.NUM_WORKERS", 0, "TEST.BATCH_AVERAGE.NUM_BATCHES", 1,
]  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def load(name, shrink=True):
    cfg = get_cfg()
    add_sn_config(cfg)
    add_pretrain_config(cfg)  # the demo's configs set the PRETRAIN keys of their backbone
    cfg.merge_from_file(os.path.join(CONFIG_DIR, name + ".yaml"))
    if shrink:
        cfg.merge_from_list(SHRINK)
    return cfg


@pytest.fixture(scope="module")
def shapes():
    register_shapes_datasets()
    return DatasetCatalog.get("sn_shapes_train")[:2], DatasetCatalog.get("sn_shapes_val")[:1]


def test_the_configs_are_found():
    assert "mask_rcnn_sn_2x" in CONFIGS
    assert len(PAPER_CONFIGS) >= 20


@pytest.mark.parametrize("name", CONFIGS)
def test_one_training_step_and_inference(name, shapes):
    train_dicts, val_dicts = shapes
    cfg = load(name)
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(cfg, model)
    train_mapper = DatasetMapper(cfg, is_train=True)
    batch = [train_mapper(copy.deepcopy(d)) for d in train_dicts]

    model.train()
    with EventStorage(0):
        losses = model(batch)
        total = sum(losses.values())
        assert math.isfinite(total.item()), losses
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    if cfg.TEST.BATCH_AVERAGE.ENABLED:
        with EventStorage(0):  # detectron2's models log in training mode
            assert update_batch_average(model, iter([batch]), cfg.TEST.BATCH_AVERAGE.NUM_BATCHES) == 1

    model.eval()
    with torch.no_grad():
        (output,) = model([DatasetMapper(cfg, is_train=False)(copy.deepcopy(val_dicts[0]))])
    instances = output["instances"]
    assert torch.isfinite(instances.pred_boxes.tensor).all()
    assert instances.has("pred_masks") == cfg.MODEL.MASK_ON


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_batch_and_learning_rate(name):
    """8 GPUs x 2 images, with the paper's learning rate for that batch (setting 1 rescaled from 12)."""
    cfg = load(name, shrink=False)
    assert cfg.SOLVER.IMS_PER_BATCH == 16
    c4 = cfg.MODEL.ROI_HEADS.NAME == "Res5ROIHeads"
    assert cfg.SOLVER.BASE_LR == pytest.approx(0.01 * 16 / 12 if c4 else 0.02)
    assert cfg.SOLVER.WEIGHT_DECAY == 1e-4 and cfg.SOLVER.WEIGHT_DECAY_NORM == 0.0
    assert cfg.DATASETS.TRAIN == ("coco_2017_train",) and cfg.DATASETS.TEST == ("coco_2017_val",)
    assert cfg.MODEL.ROI_HEADS.NUM_CLASSES == 80
    assert cfg.INPUT.MIN_SIZE_TRAIN == ((600,) if c4 else (800,))


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_batch_average_exactly_where_a_norm_pools_over_the_batch(name):
    """SN, SSN and DN configs use the paper's batch average; BN rows keep their moving average (as the
    paper's BN baselines); the others have nothing to average."""
    cfg = load(name, shrink=False)
    norms = {cfg.MODEL.RESNETS.NORM, cfg.MODEL.FPN.NORM, cfg.MODEL.ROI_BOX_HEAD.NORM, cfg.MODEL.ROI_MASK_HEAD.NORM}
    assert cfg.TEST.BATCH_AVERAGE.ENABLED == bool(norms & {"SN", "SyncSN", "SSN", "SyncSSN", "DN"})
