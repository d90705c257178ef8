"""What the norms cost at inference: the backbone + FPN and a whole Mask R-CNN in evaluation mode, per norm,
as built and folded (``d2.fold_norms``), in PyTorch and, for the whole model, in onnxruntime.

Not a test: a measurement to run by hand, on CPU and, when available, CUDA:

    tools/benchmark_inference.py [--norms GN,SN,SSN,DN,MN,MGN,BNSR,PONO,FrozenBN] [--rounds 5] [--threads 1]
                                 [--size 320,384] [--parts backbone,mask_rcnn,onnx] [--json out.json]
                                 [--config-file configs/mask_rcnn_gn_2x.yaml] [KEY VALUE ...]

Every setting is the config's R50-FPN Mask R-CNN (by default the model zoo's mask_rcnn 2x: COCO's 81 classes,
256-wide FPN and heads) with one norm at MODEL.RESNETS.NORM, MODEL.FPN.NORM, MODEL.ROI_BOX_HEAD.NORM and
MODEL.ROI_MASK_HEAD.NORM, no stage frozen, the same architecture otherwise; FrozenBN is the floor. The
weights are the initialisation, with running statistics and gates from three training-mode forwards of
other images, so that every layer evaluates as a trained one does (FrozenBN: BatchNorm's, then frozen).
Two images of ``--size`` pixels (H, W):

- ``backbone``: the backbone and FPN on the batch;
- ``mask_rcnn``: the whole model's inference with 100 proposals per image (``PROPOSALS``; the model zoo's
  1000 take 20 s an image through the box head on one CPU thread), and neither NMS nor a score threshold,
  so that every setting sends 100 boxes per image through the box head and 100 detections through the mask
  head, whatever its weights;
- ``onnx``: that inference exported as ``tools/export_model.py --fold`` exports it (tracing, ONNX opset 17)
  and run by onnxruntime, one image per run (the exported graph takes one image): the folded models, beside
  GN as built. On the CPU, its provider with the same number of threads; with ``MODEL.DEVICE cuda``, its
  CUDA provider (onnxruntime-gpu; refused without it).

The PyTorch parts time every norm as built ("SN") and folded ("SN folded"); the ratios are to GN as built. The
settings run in interleaved rounds after two warm-up rounds, so that a load change on a shared machine
hits all of them alike; the table gives each setting's median, its ratio, and the lowest and highest
ratio within one round ("rounds": the run-to-run spread). ``--threads 1`` (the default) gives steady CPU
ratios on a shared machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from collections.abc import Sequence

import torch
from detectron2.layers import FrozenBatchNorm2d
from detectron2.modeling import build_model

from .. import d2
from ..engine.arguments import create_folder_of, positive_int
from ..engine.export import export
from ..engine.launch import load_cfg
from ..layers.sparse_switchable import set_radius, sparse_switchable_layers
from .timing import (
    WARMUP_ROUNDS,
    device_seconds,
    interleaved_seconds,
    norm_setting_cfgs,
    range_text,
    ratio_to,
    timed_norms,
)

NORM_KEYS = ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.ROI_BOX_HEAD.NORM", "MODEL.ROI_MASK_HEAD.NORM")
REFERENCE = "GN"
FOLDED = " folded"
PARTS = ("backbone", "mask_rcnn", "onnx")
FROZEN_BN = "FrozenBN"
WARM_FORWARDS = 3  # training-mode forwards that give running statistics and gates their trained role
# proposals (and detections) per image: the box head's four convolutions over 1000 RoIs take 20 s an image on
# one CPU thread; 100 keep every head's norms in the time at a tenth of it
PROPOSALS = 100


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", default="configs/mask_rcnn_gn_2x.yaml")
    parser.add_argument(
        "--norms", default="GN,SN,SSN,DN,MN,MGN,BNSR,PONO,FrozenBN", help=f"comma-separated; {REFERENCE} always"
    )
    parser.add_argument("--rounds", type=positive_int, default=5, help=f"timed rounds (after {WARMUP_ROUNDS} warm-up)")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads (1)")
    parser.add_argument("--size", default="320,384", help="the images' H,W in pixels (320,384)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"what to time, of {','.join(PARTS)}")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.size = tuple(int(value) for value in args.size.split(","))
    except ValueError:
        parser.error(f"--size must be H,W in pixels, got {args.size!r}")
    if len(args.size) != 2 or min(args.size) < 32:
        parser.error(f"--size must be H,W of at least 32 pixels each, got {args.size}")
    args.parts = [part for part in args.parts.split(",") if part]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--parts: unknown {unknown}; valid parts are {list(PARTS)}")
    args.norms = timed_norms(args.norms, REFERENCE)
    return args


def images(size: tuple[int, int], count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, *size), generator=generator).float() for _ in range(count)]


def trained_like(cfg, size) -> torch.nn.Module:
    """The model of ``cfg`` with running statistics and gates from ``WARM_FORWARDS`` training-mode forwards of
    the backbone (module docstring), in evaluation mode. SSN's layers end as training ends them, each with one
    normalizer for its means and one for its variances: random logits, SparsestMax's radius at 1 (one-hot
    weights), fixed."""
    torch.manual_seed(cfg.SEED if cfg.SEED >= 0 else 0)
    model = build_model(cfg)
    set_radius(model, 1.0)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # the warm forwards' average (FrozenBN's statistics)
    with torch.no_grad():
        for layer in sparse_switchable_layers(model):
            layer.mean_weight.normal_()
            layer.var_weight.normal_()
            layer.fix_one_hot_weights()
    model.backbone.train()
    with torch.no_grad():
        for seed in range(WARM_FORWARDS):
            model.backbone(model.preprocess_image([{"image": image} for image in images(size, 2, seed)]).tensor)
    return model.eval()


class Setting:
    """One model, timed on a batch: the backbone and FPN, the whole inference, the exported inference."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.session = None

    @torch.no_grad()
    def backbone(self, batch):
        tensor = self.model.preprocess_image(batch).tensor
        return device_seconds(lambda: self.model.backbone(tensor), self.device)

    @torch.no_grad()
    def mask_rcnn(self, batch):
        return device_seconds(lambda: self.model(batch), self.device)

    def export_onnx(self, image: torch.Tensor, folder: str, threads: int) -> float:
        import onnxruntime

        report = export(self.model, image, folder, "onnx", "tracing")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self.session = onnxruntime.InferenceSession(report["file"], options, providers=onnx_providers(self.device))
        self.input_name = self.session.get_inputs()[0].name
        return report["max_relative"]

    def onnx(self, batch):
        feeds = [{self.input_name: item["image"].numpy()} for item in batch]
        return device_seconds(lambda: [self.session.run(None, feed) for feed in feeds], self.device)


def onnx_providers(device: torch.device) -> list[str]:
    """onnxruntime's execution provider for the device the benchmark times: the CPU's, or on a CUDA device
    CUDA's (the onnxruntime-gpu package). Where onnxruntime has no CUDA provider the onnx part is refused
    rather than timed on the CPU beside models timed on the GPU."""
    if device.type != "cuda":
        return ["CPUExecutionProvider"]
    import onnxruntime

    available = onnxruntime.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise RuntimeError(
            f"--parts onnx on a CUDA device needs onnxruntime's CUDAExecutionProvider (the onnxruntime-gpu "
            f"package); this onnxruntime has {available}. Install onnxruntime-gpu, or leave onnx out of --parts"
        )
    return ["CUDAExecutionProvider"]


def print_table(part: str, summary: dict) -> None:
    ratio = f"x {REFERENCE}"
    width = max(12, *(len(label) for label in summary))
    print(f"\n{part}: seconds per batch of two images")
    print(f"{'setting':{width}} {'seconds':>9} {ratio:>6} {'rounds':>11}")
    for label, row in summary.items():
        print(f"{label:{width}} {row['seconds']:9.4f} {row['ratio']:6.2f} {range_text(row['ratio_range']):>11}")


def main(argv: Sequence[str] | None = None) -> list:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    fixed = [
        "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0", "MODEL.BACKBONE.FREEZE_AT", "0", "MODEL.WEIGHTS", "",
        "MODEL.RPN.POST_NMS_TOPK_TEST", str(PROPOSALS), "TEST.DETECTIONS_PER_IMAGE", str(PROPOSALS),
        # no suppression: every setting's heads see PROPOSALS boxes per image whatever its weights (with them
        # at their initialisation, NMS keeps as many boxes as their overlaps allow, which the norm changes)
        "MODEL.RPN.NMS_THRESH", "1.0", "MODEL.ROI_HEADS.NMS_THRESH_TEST", "1.0",
    ]  # fmt: skip
    base = load_cfg(args.config_file, fixed + args.opts)
    # FrozenBN is BatchNorm with trained statistics, frozen: BN warmed as the others are, then converted
    built = ["BN" if norm == FROZEN_BN else norm for norm in args.norms]
    cfgs = norm_setting_cfgs(base, built, NORM_KEYS)
    device = torch.device(base.MODEL.DEVICE)
    if "onnx" in args.parts:
        onnx_providers(device)  # before the models are built: refused at once
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, device {device}, images {args.size}")
    settings = {}
    for norm, built_norm in zip(args.norms, built):
        model = trained_like(cfgs[built_norm], args.size)
        if norm == FROZEN_BN:
            model = FrozenBatchNorm2d.convert_frozen_batchnorm(model)
        settings[norm] = Setting(model, device)
        settings[norm + FOLDED] = Setting(d2.fold_norms(copy.deepcopy(model)), device)
    rounds = [
        [{"image": image} for image in images(args.size, 2, 100 + index)]
        for index in range(WARMUP_ROUNDS + args.rounds)
    ]
    rows = []
    for part in args.parts:
        timed = settings
        if part == "onnx":  # what deploys: the folded models, beside GN as built
            timed = {label: s for label, s in settings.items() if label == REFERENCE or label.endswith(FOLDED)}
            with tempfile.TemporaryDirectory() as folder:
                for label, setting in timed.items():
                    error = setting.export_onnx(rounds[0][0]["image"], os.path.join(folder, label), args.threads)
                    print(f"exported {label}: {error:.2g} relative to PyTorch at most")
        summary = ratio_to(interleaved_seconds(timed, rounds, getattr(Setting, part)), REFERENCE)
        print_table(part, summary)
        rows += [
            {"part": part, "setting": label, "device": device.type, "threads": args.threads, "size": args.size, **row}
            for label, row in summary.items()
        ]
    if args.json:
        create_folder_of(args.json)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
