"""End-to-end cost of the norms: one Mask R-CNN training step and one inference, per normalizer setting.

Not a test: a measurement to run by hand, on CPU and, when available, CUDA:

    python tools/benchmark_train.py [--norms GN,SN,FrozenBN] [--rounds 8] [--threads N] [--json out.json]
                                    [--config-file configs/demo_mask_rcnn_gn.yaml] [KEY VALUE ...]

Every setting puts its norm in the backbone, the FPN and both heads (MODEL.RESNETS.NORM, MODEL.FPN.NORM,
MODEL.ROI_BOX_HEAD.NORM, MODEL.ROI_MASK_HEAD.NORM) of the same model, by default the CPU demo's R50-FPN
(160 px inputs, 128-wide FPN and heads, 64 RoIs per image, 2 images per batch). FrozenBN, a fixed
per-channel affine, is the floor any normalizer is compared with.

- Training step: forward, backward and SGD step of the same pre-loaded batches (data loading excluded),
  at learning rate 0: the cost of a step does not depend on the weights, and the models stay at their
  initialisation (a FrozenBN network trained from scratch would diverge within a few steps).
- Inference: evaluation-mode forward of those images without gradients, with the score threshold at 0
  so that every model sends the same number of detections (TEST.DETECTIONS_PER_IMAGE) through the
  mask head, whatever it has learned.

Kernels are compiled or chosen per input shape (Triton's specializations of its integer arguments, cuDNN's
and oneDNN's algorithms), and the batches' image sizes differ: every setting first runs every batch once,
untimed, so that the rounds time steps rather than compilations. The settings are then timed in
interleaved rounds, one per batch, so that a load change on a shared machine hits all of them alike; the
table gives each setting's median, its ratio to GN, and the lowest and highest ratio within one round
("rounds": the run-to-run spread).
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

import torch
from detectron2.data import build_detection_train_loader
from detectron2.modeling import build_model
from detectron2.utils.events import EventStorage

from .. import d2
from ..data.datasets import register_shapes_datasets
from .launch import load_cfg
from .timing import (
    device_seconds, interleaved_seconds, norm_benchmark_parser, norm_setting_cfgs, range_text, ratio_to,
    timed_norms,
)  # fmt: skip

NORM_KEYS = ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.ROI_BOX_HEAD.NORM", "MODEL.ROI_MASK_HEAD.NORM")
REFERENCE = "GN"


def fixed_batches(cfg, count):
    loader = iter(build_detection_train_loader(cfg))
    return [next(loader) for _ in range(count)]


class Setting:
    """One normalizer's model and optimizer, with a timed training step and a timed inference."""

    def __init__(self, cfg):
        torch.manual_seed(cfg.SEED)
        self.model = build_model(cfg)
        self.optimizer = d2.build_optimizer(cfg, self.model)
        self.device = torch.device(cfg.MODEL.DEVICE)

    def train_step(self, batch):
        self.model.train()
        return device_seconds(lambda: self._train(batch), self.device)

    def _train(self, batch):
        with EventStorage():
            losses = self.model(batch)
        self.optimizer.zero_grad()
        sum(losses.values()).backward()
        self.optimizer.step()

    @torch.no_grad()
    def inference(self, batch):
        self.model.eval()
        inputs = [{key: item[key] for key in ("image", "height", "width")} for item in batch]
        return device_seconds(lambda: self.model(inputs), self.device)


def print_table(rows):
    header = f"{'setting':10} {'train step s':>12} {'x GN':>6} {'rounds':>11} {'inference s':>12} {'x GN':>6} {'rounds':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['norm']:10} {row['train_seconds']:12.3f} {row['train_vs_gn']:6.2f} "
            f"{range_text(row['train_vs_gn_range']):>11} "
            f"{row['inference_seconds']:12.3f} {row['inference_vs_gn']:6.2f} "
            f"{range_text(row['inference_vs_gn_range']):>11}"
        )


def main(argv: Optional[Sequence[str]] = None):
    description = __doc__.split("\n\n")[0]
    parser = norm_benchmark_parser(description, "configs/demo_mask_rcnn_gn.yaml", "GN,SN,FrozenBN", REFERENCE, 8)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    register_shapes_datasets()
    fixed = ["DATALOADER.NUM_WORKERS", "0", "SOLVER.BASE_LR", "0.0", "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"]
    cfg = load_cfg(args.config_file, fixed + args.opts)

    norms = timed_norms(args.norms, REFERENCE)
    setting_cfgs = norm_setting_cfgs(cfg, norms, NORM_KEYS)
    device = torch.device(cfg.MODEL.DEVICE)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, device {gpu or 'cpu'}")
    batches = fixed_batches(cfg, args.rounds)
    settings = {norm: Setting(setting_cfg) for norm, setting_cfg in setting_cfgs.items()}
    for setting in settings.values():  # the warm-up: every shape's kernels compiled (module docstring)
        for batch in batches:
            setting.train_step(batch)
            setting.inference(batch)
    train = ratio_to(interleaved_seconds(settings, batches, lambda s, batch: s.train_step(batch), 0), REFERENCE)
    inference = ratio_to(interleaved_seconds(settings, batches, lambda s, batch: s.inference(batch), 0), REFERENCE)

    rows = [
        {
            "norm": norm, "device": device.type, "gpu": gpu, "config": args.config_file,
            "train_seconds": train[norm]["seconds"], "train_vs_gn": train[norm]["ratio"],
            "train_vs_gn_range": train[norm]["ratio_range"], "inference_seconds": inference[norm]["seconds"],
            "inference_vs_gn": inference[norm]["ratio"], "inference_vs_gn_range": inference[norm]["ratio_range"],
        }
        for norm in norms
    ]
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
