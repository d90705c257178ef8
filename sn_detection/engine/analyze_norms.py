"""tools/analyze_norms.py: what the learned norms of a trained model chose, per component, written as
markdown, CSV and PNG charts (``sn_detection.analysis.report``).

Two sources:

- ``--config-file CFG [KEY VALUE ...]``: the model of the config with its trained weights (see
  ``sn_detection.engine.trained``). SN, SSN and DN are read from the parameters; MN / MGN gates are observed on
  the first ``--num-images`` images of DATASETS.TEST[0] (the model in evaluation mode, as at inference).
- ``--checkpoint FILE``: a checkpoint alone (a detectron2 checkpoint or a bare state dict), its layers
  recognised by their parameter names (``analysis.choices``); MN / MGN layers are listed, but their
  gates need the model and data, so the config.

The report goes to ``--output-dir``, by default OUTPUT_DIR/norm_analysis (with a checkpoint: a
norm_analysis folder next to it).
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Sequence

import torch
from detectron2.data import build_detection_test_loader

from ..analysis import (
    GateRecorder,
    ModeGates,
    choices_from_state_dict,
    learned_choices,
    mode_layers,
    mode_layers_in_state_dict,
)
from ..analysis.report import write_report
from ..analysis.summary import KINDS, Record
from ..d2.components import COMPONENTS, component_of
from ..d2.norm_analysis import EVOLUTION_FILE
from ..data.datasets import register_shapes_datasets
from .launch import load_cfg
from .trained import add_overrides_argument, load_trained_model

REPORT_FOLDER = "norm_analysis"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Which normalizer each part of a trained detector chose.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config-file", metavar="FILE", help="the config; weights: see MODEL.WEIGHTS below")
    source.add_argument("--checkpoint", metavar="FILE", help="a checkpoint alone (no MN/MGN gate statistics)")
    parser.add_argument("--output-dir", help=f"default: OUTPUT_DIR/{REPORT_FOLDER} (next to --checkpoint)")
    parser.add_argument(
        "--num-images", type=int, default=8, help="images of DATASETS.TEST[0] to observe MN/MGN gates on (8)"
    )
    add_overrides_argument(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoint and args.opts:
        parser.error(f"config overrides {args.opts} need --config-file, not --checkpoint")
    if args.num_images < 1:
        parser.error(f"--num-images must be >= 1, got {args.num_images}")
    return args


def analyze_config(cfg, opts: list, num_images: int) -> tuple[list[Record], list[str]]:
    """The records of the trained model of ``cfg``, and notes on where they come from."""
    model, weights = load_trained_model(cfg, opts)
    records = learned_choices(model)
    notes = [f"Model: the config's model with the weights `{weights or '(none: initial values)'}`."]
    if mode_layers(model):
        records += observe_gates(cfg, model, num_images)
        notes.append(f"MN / MGN gates observed on the first {num_images} images of `{cfg.DATASETS.TEST[0]}`.")
    return records, notes


def evolution_charts(cfg) -> list[str]:
    """The charts of the norms' evolution during training that the ``NormAnalysis`` hook drew into
    OUTPUT_DIR, if any."""
    candidates = (os.path.join(cfg.OUTPUT_DIR, EVOLUTION_FILE.format(kind=kind)) for kind in KINDS)
    return [path for path in candidates if os.path.isfile(path)]


def observe_gates(cfg, model: torch.nn.Module, num_images: int) -> list[Record]:
    """The gate statistics of the MN / MGN layers of ``model`` (in evaluation mode) on the first
    ``num_images`` images of DATASETS.TEST[0]."""
    if not cfg.DATASETS.TEST:
        raise ValueError("MN / MGN gates are observed on DATASETS.TEST[0], but DATASETS.TEST is empty: set it")
    register_shapes_datasets()
    loader = build_detection_test_loader(cfg, cfg.DATASETS.TEST[0])
    with GateRecorder(model) as recorder, torch.no_grad():
        for batch in itertools.islice(loader, num_images):
            model(batch)
    return recorder.results()


def analyze_checkpoint(path: str) -> tuple[list[Record], list[str]]:
    """The records of the SN / DN layers of the checkpoint ``path`` and its (unobserved) MN / MGN layers."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for files it cannot read
        raise ValueError(f"{path}: not a checkpoint torch.load(weights_only=True) can read: {error}") from None
    state_dict = _state_dict(checkpoint, path)
    records = choices_from_state_dict(state_dict) + mode_layers_in_state_dict(state_dict)
    notes = [f"Checkpoint: `{path}` (layers recognised by their parameter names)."]
    if any(isinstance(record, ModeGates) for record in records):
        notes.append("MN / MGN gates depend on the input: use --config-file to observe them on images.")
    return records, notes


def _state_dict(checkpoint, path: str) -> dict:
    """The model's state dict: a detectron2 checkpoint's "model", a "state_dict", or the file itself."""
    if isinstance(checkpoint, dict):
        for key in ("model", "state_dict"):
            if isinstance(checkpoint.get(key), dict):
                return checkpoint[key]
        if all(isinstance(value, torch.Tensor) for value in checkpoint.values()):
            return checkpoint
    raise ValueError(f"{path}: expected a state dict, or a checkpoint holding one under 'model' or 'state_dict'")


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Run tools/analyze_norms.py; returns the files written."""
    args = parse_args(argv)
    if args.config_file:
        cfg = load_cfg(args.config_file, args.opts)
        records, notes = analyze_config(cfg, args.opts, args.num_images)
        output_dir = args.output_dir or os.path.join(cfg.OUTPUT_DIR, REPORT_FOLDER)
        evolution = evolution_charts(cfg)
    else:
        records, notes = analyze_checkpoint(args.checkpoint)
        output_dir = args.output_dir or os.path.join(os.path.dirname(os.path.abspath(args.checkpoint)), REPORT_FOLDER)
        evolution = []
    notes += [f"During training: ![{os.path.basename(p)}]({os.path.relpath(p, output_dir)})" for p in evolution]
    title = f"Learned normalization of {os.path.basename(args.config_file or args.checkpoint)}"
    paths = write_report(records, component_of, output_dir, components=COMPONENTS, title=title, notes=notes)
    print(f"Norm analysis of {len(records)} layers: {paths[0]}")
    for path in paths[1:] + evolution:
        print(f"  {'chart' if path.endswith('.png') else 'table'}: {path}")
    return paths
