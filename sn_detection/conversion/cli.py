"""``tools/convert_pretrained.py SRC DST --source {sn,ssn,torchvision,gn} [--norm {BN,SN,SSN,GN}] [--verbose]``.

Writes DST only when every backbone tensor converted, then prints the report (converted, initialised,
skipped, mismatched, missing keys and the input convention the source needs), the file it wrote and the
terms of the weights it was converted from (``sources.weights_terms``). A refused file gets no
report: the error comes first, then only the keys that do not fit, then that nothing was written; the
exit status is 2.
"""

import argparse
import os
import sys
import textwrap

from .files import write_checkpoint
from .report import ConversionError
from .resnet import TARGET_NORMS
from .sources import SOURCES, convert_file, weights_terms

EXIT_FAILURE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_pretrained.py",
        description="Convert an ImageNet-pretrained ResNet into a detectron2 backbone checkpoint.",
    )
    parser.add_argument("src", metavar="SRC", help="the source checkpoint file")
    parser.add_argument("dst", metavar="DST", help="the output: .pkl (detectron2 model-zoo format), .pth or .pt")
    parser.add_argument("--source", required=True, choices=list(SOURCES), help="the format of SRC")
    parser.add_argument(
        "--norm",
        type=str.upper,
        choices=TARGET_NORMS,
        help="the norm of the target backbone (default: the source's own; torchvision BN can also initialise SN or GN)",
    )
    parser.add_argument("--verbose", action="store_true", help="list every key in the report")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        state, report = convert_file(args.source, args.src, args.norm)
        write_checkpoint(
            state, args.dst, author=f"sn_detection.conversion ({args.source}: {os.path.basename(args.src)})"
        )
    except (ConversionError, OSError) as error:  # OSError: reading or writing failed
        print(f"error: {error}", file=sys.stderr)
        found = getattr(error, "report", None)  # a ConversionError's per-key findings, where it has some
        if found is not None and (problems := found.format_problems(args.verbose)):
            print("what does not fit" + ("" if args.verbose else " (--verbose lists every key)") + ":", file=sys.stderr)
            print(problems, file=sys.stderr)
        print(f"nothing was written to {args.dst}", file=sys.stderr)
        return EXIT_FAILURE
    print(report.format(args.verbose))
    print(f"wrote {args.dst}")
    terms = f"licence: {weights_terms(args.source)}"
    print(textwrap.fill(terms, width=100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))
    return 0
