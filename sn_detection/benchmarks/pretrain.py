"""What pretraining a backbone costs per norm: one training step of tools/pretrain_backbone.py, and the
hours an ImageNet epoch would take at that speed.

Not a test: a measurement to run by hand, on the GPUs that will pretrain (or on the CPU):

    tools/benchmark_pretrain.py [--config-file configs/mask_rcnn_sn_2x.yaml] [--norms BN,GN,SN]
        [--devices 8] [--classes 1000] [--epoch-images 1281167] [--data FOLDER] [--cuda-graph] [--rounds 5]
        [--threads N] [--json PATH] [KEY VALUE ...]

Every setting puts its norm in MODEL.RESNETS.NORM of the config's ResNet under pretraining's classifier,
optimizer and detectron2 trainer (mixed precision with PRETRAIN.AMP True). A step is the trainer's
``run_step`` on a pre-made batch of PRETRAIN.IMS_PER_BATCH / --devices random images of
PRETRAIN.IMAGE_SIZE px, what each of --devices processes computes per iteration, at learning rate 0 so
that every network stays at its initialisation. Not included: data loading (JPEG decoding, crops), DDP's
all-reduce of the gradients and the all-gathers of SyncSN and SyncBN (PRETRAIN.SYNC_NORMS), which need
several processes. So the hours per epoch, --epoch-images / IMS_PER_BATCH iterations of the median
step, are what the devices' computation alone needs: a lower bound for a real run, whose log prints its
own ETA. BN is the reference; settings are timed in interleaved rounds (two warm-up rounds first), with
the medians, their ratio to BN, and the lowest and highest ratio within one round.

With ``--cuda-graph`` (MODEL.DEVICE cuda) every norm is also timed with its step captured in a CUDA graph
and replayed (PRETRAIN.CUDA_GRAPH; setting ``NORM+graph``, its warm-up and capture before the rounds), in
the same rounds: the table gives each graphed step's ratio to BN's eager one and to BN's graphed one.

With ``--data FOLDER`` (an ImageFolder such as ImageNet, or ``embedded``) it also times the loading of
training samples as one loader worker makes them (reading, decoding, random crop, flip: pretraining's
own dataset) and gives, per norm, the workers each device needs to keep up with its steps
(PRETRAIN.NUM_WORKERS is the number each process has).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Sequence

import torch
from detectron2.utils.events import EventStorage

from ..engine.arguments import create_folder_of, positive_int
from ..engine.launch import load_cfg
from ..pretraining.data import ClassificationImages, data_folder, sample_seed
from ..pretraining.model import BackboneClassifier
from ..pretraining.train import build_optimizer, build_trainer
from .timing import (
    WARMUP_ROUNDS,
    device_seconds,
    interleaved_seconds,
    norm_benchmark_parser,
    norm_setting_cfgs,
    range_text,
    ratio_to,
    timed_norms,
)

REFERENCE = "BN"
NORM_KEYS = ["MODEL.RESNETS.NORM"]
IMAGENET_TRAIN_IMAGES = 1281167
LOADED_SAMPLES = 200
WARMUP_SAMPLES = 10


def random_batch(cfg, images: int, classes: int):
    """A batch as pretraining's loader gives it: uint8 images in host memory, class indices."""
    generator = torch.Generator().manual_seed(0)
    size = cfg.PRETRAIN.IMAGE_SIZE
    pixels = torch.randint(0, 256, (images, 3, size, size), dtype=torch.uint8, generator=generator)
    return pixels, torch.randint(0, classes, (images,), generator=generator)


class Setting:
    """One norm's classifier in pretraining's trainer, stepping on the same batch over and over; with
    PRETRAIN.CUDA_GRAPH, from its first replay on (its eager warm-up steps and capture are not timed)."""

    def __init__(self, cfg, batch, classes: int):
        torch.manual_seed(cfg.SEED)
        self.device = torch.device(cfg.MODEL.DEVICE)
        model = BackboneClassifier(cfg, classes).to(self.device)
        self.trainer = build_trainer(cfg, model, build_optimizer(cfg, model), itertools.repeat(batch))
        self.storage = EventStorage()
        while cfg.PRETRAIN.CUDA_GRAPH and not self.trainer.captured:
            self.train_step()

    def train_step(self):
        with self.storage:
            return device_seconds(self.trainer.run_step, self.device)


def graphed(norm: str) -> str:
    """The label of ``norm``'s setting with its step in a CUDA graph."""
    return f"{norm}+graph"


def with_cuda_graph(cfg, cuda_graph: bool):
    """``cfg`` with PRETRAIN.CUDA_GRAPH ``cuda_graph``."""
    cfg = cfg.clone()
    cfg.defrost()
    cfg.PRETRAIN.CUDA_GRAPH = cuda_graph
    return cfg


def loaded_images_per_second(cfg, data: str, count: int = LOADED_SAMPLES) -> float:
    """Training samples per second that one loader worker makes from the ImageFolder ``data``: ``count``
    samples spread over the split, after ``WARMUP_SAMPLES`` untimed ones."""
    images = ClassificationImages(
        data_folder(data), "train", cfg.PRETRAIN.IMAGE_SIZE, cfg.PRETRAIN.CROP_AREA, cfg.INPUT.FORMAT
    )
    stride = max(len(images) // (count + WARMUP_SAMPLES), 1)
    items = [(position * stride % len(images), sample_seed(0, position)) for position in range(count + WARMUP_SAMPLES)]
    for item in items[:WARMUP_SAMPLES]:
        images[item]
    start = time.perf_counter()
    for item in items[WARMUP_SAMPLES:]:
        images[item]
    return count / (time.perf_counter() - start)


def epoch_hours(step_seconds: float, epoch_images: int, ims_per_batch: int) -> float:
    """Hours of ``epoch_images / ims_per_batch`` iterations of ``step_seconds`` each."""
    return epoch_images / ims_per_batch * step_seconds / 3600


def print_table(rows, devices):
    hours = f"h/epoch ({devices} dev.)"
    loading = "workers_per_device" in rows[0]
    graphs = any("step_vs_bn_graph" in row for row in rows)
    header = f"{'setting':9} {'step s':>8} {'x BN':>6} {'rounds':>11} {'images/s/dev.':>13} {hours:>18}"
    header += (f" {'x BN+graph':>10}" if graphs else "") + (f" {'workers/dev.':>12}" if loading else "")
    print(header)
    print("-" * len(header))
    for row in rows:
        line = (
            f"{row['setting']:9} {row['step_seconds']:8.3f} {row['step_vs_bn']:6.2f} "
            f"{range_text(row['step_vs_bn_range']):>11} {row['images_per_second_per_device']:13.1f} "
            f"{row['epoch_hours']:18.2f}"
            + (f" {row['step_vs_bn_graph']:10.2f}" if "step_vs_bn_graph" in row else " " * 11 * graphs)
            + (f" {row['workers_per_device']:12d}" if loading else "")
        )
        print(line.rstrip())


def build_parser() -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0]
    parser = norm_benchmark_parser(description, "configs/mask_rcnn_sn_2x.yaml", "BN,GN,SN", REFERENCE, 5)
    parser.add_argument("--devices", type=positive_int, default=8, help="processes that share PRETRAIN.IMS_PER_BATCH")
    parser.add_argument("--classes", type=positive_int, default=1000, help="outputs of the classifier")
    parser.add_argument(
        "--epoch-images", type=positive_int, default=IMAGENET_TRAIN_IMAGES, help="training images per epoch"
    )
    parser.add_argument(
        "--data", metavar="FOLDER", help="also time one loader worker on this ImageFolder, or 'embedded'"
    )
    parser.add_argument(
        "--cuda-graph", action="store_true", help="also time each norm's step captured in a CUDA graph (NORM+graph)"
    )
    return parser


def parse_args(argv: Sequence[str] | None = None):
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_cfg(args.config_file, ["PRETRAIN.BASE_LR", "0.0", *args.opts])
    ims_per_batch = cfg.PRETRAIN.IMS_PER_BATCH
    if ims_per_batch % args.devices:
        raise SystemExit(f"PRETRAIN.IMS_PER_BATCH={ims_per_batch} is not divisible by --devices {args.devices}")
    per_device = ims_per_batch // args.devices

    norms = timed_norms(args.norms, REFERENCE)
    if args.cuda_graph:
        eager = norm_setting_cfgs(with_cuda_graph(cfg, False), norms, NORM_KEYS)
        graph = norm_setting_cfgs(with_cuda_graph(cfg, True), norms, NORM_KEYS)
        setting_cfgs = {**eager, **{graphed(norm): graph_cfg for norm, graph_cfg in graph.items()}}
    else:
        setting_cfgs = norm_setting_cfgs(cfg, norms, NORM_KEYS)
    device = torch.device(cfg.MODEL.DEVICE)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    launch = ", eager and graphed" if args.cuda_graph else ", graphed" if cfg.PRETRAIN.CUDA_GRAPH else ""
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, device {gpu or 'cpu'}; "
        f"ResNet-{cfg.MODEL.RESNETS.DEPTH}, {cfg.PRETRAIN.IMAGE_SIZE} px, {per_device} images per step "
        f"({ims_per_batch} over {args.devices} devices), {'AMP' if cfg.PRETRAIN.AMP else 'fp32'}{launch}"
    )
    batch = random_batch(cfg, per_device, args.classes)
    settings = {label: Setting(setting_cfg, batch, args.classes) for label, setting_cfg in setting_cfgs.items()}
    steps = interleaved_seconds(settings, range(args.rounds + WARMUP_ROUNDS), lambda s, _: s.train_step())
    summary = ratio_to(steps, REFERENCE)
    to_graphed_bn = ratio_to(steps, graphed(REFERENCE)) if args.cuda_graph else {}

    rows = [
        {
            "norm": setting_cfg.MODEL.RESNETS.NORM,
            "setting": label,
            "cuda_graph": setting_cfg.PRETRAIN.CUDA_GRAPH,
            "device": device.type,
            "gpu": gpu,
            "config": args.config_file,
            "depth": cfg.MODEL.RESNETS.DEPTH,
            "image_size": cfg.PRETRAIN.IMAGE_SIZE,
            "amp": cfg.PRETRAIN.AMP,
            "ims_per_batch": ims_per_batch,
            "devices": args.devices,
            "images_per_step": per_device,
            "step_seconds": summary[label]["seconds"],
            "step_vs_bn": summary[label]["ratio"],
            "step_vs_bn_range": summary[label]["ratio_range"],
            "images_per_second_per_device": per_device / summary[label]["seconds"],
            "epoch_images": args.epoch_images,
            "epoch_hours": epoch_hours(summary[label]["seconds"], args.epoch_images, ims_per_batch),
        }
        for label, setting_cfg in setting_cfgs.items()
    ]
    for row in rows:
        if args.cuda_graph and row["cuda_graph"]:
            row["step_vs_bn_graph"] = to_graphed_bn[row["setting"]]["ratio"]
    if args.data:
        loaded = loaded_images_per_second(cfg, args.data)
        print(f"One loader worker on {args.data}: {loaded:.1f} training samples per second")
        for row in rows:
            row["loader_images_per_second_per_worker"] = loaded
            row["workers_per_device"] = math.ceil(row["images_per_second_per_device"] / loaded)
    print_table(rows, args.devices)
    if args.json:
        create_folder_of(args.json)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
