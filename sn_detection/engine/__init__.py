"""The training entry point used by tools/train_net.py (thin over detectron2's DefaultTrainer)."""

from .launch import main, setup_cfg
from .trainer import Trainer

__all__ = ["Trainer", "main", "setup_cfg"]
