"""The ``argparse`` types and the file helper that the tools share: a count of at least 1, and a file a tool
writes after its work, checked before it and its folder made when written."""

import argparse
import os


def positive_int(text: str) -> int:
    """argparse ``type=`` of a count option: an int >= 1, or an argparse error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: it must be an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: it must be an int >= 1")
    return value


def output_file(text: str) -> str:
    """argparse ``type=`` of a file a tool writes after its work (``--json``, ``--publish``): checked
    before the work, which can take hours. Its folder may be missing (``create_folder_of`` makes it when
    the file is written); the nearest one that exists must be a writable folder."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give the file to write")
    existing = os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"{text!r}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {existing} is not writable")
    return text


def create_folder_of(path: str) -> None:
    """The folder of the file ``path``, with the folders above it, made where missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def add_fold_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--fold: with --eval-only, evaluate the trained model with its norms folded for inference
    (``d2.fold_norms``), the model a deployment runs."""
    parser.add_argument(
        "--fold",
        action="store_true",
        help="with --eval-only: fold the norms for inference first (constant affines into the convolutions)",
    )
    return parser


def norm_names(parser: argparse.ArgumentParser, text: str, valid: list[str]) -> list[str]:
    """The comma-separated norm names of ``--norms``, each one of ``valid``; a parser error names the others."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        parser.error(f"--norms: unknown {unknown or 'empty list'}; choose from {', '.join(valid)}")
    return names


def nchw_shape(parser: argparse.ArgumentParser, text: str) -> tuple[int, int, int, int]:
    """The N,C,H,W of ``--shape``, four sizes >= 1; else a parser error."""
    try:
        shape = tuple(int(size) for size in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        parser.error(f"--shape {text!r}: four sizes >= 1, N,C,H,W")
    return shape
