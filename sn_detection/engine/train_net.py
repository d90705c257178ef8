"""``python -m sn_detection.engine.train_net``: what ``tools/train_net.py`` runs, importable so that other
tools (the norm sweep) start training runs from the installed package.

    python -m sn_detection.engine.train_net --config-file CONFIG [--eval-only] [--resume] [--num-gpus K] \
        [KEY VALUE ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from detectron2.engine import default_argument_parser

from .launch import launch_processes, train_or_evaluate


def build_parser() -> argparse.ArgumentParser:
    """detectron2's training arguments: the config, --eval-only, --resume, the processes, KEY VALUE overrides."""
    return default_argument_parser()


def main(argv: Sequence[str] | None = None):
    """Parse detectron2's training arguments and run ``train_or_evaluate`` in K processes."""
    args = build_parser().parse_args(argv)
    return launch_processes(train_or_evaluate, args)


if __name__ == "__main__":
    main()
