"""Tiny trained Mask R-CNNs as files (a yaml config and its weights), and what tools/export_model.py's tests
check of its report."""

import os

import torch
from detectron2.modeling import build_model
from PIL import Image
from tiny_rcnn import synthetic_batch, tiny_cfg, train_step

from sn_detection.engine import export as export_tool

TOLERANCE = 1e-4  # relative to each output's largest value (the layers' own exports hold 1e-5)


def write_sample_image(folder) -> str:
    """An image of the tiny models' synthetic batch, cropped to 48 x 64 pixels (not square: the check of another
    size turns it a quarter), as a PNG file in ``folder``."""
    path = os.path.join(folder, "image.png")
    image = synthetic_batch(seed=3)[0]["image"][:, :48]  # BGR, as the config reads it
    Image.fromarray(image.permute(1, 2, 0).flip(-1).byte().numpy()).save(path)
    return path


def trained_files(norm: str, folder) -> tuple[str, str]:
    """A tiny Mask R-CNN config with ``norm`` everywhere (a yaml file) and its weights after one step."""
    cfg = tiny_cfg(norm, "fpn", "MODEL.RESNETS.DEPTH", 18, "MODEL.RESNETS.RES2_OUT_CHANNELS", 64)
    cfg.merge_from_list(["MODEL.ROI_HEADS.SCORE_THRESH_TEST", 0.0, "TEST.DETECTIONS_PER_IMAGE", 10])
    cfg.merge_from_list(["INPUT.MIN_SIZE_TEST", 64, "INPUT.MAX_SIZE_TEST", 96, "DATASETS.TEST", []])
    # one convolution per head: exporting takes time per layer, and the heads' layers are the backbone's kind
    cfg.merge_from_list(["MODEL.ROI_BOX_HEAD.NUM_CONV", 1, "MODEL.ROI_MASK_HEAD.NUM_CONV", 1])
    torch.manual_seed(0)
    model = build_model(cfg)
    train_step(cfg, model)
    config, weights = os.path.join(folder, "config.yaml"), os.path.join(folder, "model.pth")
    with open(config, "w") as f:
        f.write(cfg.dump())
    torch.save({"model": model.state_dict()}, weights)
    return config, weights


def run_tool(config, weights, sample, output, *flags) -> dict:
    argv = ["--config-file", config, "--output", str(output), "--sample-image", sample, *flags]
    return export_tool.main([*argv, "MODEL.WEIGHTS", weights])


def assert_agrees(report, traced: bool = True):
    """Every output within ``TOLERANCE`` of PyTorch's, the classes exactly; a traced file at the sample's size
    and at the sample turned a quarter (engine.export)."""
    fields = {name.split(" (")[0] for name, _, _ in report["outputs"]}
    assert {"pred_boxes", "scores", "pred_classes", "pred_masks"} <= fields, report
    sizes = {name.split(" (")[1] for name, _, _ in report["outputs"] if " (" in name}
    assert len(sizes) == (2 if traced else 0), report
    for name, difference, relative in report["outputs"]:
        if name.startswith("pred_classes"):
            assert difference == 0, report
        assert relative <= TOLERANCE, report
