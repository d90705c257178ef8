"""End-to-end cost of the norms: one Mask R-CNN training step and one inference, per normalizer setting.

Not a test: a measurement to run by hand, on CPU and, when available, CUDA:

    tools/benchmark_train.py [--norms GN,SN,FrozenBN] [--rounds 8] [--threads N] [--json out.json]
                             [--graphed-backbone] [--baseline REF] [--config-file configs/demo_mask_rcnn_gn.yaml]
                             [KEY VALUE ...]
    tools/benchmark_train.py --config-file configs/lazy/mask_rcnn_sn_lsj_100ep.py --norms GN,SN \\
                             --graphed-backbone [key=value ...]

Every setting puts its norm in the backbone, the FPN and both heads of the same model: a yaml config's
MODEL.RESNETS.NORM, MODEL.FPN.NORM, MODEL.ROI_BOX_HEAD.NORM and MODEL.ROI_MASK_HEAD.NORM (``KEY VALUE``
overrides), or the same five places of a LazyConfig (``.py``; ``key=value`` overrides), where our norms
get their layers' default options. By default the model is the CPU demo's R50-FPN (160 px inputs,
128-wide FPN and heads, 64 RoIs per image, 2 images per batch). FrozenBN, a fixed per-channel affine, is
the floor any normalizer is compared with.

- Training step: forward, backward and SGD step of the same pre-loaded batches (data loading excluded),
  at learning rate 0: the cost of a step does not depend on the weights, and the models stay at their
  initialisation (a FrozenBN network trained from scratch would diverge within a few steps). A config
  that trains with mixed precision (SOLVER.AMP.ENABLED, train.amp.enabled: the LSJ recipe) is timed so,
  as detectron2's AMPTrainer steps: fp16 autocast and a gradient scaler, on CUDA only.
- Inference: evaluation-mode forward of those images without gradients, with the score threshold at 0
  so that every model sends the same number of detections (TEST.DETECTIONS_PER_IMAGE) through the
  mask head, whatever it has learned.
- ``--graphed-backbone``: each norm's backbone and FPN replayed as CUDA graphs
  (``sn_detection.d2.graphed_backbone``; two graphs, the training step's input shape and the
  inference's), labelled ``SN+graphs``; the ratios are then to ``GN+graphs``, and GN without graphs is
  timed beside it. It needs CUDA and inputs of one size, such as the LSJ configs' 1024 x 1024 crops: the
  tool stops if the warm-up has not captured both graphs of every setting.
- ``--baseline REF``: each of our learned norms also with its layers as commit REF of this checkout has
  them (``baseline``), labelled ``SN @COMMIT``, in the same rounds.

Kernels are compiled or chosen per input shape (Triton's specializations of its integer arguments, cuDNN's
and oneDNN's algorithms), and the batches' image sizes differ: every setting first runs every batch once,
untimed (and, with graphs, at least as often as the capture needs), so that the rounds time steps rather
than compilations. The settings are then timed in interleaved rounds, one per batch, so that a load change
on a shared machine hits all of them alike; the table gives each setting's median, its ratio to the
reference, and the lowest and highest ratio within one round ("rounds": the run-to-run spread).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
from collections.abc import Sequence

import torch
from detectron2.config import LazyCall as L
from detectron2.config import LazyConfig, instantiate
from detectron2.data import build_detection_train_loader
from detectron2.modeling import build_model
from detectron2.utils.events import EventStorage

from .. import d2
from ..d2.graphed_backbone import graph_backbone
from ..data.datasets import register_shapes_datasets
from ..engine.arguments import create_folder_of
from ..engine.launch import load_cfg
from ..layers import NORM_NAMES, NormBase, NormFactory
from .baseline import baseline_layers, with_baseline_norms
from .timing import (
    device_seconds,
    interleaved_seconds,
    norm_benchmark_parser,
    norm_setting_cfgs,
    range_text,
    ratio_to,
    timed_norms,
)

NORM_KEYS = ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.ROI_BOX_HEAD.NORM", "MODEL.ROI_MASK_HEAD.NORM")
LAZY_NORM_KEYS = (
    "model.backbone.bottom_up.stem.norm", "model.backbone.bottom_up.stages.norm", "model.backbone.norm",
    "model.roi_heads.box_head.conv_norm", "model.roi_heads.mask_head.conv_norm",
)  # fmt: skip
REFERENCE = "GN"
GRAPHED = "+graphs"
GRAPH_WARMUP = 3  # eager calls of an input shape before its capture
MAX_GRAPHS = 2  # the training step's input shape and the inference's


class YamlModels:
    """The settings of a yaml config: its model with a norm at every key of ``NORM_KEYS``."""

    def __init__(self, config_file: str, opts: list):
        fixed = ["DATALOADER.NUM_WORKERS", "0", "SOLVER.BASE_LR", "0.0", "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"]
        self.cfg = load_cfg(config_file, fixed + opts)
        self.device = torch.device(self.cfg.MODEL.DEVICE)
        self.amp, self.amp_key = self.cfg.SOLVER.AMP.ENABLED, "SOLVER.AMP.ENABLED"
        self._norm_cfgs = {}

    def check(self, norms) -> None:
        """Every norm's config validated before any model is built (``norm_setting_cfgs``)."""
        self._norm_cfgs = norm_setting_cfgs(self.cfg, norms, NORM_KEYS)

    def batches(self, count: int) -> list:
        loader = iter(build_detection_train_loader(self.cfg))
        return [next(loader) for _ in range(count)]

    def build(self, norm: str, transform=None):
        """The model of ``norm`` (``transform(model)`` first, if given) and its optimizer."""
        cfg = self._norm_cfgs[norm]
        torch.manual_seed(cfg.SEED)
        model = build_model(cfg)
        model = transform(model) if transform else model
        return model, d2.build_optimizer(cfg, model)


class LazyModels:
    """The settings of a LazyConfig: its model with a norm at every key of ``LAZY_NORM_KEYS``."""

    def __init__(self, config_file: str, opts: list):
        fixed = [
            "dataloader.train.num_workers=0",
            "optimizer.lr=0.0",
            "model.roi_heads.box_predictor.test_score_thresh=0.0",
        ]
        self.cfg = LazyConfig.apply_overrides(LazyConfig.load(config_file), fixed + opts)
        if str(self.cfg.train.device).startswith("cuda") and not torch.cuda.is_available():
            self.cfg.train.device = "cpu"  # as load_cfg does for a yaml config
        self.device = torch.device(self.cfg.train.device)
        self.amp, self.amp_key = self.cfg.train.amp.enabled, "train.amp.enabled"

    def check(self, norms) -> None:
        for norm in norms:
            if norm not in d2.valid_norm_names():
                raise ValueError(f"--norms: unknown norm {norm!r}; valid names are {list(d2.valid_norm_names())}")

    def batches(self, count: int) -> list:
        loader = iter(instantiate(self.cfg.dataloader.train))
        return [next(loader) for _ in range(count)]

    def build(self, norm: str, transform=None):
        """The model of ``norm`` (``transform(model)`` first, if given) and its optimizer."""
        cfg = copy.deepcopy(self.cfg)
        layer = L(NormFactory)(name=norm) if norm in NORM_NAMES else norm  # detectron2's names as they are
        for key in LAZY_NORM_KEYS:
            *parents, name = key.split(".")
            setattr(functools.reduce(getattr, parents, cfg), name, layer)
        torch.manual_seed(cfg.train.get("seed", 0))
        model = instantiate(cfg.model).to(self.device)
        model = transform(model) if transform else model
        cfg.optimizer.params.model = model
        return model, instantiate(cfg.optimizer)


class Setting:
    """One normalizer's model and optimizer, with a timed training step and a timed inference."""

    def __init__(self, model, optimizer, amp: bool):
        self.model = model
        self.optimizer = optimizer
        self.device = next(model.parameters()).device
        self.scaler = torch.amp.GradScaler("cuda") if amp else None

    def train_step(self, batch):
        self.model.train()
        return device_seconds(lambda: self._train(batch), self.device)

    def _train(self, batch):
        autocast = torch.autocast("cuda", dtype=torch.float16) if self.scaler else contextlib.nullcontext()
        with EventStorage(), autocast:
            losses = self.model(batch)
        self.optimizer.zero_grad()
        loss = sum(losses.values())
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()

    @torch.no_grad()
    def inference(self, batch):
        self.model.eval()
        inputs = [{key: item[key] for key in ("image", "height", "width")} for item in batch]
        return device_seconds(lambda: self.model(inputs), self.device)


def setting_labels(norms, graphed: bool, baseline: str | None = None) -> dict:
    """Label -> (norm, graphed backbone, with the baseline's layers): the reference first; with graphs, every
    norm graphed and the reference also without graphs, beside its graphed twin; with a ``baseline`` label,
    each of our learned norms also as the baseline commit has it, after it."""
    if not graphed:
        labels = {norm: (norm, False, False) for norm in norms}
    else:
        labels = {norms[0] + GRAPHED: (norms[0], True, False), norms[0]: (norms[0], False, False)}
        labels.update({norm + GRAPHED: (norm, True, False) for norm in norms[1:]})
    if baseline is None:
        return labels
    with_baseline = {}
    for label, (norm, graphed_setting, _) in labels.items():
        with_baseline[label] = (norm, graphed_setting, False)
        if norm in NORM_NAMES and norm != "GN":  # GN is torch's group norm in both
            with_baseline[f"{label} {baseline}"] = (norm, graphed_setting, True)
    return with_baseline


def check_graphs_captured(settings, graphed_labels) -> None:
    """After the warm-up, every graphed setting replays a training and an inference graph; else most of its
    steps would be eager (their input shapes differ) and its time would not be that of graphs."""
    for label in graphed_labels:
        captured = settings[label].model.backbone.captured
        if len(captured) < MAX_GRAPHS:
            raise RuntimeError(
                f"--graphed-backbone: {label} captured {len(captured)} of {MAX_GRAPHS} graphs (training step and "
                "inference) in the warm-up: the batches' input shapes differ, so its steps would run eagerly; use "
                "a config whose inputs have one size, such as configs/lazy/mask_rcnn_sn_lsj_100ep.py"
            )


def print_table(rows, reference: str):
    ratio = f"x {reference}"
    width = max(6, len(ratio))
    label_width = max(10, *(len(row["setting"]) for row in rows))
    header = (
        f"{'setting':{label_width}} {'train step s':>12} {ratio:>{width}} {'rounds':>11} {'inference s':>12} "
        f"{ratio:>{width}} {'rounds':>11}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['setting']:{label_width}} {row['train_seconds']:12.3f} {row['train_vs_gn']:{width}.2f} "
            f"{range_text(row['train_vs_gn_range']):>11} "
            f"{row['inference_seconds']:12.3f} {row['inference_vs_gn']:{width}.2f} "
            f"{range_text(row['inference_vs_gn_range']):>11}"
        )


def build_parser() -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0]
    parser = norm_benchmark_parser(description, "configs/demo_mask_rcnn_gn.yaml", "GN,SN,FrozenBN", REFERENCE, 8)
    parser.add_argument(
        "--graphed-backbone",
        action="store_true",
        help=f"replay every norm's backbone and FPN as CUDA graphs (ratios to {REFERENCE}{GRAPHED}; {REFERENCE} "
        "eager is timed beside it); needs CUDA and inputs of one size",
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also time each of our learned norms with its layers as "
        "commit REF of this checkout has them, side by side (settings 'NAME @COMMIT')",
    )
    return parser


def main(argv: Sequence[str] | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        baseline = baseline_layers(args.baseline) if args.baseline else None
    except ValueError as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)

    register_shapes_datasets()
    source = (LazyModels if args.config_file.endswith(".py") else YamlModels)(args.config_file, args.opts)
    device = source.device
    if source.amp and device.type != "cuda":
        raise ValueError(f"{source.amp_key}=True: mixed precision is timed on CUDA only, and the model is on {device}")
    if args.graphed_backbone and device.type != "cuda":
        raise ValueError(f"--graphed-backbone replays CUDA graphs, and the model is on {device}")
    norms = timed_norms(args.norms, REFERENCE)
    source.check(norms)
    labels = setting_labels(norms, args.graphed_backbone, baseline and baseline[0])
    reference = next(iter(labels))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    precision = ", mixed precision (fp16)" if source.amp else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, device {gpu or 'cpu'}{precision}")
    batches = source.batches(args.rounds)
    settings = {}
    for label, (norm, graphed, old_layers) in labels.items():
        transform = functools.partial(with_baseline_norms, baseline[1], norm_base=NormBase) if old_layers else None
        model, optimizer = source.build(norm, transform)
        if graphed:
            graph_backbone(model, max_graphs=MAX_GRAPHS, warmup=GRAPH_WARMUP)
        settings[label] = Setting(model, optimizer, source.amp)
    # the warm-up: every shape's kernels compiled, and with graphs every graph captured (module docstring)
    warmup_calls = max(len(batches), GRAPH_WARMUP + 1) if args.graphed_backbone else len(batches)
    for setting in settings.values():
        for batch in itertools.islice(itertools.cycle(batches), warmup_calls):
            setting.train_step(batch)
            setting.inference(batch)
    check_graphs_captured(settings, [label for label, (_, graphed, _) in labels.items() if graphed])
    train = ratio_to(interleaved_seconds(settings, batches, lambda s, batch: s.train_step(batch), 0), reference)
    inference = ratio_to(interleaved_seconds(settings, batches, lambda s, batch: s.inference(batch), 0), reference)

    rows = [
        {
            "norm": norm,
            "setting": label,
            "graphed_backbone": graphed,
            "reference": reference,
            "amp": source.amp,
            "device": device.type,
            "gpu": gpu,
            "config": args.config_file,
            "train_seconds": train[label]["seconds"],
            "train_vs_gn": train[label]["ratio"],
            "train_vs_gn_range": train[label]["ratio_range"],
            "inference_seconds": inference[label]["seconds"],
            "inference_vs_gn": inference[label]["ratio"],
            "inference_vs_gn_range": inference[label]["ratio_range"],
        }
        for label, (norm, graphed, _) in labels.items()
    ]
    print_table(rows, reference)
    if args.json:
        create_folder_of(args.json)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
