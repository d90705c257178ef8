"""What launching the compiled kernels directly saves (``layers.kernels``): each learned layer's training
step (forward + backward, gradients set to None first) through Triton's ordinary launch path and through the
direct one, side by side, with their ratio. CUDA only: elsewhere there is no direct launch.

    tools/benchmark_launch.py [--norms SN,DN] [--shape 2,256,6,6] [--rounds 15] [--json launch.json]

At the default shape the kernels take microseconds, so the step's wall time (the device synchronised around
each round's steps) is the host's: what a launch costs is what is measured. Candidates run in interleaved
rounds (``timing``). "direct" is the share of the direct row's launches that took the direct path.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch

from ..engine.arguments import create_folder_of, nchw_shape, norm_names, output_file, positive_int
from ..layers import NORM_NAMES, build_norm, kernels
from .timing import WARMUP_ROUNDS, device_seconds, interleaved_seconds, range_text, ratio_to

PATHS = ("ordinary", "direct")


def launch_path_times(
    names: Sequence[str], shape: Sequence[int], rounds: int, steps: int = 50, device: str = "cuda"
) -> dict:
    """Per layer name and path: seconds of one training step, and the ratio direct / ordinary
    (``timing.ratio_to``), with the share of the direct row's launches that took the direct path (None for
    a layer that launches no Triton kernel)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tuple(shape), generator=generator).to(device).requires_grad_()
    grad_y = torch.randn(tuple(shape), generator=generator).to(device)
    layers = {name: build_norm(name, shape[1]).to(device).train() for name in names}
    direct_launches = dict.fromkeys(names, 0)
    all_launches = dict.fromkeys(names, 0)

    def training_steps(candidate, _):
        name, path = candidate
        layer = layers[name]

        def run():
            for _ in range(steps):
                layer.zero_grad(set_to_none=True)
                x.grad = None
                layer(x).backward(grad_y)

        if path == "ordinary":
            with kernels.ordinary_launches():
                return device_seconds(run, x.device) / steps
        direct, ordinary = kernels.counts.direct, kernels.counts.ordinary
        seconds = device_seconds(run, x.device) / steps
        direct_launches[name] += kernels.counts.direct - direct
        all_launches[name] += kernels.counts.direct - direct + kernels.counts.ordinary - ordinary
        return seconds

    candidates = {(name, path): (name, path) for name in names for path in PATHS}
    times = interleaved_seconds(candidates, range(WARMUP_ROUNDS + rounds), training_steps)
    results = {}
    for name in names:
        summary = ratio_to({path: times[(name, path)] for path in PATHS}, "ordinary")
        share = direct_launches[name] / all_launches[name] if all_launches[name] else None
        results[name] = {**summary, "direct_share": share}
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--norms", default=",".join(NORM_NAMES), help=f"comma-separated, of {', '.join(NORM_NAMES)}")
    parser.add_argument("--shape", default="2,256,6,6", help="N,C,H,W of the input (default: 2,256,6,6)")
    parser.add_argument(
        "--rounds", type=positive_int, default=15, help=f"timed rounds (after {WARMUP_ROUNDS} warm-up rounds)"
    )
    parser.add_argument("--json", metavar="PATH", type=output_file, help="also write the results as JSON")
    return parser


def main(argv: Sequence[str] | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    names = norm_names(parser, args.norms, NORM_NAMES)
    shape = nchw_shape(parser, args.shape)
    if not torch.cuda.is_available() or not kernels.available() or kernels.interpreting():
        parser.error("the direct launch needs a CUDA device and Triton, without TRITON_INTERPRET=1")
    if not kernels.version_supported():
        versions = ", ".join(kernels.TRITON_VERSIONS)
        parser.error(
            f"Triton {kernels.triton.__version__} is none of {versions}: every launch takes the ordinary path here"
        )
    results = launch_path_times(names, shape, args.rounds)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {'x'.join(map(str, shape))}, "
        f"training step, {args.rounds} rounds"
    )
    print(f"{'layer':8} {'ordinary':>10} {'direct':>10} {'ratio':>6} {'rounds':>10} {'direct launches':>16}")
    for name, result in results.items():
        share = "no kernel" if result["direct_share"] is None else f"{result['direct_share']:.0%}"
        print(
            f"{name:8} {result['ordinary']['seconds'] * 1e6:7.0f} us {result['direct']['seconds'] * 1e6:7.0f} us "
            f"{result['direct']['ratio']:6.2f} {range_text(result['direct']['ratio_range']):>10} "
            f"{share:>16}"
        )
    if args.json:
        create_folder_of(args.json)
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": shape, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
