"""tools/demo.py: a trained model's predictions drawn on images with detectron2's ``Visualizer``.

The images are the first ``--num-images`` of a registered dataset (``--dataset``, default the embedded
``sn_shapes_val``), drawn as predictions | ground truth side by side, or the files given with
``--input`` (paths or glob patterns), drawn as predictions. Each one is written as a PNG into
``--output`` (default OUTPUT_DIR/demo). On dataset images it also counts what a person checks in the
pictures: an object is *found* when a drawn detection's box overlaps its ground-truth box at IoU >= 0.5,
and *right* when the highest-scoring of those has its class; the counts and the confusion of classes
over the drawn images go to ``objects.md`` in the same folder. The model's own NMS is per class, so one
object can carry boxes of several classes; ``--class-agnostic-nms IOU`` draws only the highest-scoring
of detections that overlap above IOU, whatever their classes. The model is the config's with its trained weights (see
``trained``); it runs as detectron2's ``DefaultPredictor`` runs it (shortest edge resized to
INPUT.MIN_SIZE_TEST, at most MAX_SIZE_TEST, images in INPUT.FORMAT).
"""

from __future__ import annotations

import argparse
import glob
import os
from collections.abc import Sequence

import numpy as np
import torch
from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data import transforms as T
from detectron2.data.detection_utils import convert_image_to_rgb, read_image
from detectron2.layers import nms
from detectron2.structures import Boxes, BoxMode, Instances, pairwise_iou
from detectron2.utils.visualizer import Visualizer
from PIL import Image

from ..data.datasets import check_datasets, register_shapes_datasets
from .launch import load_cfg
from .trained import add_overrides_argument, load_trained_model

OUTPUT_FOLDER = "demo"
OBJECTS_FILE = "objects.md"
# the IoU at which a detection finds an object: COCO's AP50 criterion
FOUND_IOU = 0.5
# The embedded images are small (128-320 px): draw them enlarged so that labels stay readable.
DRAW_SCALE = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Draw a trained model's predictions on images.")
    parser.add_argument("--config-file", metavar="FILE", required=True)
    parser.add_argument(
        "--input", nargs="+", metavar="PATH", help="image files or glob patterns, not folders (default: --dataset)"
    )
    parser.add_argument("--dataset", default="sn_shapes_val", help="registered dataset to draw (sn_shapes_val)")
    parser.add_argument("--num-images", type=int, default=8, help="at most this many images (8)")
    parser.add_argument("--output", metavar="DIR", help=f"default: OUTPUT_DIR/{OUTPUT_FOLDER}")
    parser.add_argument("--confidence-threshold", type=float, default=0.25, help="lowest score drawn (0.25)")
    parser.add_argument(
        "--class-agnostic-nms",
        type=float,
        metavar="IOU",
        help="draw only the highest-scoring of detections overlapping at more than IOU, of any class (off)",
    )
    add_overrides_argument(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_images < 1:
        parser.error(f"--num-images must be >= 1, got {args.num_images}")
    if not 0 <= args.confidence_threshold <= 1:
        parser.error(f"--confidence-threshold must be a score in [0, 1], got {args.confidence_threshold}")
    if args.class_agnostic_nms is not None and not 0 < args.class_agnostic_nms <= 1:
        parser.error(f"--class-agnostic-nms must be an IoU in (0, 1], got {args.class_agnostic_nms}")
    return args


def input_files(patterns: Sequence[str]) -> list[str]:
    """The files named by ``patterns`` (paths or globs), in order, each pattern's matches sorted; a folder
    among them is an error now, before the model is loaded, rather than when it is read as an image."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matches:
            raise FileNotFoundError(f"--input {pattern!r} matches no file")
        for match in matches:
            if os.path.isdir(match):
                example = os.path.join(match, "*.jpg")
                raise IsADirectoryError(
                    f"--input {match!r} is a folder; --input takes image files or glob patterns, e.g. {example!r}"
                )
        files.extend(matches)
    return files


def dataset_records(name: str, num_images: int) -> list[dict]:
    """The first ``num_images`` records of the registered dataset ``name``, whose files are checked first."""
    check_datasets([name])
    return DatasetCatalog.get(name)[:num_images]


def predict(model: torch.nn.Module, cfg, image: np.ndarray) -> Instances:
    """The predicted instances of ``model`` (evaluation mode) for ``image`` (H, W, 3 in INPUT.FORMAT), in
    the image's coordinates, on the CPU."""
    height, width = image.shape[:2]
    resize = T.ResizeShortestEdge([cfg.INPUT.MIN_SIZE_TEST] * 2, cfg.INPUT.MAX_SIZE_TEST)
    resized = resize.get_transform(image).apply_image(image)
    tensor = torch.as_tensor(np.ascontiguousarray(resized.transpose(2, 0, 1)).astype("float32"))
    with torch.no_grad():
        outputs = model([{"image": tensor, "height": height, "width": width}])[0]
    return outputs["instances"].to("cpu")


def suppress_overlaps(instances: Instances, iou: float) -> Instances:
    """``instances`` without each detection that overlaps a higher-scoring one of any class at IoU > ``iou``,
    highest score first (NMS across classes)."""
    return instances[nms(instances.pred_boxes.tensor, instances.scores, iou)]


def draw(image_rgb: np.ndarray, instances: Instances, metadata, record: dict | None = None) -> np.ndarray:
    """The predictions drawn on the image, with the ground truth of ``record`` beside them if given."""
    drawn = Visualizer(image_rgb, metadata, scale=DRAW_SCALE).draw_instance_predictions(instances).get_image()
    if record is None:
        return drawn
    truth = Visualizer(image_rgb, metadata, scale=DRAW_SCALE).draw_dataset_dict(record).get_image()
    return np.concatenate([drawn, truth], axis=1)


def object_classes(instances: Instances, record: dict) -> list[tuple[int, int | None]]:
    """(true class, class of the highest-scoring detection that finds it, or None) for each ground-truth
    object of ``record``, given detections in the image's coordinates."""
    truth = record.get("annotations", [])
    if not truth:
        return []
    boxes = Boxes(torch.tensor([BoxMode.convert(a["bbox"], a["bbox_mode"], BoxMode.XYXY_ABS) for a in truth]))
    overlaps = pairwise_iou(boxes, instances.pred_boxes)  # objects x detections
    scores = torch.where(overlaps >= FOUND_IOU, instances.scores[None, :], torch.tensor(-1.0))
    outcomes = []
    for annotation, object_scores in zip(truth, scores):
        best = int(object_scores.argmax()) if object_scores.numel() and object_scores.max() >= 0 else None
        outcomes.append((annotation["category_id"], None if best is None else int(instances.pred_classes[best])))
    return outcomes


def confusion(outcomes: Sequence[tuple[int, int | None]], num_classes: int) -> np.ndarray:
    """Counts of (true class, class of the top detection that finds the object; the last column: missed)."""
    counts = np.zeros((num_classes, num_classes + 1), dtype=int)
    for true, predicted in outcomes:
        counts[true, num_classes if predicted is None else predicted] += 1
    return counts


def objects_summary(counts: np.ndarray) -> str:
    found, right = int(counts[:, :-1].sum()), int(np.trace(counts[:, :-1]))
    return (
        f"{int(counts.sum())} objects: {found} found (a detection's box at IoU >= {FOUND_IOU} with theirs), "
        f"{right} right (the highest-scoring of those has their class)."
    )


def objects_report(
    counts: np.ndarray, class_names: Sequence[str], threshold: float, agnostic_iou: float | None = None
) -> str:
    """Markdown: ``objects_summary`` and the confusion of classes."""
    across = "" if agnostic_iou is None else f", NMS across classes at IoU {agnostic_iou}"
    lines = [
        f"# Objects in the drawn images (detections with score >= {threshold}{across})",
        "",
        objects_summary(counts) + " Rows: the true class; columns: the class of the highest-scoring "
        "detection that finds the object.",
        "",
        "| true class | " + " | ".join(class_names) + " | missed | right |",
        "|---" * (len(class_names) + 3) + "|",
    ]
    for index, (name, row) in enumerate(zip(class_names, counts)):
        share = f"{row[index] / row.sum():.2f}" if row.sum() else "–"
        lines.append(f"| {name} | " + " | ".join(str(n) for n in row) + f" | {share} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Run tools/demo.py; returns the images written."""
    args = parse_args(argv)
    cfg = load_cfg(args.config_file, args.opts)
    register_shapes_datasets()
    if args.input:
        items = [(path, None) for path in input_files(args.input)[: args.num_images]]
        metadata = MetadataCatalog.get(cfg.DATASETS.TEST[0] if cfg.DATASETS.TEST else cfg.DATASETS.TRAIN[0])
    else:
        items = [(record["file_name"], record) for record in dataset_records(args.dataset, args.num_images)]
        metadata = MetadataCatalog.get(args.dataset)
    model, weights = load_trained_model(cfg, args.opts)
    output_dir = args.output or os.path.join(cfg.OUTPUT_DIR, OUTPUT_FOLDER)
    os.makedirs(output_dir, exist_ok=True)
    written, outcomes = [], []
    for index, (path, record) in enumerate(items):
        image = read_image(path, format=cfg.INPUT.FORMAT)
        instances = predict(model, cfg, image)
        shown = instances[instances.scores >= args.confidence_threshold]
        if args.class_agnostic_nms is not None:
            shown = suppress_overlaps(shown, args.class_agnostic_nms)
        picture = draw(convert_image_to_rgb(image, cfg.INPUT.FORMAT), shown, metadata, record)
        target = os.path.join(output_dir, f"{index:03d}_{os.path.splitext(os.path.basename(path))[0]}.png")
        Image.fromarray(picture).save(target)
        written.append(target)
        print(f"{path}: {len(shown)} detections with score >= {args.confidence_threshold} -> {target}")
        if record is not None:
            outcomes.extend(object_classes(shown, record))
    layout = "predictions | ground truth" if not args.input else "predictions"
    print(f"Demo of {weights or 'the untrained model'}: {len(written)} images ({layout}) in {output_dir}")
    if not args.input:
        counts = confusion(outcomes, len(metadata.thing_classes))
        target = os.path.join(output_dir, OBJECTS_FILE)
        with open(target, "w", encoding="utf-8") as f:
            f.write(objects_report(counts, metadata.thing_classes, args.confidence_threshold, args.class_agnostic_nms))
        print(f"{objects_summary(counts)} Confusion of classes: {target}")
    return written
