"""The training entry point used by tools/train_net.py (thin over detectron2's DefaultTrainer)."""

from .launch import load_cfg, setup_cfg, train_or_evaluate
from .trainer import Trainer

__all__ = ["Trainer", "load_cfg", "setup_cfg", "train_or_evaluate"]
