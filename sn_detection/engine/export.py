"""tools/export_model.py: a trained model out of PyTorch, as detectron2's ``tools/deploy/export_model.py`` does
it, for every config of this package (yaml or LazyConfig), then the exported model run on the sample and
compared with PyTorch.

    tools/export_model.py --config-file CONFIG --output DIR [--format onnx|torchscript]
        [--export-method tracing|scripting] [--sample-image IMAGE] [--fold] [KEY VALUE ... | key=value ...]

- The model: the config's, with its trained weights (``MODEL.WEIGHTS FILE`` for a yaml config,
  ``train.init_checkpoint=FILE`` for a LazyConfig, whose overrides are ``key=value``), in evaluation mode;
  with ``--fold`` its norms folded for inference first (``d2.fold_norms``).
- The sample: ``--sample-image``, or the first image of the config's first test dataset, resized as
  ``DefaultPredictor`` resizes (INPUT.MIN_SIZE_TEST, MAX_SIZE_TEST) and in INPUT.FORMAT.
- Tracing (the default) wraps the model in detectron2's ``TracingAdapter`` around ``inference`` without
  postprocessing (an R-CNN returns its instances at the input's size, masks as RoI masks), and writes
  ``model.onnx`` (``torch.onnx.export``, the TorchScript-based exporter, opset 17) or ``model.ts``
  (``torch.jit.trace``). Scripting (``detectron2.export.scripting_with_instances``) writes ``model.ts``;
  ONNX needs tracing.
- The check: the exported file is loaded back and run (ONNX by onnxruntime on the CPU, the TorchScript by
  torch) next to the trained PyTorch model (unfolded, with ``--fold``), on the sample and, for a traced
  file, on the sample turned a quarter (the exported ONNX graph takes any image size: its height and width
  are dynamic); every output's largest difference is printed, with that relative to the output's largest
  magnitude, and ``export`` returns them. An R-CNN's detections are compared as a set: each of PyTorch's
  with the exported one of its class nearest in box and score (``_in_order_of``), since detections of all
  but equal scores may come in either order.

Exporting needs the model in evaluation mode: a layer whose training output depends on the batch would
record batch statistics. ONNX needs the optional extra ``pip install sn_detection[export]``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import os
from collections.abc import Sequence

import numpy as np
import torch
from detectron2.config import LazyConfig, instantiate
from detectron2.data import DatasetCatalog
from detectron2.data import transforms as T
from detectron2.data.detection_utils import read_image
from detectron2.export import TracingAdapter, scripting_with_instances
from detectron2.modeling import GeneralizedRCNN
from detectron2.structures import Boxes
from torch import Tensor, nn

from .. import d2
from ..data.datasets import check_datasets, register_shapes_datasets
from .launch import load_cfg
from .trained import load_trained_model

FORMATS = ("onnx", "torchscript")
METHODS = ("tracing", "scripting")
ONNX_OPSET = 17
FILE_NAMES = {"onnx": "model.onnx", "torchscript": "model.ts"}
# What R-CNN inference's Instances hold, for scripting (detectron2's own export test declares the same).
INSTANCE_FIELDS = {
    "proposal_boxes": Boxes,
    "objectness_logits": Tensor,
    "pred_boxes": Boxes,
    "scores": Tensor,
    "pred_classes": Tensor,
    "pred_masks": Tensor,
    "pred_keypoints": Tensor,
    "pred_keypoint_heatmaps": Tensor,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Export a trained model (ONNX or TorchScript) and check it.")
    parser.add_argument("--config-file", metavar="FILE", required=True, help="a yaml config or a LazyConfig (.py)")
    parser.add_argument("--format", choices=FORMATS, default="onnx", help="onnx (default) or torchscript")
    parser.add_argument(
        "--export-method", choices=METHODS, default="tracing", help="tracing (default); scripting: TorchScript only"
    )
    parser.add_argument("--output", metavar="DIR", required=True, help=f"folder for {' or '.join(FILE_NAMES.values())}")
    parser.add_argument(
        "--sample-image", metavar="IMAGE", help="the image to trace and check on (default: the first test image)"
    )
    parser.add_argument("--fold", action="store_true", help="fold the norms for inference first (d2.fold_norms)")
    parser.add_argument(
        "opts",
        nargs=argparse.REMAINDER,
        help="config overrides: KEY VALUE for a yaml config (MODEL.WEIGHTS FILE: the trained weights), key=value "
        "for a LazyConfig (train.init_checkpoint=FILE)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.format == "onnx" and args.export_method == "scripting":
        parser.error("--export-method scripting writes TorchScript only: use --format torchscript, or tracing for ONNX")
    return args


def is_lazy_config(config_file: str) -> bool:
    return config_file.endswith(".py")


def load_model(config_file: str, opts: list) -> tuple[nn.Module, dict]:
    """The trained model of the config in evaluation mode, and what the sample needs of the config
    (``test_dataset``, the test loader's ``augmentations``, ``image_format``)."""
    if is_lazy_config(config_file):
        cfg = LazyConfig.apply_overrides(LazyConfig.load(config_file), opts)
        model = instantiate(cfg.model)
        model.to(cfg.train.device if torch.cuda.is_available() else "cpu")
        d2.CheckedCheckpointer(model).evaluate_from(cfg.train.init_checkpoint, "train.init_checkpoint")
        dataset = cfg.dataloader.test.dataset.names
        return model.eval(), dict(
            test_dataset=dataset if isinstance(dataset, str) else dataset[0],
            augmentations=instantiate(cfg.dataloader.test.mapper.get("augmentations", [])),
            image_format=getattr(cfg.model, "input_format", "BGR"),
        )
    cfg = load_cfg(config_file, opts)
    model, _ = load_trained_model(cfg, opts)
    resize = (
        [T.ResizeShortestEdge([cfg.INPUT.MIN_SIZE_TEST] * 2, cfg.INPUT.MAX_SIZE_TEST)]
        if cfg.INPUT.MIN_SIZE_TEST
        else []
    )
    return model, dict(
        test_dataset=cfg.DATASETS.TEST[0] if cfg.DATASETS.TEST else None,
        augmentations=resize,
        image_format=cfg.INPUT.FORMAT,
    )


def sample_image(path: str | None, sample: dict) -> Tensor:
    """The (3, H, W) float tensor the model is traced and checked on (module docstring)."""
    if path is None:
        dataset = sample["test_dataset"]
        if dataset is None:
            raise ValueError("the config has no test dataset to take a sample from: give --sample-image IMAGE")
        register_shapes_datasets()
        check_datasets([dataset])
        path = DatasetCatalog.get(dataset)[0]["file_name"]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--sample-image {path} does not exist")
    image = read_image(path, format=sample["image_format"])
    for augmentation in sample["augmentations"]:
        image = augmentation.get_transform(image).apply_image(image)
    return torch.as_tensor(np.ascontiguousarray(image.astype("float32").transpose(2, 0, 1)))


def _inference(model: nn.Module):
    """What the exported model computes: R-CNN inference without postprocessing (instances at the input's
    size), as detectron2's export_model.py; any other model is called on the image."""
    if isinstance(model, GeneralizedRCNN):

        def inference(model, inputs):
            return [{"instances": model.inference(inputs, do_postprocess=False)[0]}]

        return inference
    return None


def export(
    model: nn.Module,
    image: Tensor,
    output: str,
    format: str = "onnx",
    method: str = "tracing",
    reference: nn.Module | None = None,
) -> dict:
    """Export ``model`` (in evaluation mode) traced or scripted on ``image`` into the folder ``output``, run the
    exported file on the image beside ``reference`` (default: the model itself; the unfolded model when
    ``model`` is its folded copy), and return {"file": path, "outputs": [(name, max |diff|, relative)],
    "max_relative": the largest relative difference} (module docstring)."""
    if format not in FORMATS or method not in METHODS:
        raise ValueError(f"format must be one of {FORMATS} and method one of {METHODS}, got {format!r}, {method!r}")
    if format == "onnx" and method == "scripting":
        raise ValueError("scripting writes TorchScript only: export ONNX with method='tracing'")
    if model.training:
        raise ValueError(
            "the model is in training mode, where our layers (and BatchNorm) normalize with the batch's statistics: "
            "call model.eval() before exporting"
        )
    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, FILE_NAMES[format])
    inputs = [{"image": image}]
    reference = model if reference is None else reference.eval()
    if method == "scripting":
        return _export_scripted(model, inputs, path, reference)
    adapter = TracingAdapter(model, inputs, _inference(model)).eval()
    reference_adapter = TracingAdapter(reference, inputs, _inference(reference)).eval()
    with torch.no_grad():
        if format == "onnx":
            _onnx_export(adapter, image, path)
            run = functools.partial(_run_onnx, path)
        else:
            torch.jit.save(torch.jit.trace(adapter, adapter.flattened_inputs, check_trace=False), path)
            run = functools.partial(_run_torchscript, torch.jit.load(path))
        names, rows = None, []
        # the sample, and the sample turned a quarter (its height and width swapped): the traced file must take
        # other sizes than the one it was traced at
        for check in (image, image.transpose(1, 2).contiguous()):
            got, expected = run([check]), reference_adapter(check)
            if len(got) != len(expected):
                raise RuntimeError(f"the exported model gives {len(got)} outputs, PyTorch {len(expected)}")
            names, got = _named_outputs(adapter, got)
            _, expected = _named_outputs(adapter, expected)
            got = _in_order_of(names, got, expected)
            size = "x".join(str(side) for side in check.shape[1:])
            rows += _compared([f"{name} ({size})" for name in names], got, expected)
    return _report(path, rows)


def _run_torchscript(module, inputs) -> list:
    return list(module(*inputs))


def _named_outputs(adapter: TracingAdapter, flat) -> tuple[list, list]:
    """The flattened outputs with names: an R-CNN's instances by field (and their image size), others by index."""
    rebuilt = adapter.outputs_schema(list(flat))
    if isinstance(rebuilt, list) and rebuilt and isinstance(rebuilt[0], dict) and "instances" in rebuilt[0]:
        instances = rebuilt[0]["instances"]
        fields = {name: getattr(value, "tensor", value) for name, value in instances.get_fields().items()}
        fields["image_size"] = torch.as_tensor(instances.image_size)
        return list(fields), list(fields.values())
    return [f"output {index}" for index in range(len(flat))], list(flat)


def _in_order_of(names: list, got: list, expected: list) -> list:
    """An R-CNN's exported detections in the order of PyTorch's: each of PyTorch's, by rank, paired with the
    exported one of the same class nearest to it in box and score, not yet paired. Which of two detections of
    all but equal scores comes first is no part of a detector's result, and a runtime whose rounding differs
    may swap them (an untrained model scores every box and class near 1 / classes); the differences are then
    taken between paired detections. Other outputs are left as they are."""
    fields = dict(zip(names, range(len(names))))
    if not {"pred_boxes", "scores", "pred_classes"} <= set(fields):
        return got
    boxes, scores, classes = (fields[name] for name in ("pred_boxes", "scores", "pred_classes"))
    count = len(expected[scores])
    if any(len(got[index]) != count for index in (boxes, scores, classes)):
        return got  # different counts: reported as different shapes
    distance = (got[boxes][None].double() - expected[boxes][:, None].double()).abs().amax(-1)
    distance = distance + (got[scores][None].double() - expected[scores][:, None].double()).abs()
    distance[got[classes][None] != expected[classes][:, None]] = float("inf")
    order, free = [], torch.ones(count, dtype=torch.bool)
    for row in distance:
        pick = int(torch.where(free, row, torch.full_like(row, float("inf"))).argmin())
        order.append(pick)
        free[pick] = False
    order = torch.tensor(order, dtype=torch.long)
    return [
        value[order] if index != fields.get("image_size") and len(value) == count else value
        for index, value in enumerate(got)
    ]


def _onnx_export(adapter: nn.Module, image: Tensor, path: str) -> None:
    # torch >= 2.5 exports through dynamo unless told otherwise; detectron2's tool takes the TorchScript-based one
    dynamo = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    # the image's height and width are the graph's to take: detectron2 traces its shape-dependent code as
    # operations (anchors, padding, boxes clipped to the image)
    names = [f"input_{index}" for index in range(len(adapter.flattened_inputs))]
    dynamic = {names[0]: {1: "height", 2: "width"}}
    torch.onnx.export(
        adapter,
        adapter.flattened_inputs,
        path,
        opset_version=ONNX_OPSET,
        input_names=names,
        dynamic_axes=dynamic,
        **dynamo,
    )


def _run_onnx(path: str, inputs) -> list:
    try:
        import onnxruntime
    except ImportError as error:
        raise ImportError(
            "checking an ONNX export needs onnxruntime: pip install 'sn_detection[export]' (onnx and onnxruntime)"
        ) from error
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = {node.name: value.cpu().numpy() for node, value in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(value) for value in session.run(None, feed)]


def _export_scripted(model: nn.Module, inputs: list, path: str, reference: nn.Module) -> dict:
    scripted = scripting_with_instances(model, INSTANCE_FIELDS)
    torch.jit.save(scripted, path)
    loaded = torch.jit.load(path)
    fields = ("pred_boxes", "scores", "pred_classes", "pred_masks")
    with torch.no_grad():
        got = loaded.inference(inputs, do_postprocess=False)[0]
        expected = reference.inference(inputs, do_postprocess=False)[0]
    values = [
        [getattr(instances, field).tensor if field == "pred_boxes" else getattr(instances, field) for field in fields]
        for instances in (got, expected)
    ]
    return _report(path, _compared(list(fields), *values))


def _compared(names: list, got, expected) -> list:
    """(name, max |difference|, that relative to the output's largest magnitude) per output."""
    rows = []
    for name, value, reference in zip(names, got, expected):
        value, reference = torch.as_tensor(value).double(), torch.as_tensor(reference).double()
        if value.shape != reference.shape:
            raise RuntimeError(
                f"{name}: the exported model gives shape {tuple(value.shape)}, PyTorch {tuple(reference.shape)}"
            )
        difference = (value - reference).abs().max().item() if reference.numel() else 0.0
        scale = reference.abs().max().item() if reference.numel() else 0.0
        rows.append((name, difference, difference / scale if scale else difference))
    return rows


def _report(path: str, rows: list) -> dict:
    return {"file": path, "outputs": rows, "max_relative": max((row[2] for row in rows), default=0.0)}


def main(argv: Sequence[str] | None = None) -> dict:
    """Run tools/export_model.py; returns ``export``'s report."""
    args = parse_args(argv)
    model, sample = load_model(args.config_file, args.opts)
    reference = None
    if args.fold:
        reference = copy.deepcopy(model)
        d2.fold_norms(model)
    image = sample_image(args.sample_image, sample)
    report = export(model, image, args.output, args.format, args.export_method, reference)
    folded = ", norms folded" if args.fold else ""
    print(f"Exported {args.config_file} ({args.format}, {args.export_method}{folded}) to {report['file']}")
    print("The exported model against the PyTorch model, on the sample and on it turned a quarter (H x W px):")
    for name, difference, relative in report["outputs"]:
        print(f"  {name}: max |difference| {difference:.3g} ({relative:.3g} of its largest value)")
    return report
