"""``python -m sn_detection.engine.train_net``: what ``tools/train_net.py`` runs, importable so that other
tools (the norm sweep) start training runs from the installed package.

    python -m sn_detection.engine.train_net --config-file CONFIG [--eval-only [--fold]] [--resume] [--num-gpus K] \
        [KEY VALUE ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from detectron2.engine import default_argument_parser

from .arguments import add_fold_argument
from .launch import launch_processes, train_or_evaluate


def build_parser() -> argparse.ArgumentParser:
    """detectron2's training arguments: the config, --eval-only, --resume, the processes, KEY VALUE overrides;
    and --fold."""
    return add_fold_argument(default_argument_parser())


def main(argv: Sequence[str] | None = None):
    """Parse detectron2's training arguments and run ``train_or_evaluate`` in K processes."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fold and not args.eval_only:
        parser.error("--fold goes with --eval-only: a model whose norms are folded cannot train")
    return launch_processes(train_or_evaluate, args)


if __name__ == "__main__":
    main()
