"""Kernel launches, allocations and host synchronisations of every layer's training step (forward + backward,
gradients set to None first) and inference forward, next to torch's GroupNorm and BatchNorm
(``sn_detection.layers.launch_counts``). On a GPU each launch costs microseconds of host time, so this is what
makes a layer host-bound there; counted on any machine:

    tools/count_launches.py [--device cuda] [--json counts.json] [--host-time [--baseline REF]]
    TRITON_INTERPRET=1 $(tools/setup_kernel_env.sh) tools/count_launches.py   # the GPU's path, on the CPU

Without a GPU and without the interpreter, the layers run their PyTorch path, and that is what is counted.
``--host-time`` also times each layer's training step and evaluation forward on the kernel path (a CUDA
device, or the interpreter as in the second line) with its Triton launches skipped: the host's work around
the kernels, beside torch's GroupNorm(32) (``host_times``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import time
from collections.abc import Sequence

import torch
from torch import nn

from ..engine.arguments import create_folder_of, output_file, positive_int
from ..layers import NORM_NAMES, build_norm, map_passes
from ..layers.kernel_launch import skipped_launches
from ..layers.launch_counts import layer_counts
from .baseline import baseline_layers, baseline_twin
from .timing import WARMUP_ROUNDS, device_seconds, interleaved_seconds, range_text, ratio_to


def host_times(device: torch.device, rounds: int, shape=(2, 256, 6, 6), steps: int = 100, baseline=None) -> dict:
    """Per layer (torch's GroupNorm(32), then every name of ``build_norm``): seconds of one training forward +
    backward (gradients set to None first, ``"train"``) and of one evaluation forward without gradients
    (``"eval"``), averaged over ``steps``, with the Triton launches skipped (``kernel_launch.skipped_launches``;
    torch's GroupNorm runs whole), as ``timing.ratio_to`` summarises ``rounds`` interleaved rounds, on one
    intra-op thread. On the CPU the seconds are this process's CPU time, the host's work whatever else the
    machine runs; on CUDA wall time with the device synchronised around each round's steps. What the layers
    compute is meaningless (no kernel runs): each is a copy built for this. With a ``baseline``
    (``baseline.baseline_layers``), each learned norm's twin of that commit is timed beside it, its launches
    skipped too."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(device).requires_grad_()
    grad_y = torch.randn(shape, generator=generator).to(device)
    layers = {"torch GN(32)": nn.GroupNorm(32, shape[1])}
    for name in NORM_NAMES:
        layers[name] = build_norm(name, shape[1])
        if baseline is not None and name != "GN":  # GN is torch's group norm in both
            layers[f"{name} {baseline[0]}"] = baseline_twin(baseline[1], layers[name])
    training = {label: (layer.to(device).train(), list(layer.parameters())) for label, layer in layers.items()}
    evaluation = {label: copy.deepcopy(layer).eval() for label, layer in layers.items()}

    def timed(run):
        if device.type == "cuda":
            return device_seconds(run, device) / steps
        start = time.process_time()
        run()
        return (time.process_time() - start) / steps

    def training_steps(candidate, _):
        layer, parameters = candidate

        def run():
            for _ in range(steps):
                for parameter in parameters:
                    parameter.grad = None
                x.grad = None
                layer(x).backward(grad_y)

        return timed(run)

    def evaluation_forwards(layer, _):
        def run():
            with torch.no_grad():
                for _ in range(steps):
                    layer(x)

        return timed(run)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(skipped_launches())
            if baseline is not None:
                stack.enter_context(_baseline_skipped_launches(baseline[1]))
            train = interleaved_seconds(training, range(WARMUP_ROUNDS + rounds), training_steps)
            evaluate = interleaved_seconds(evaluation, range(WARMUP_ROUNDS + rounds), evaluation_forwards)
    finally:
        torch.set_num_threads(threads)
    return {"train": ratio_to(train, "torch GN(32)"), "eval": ratio_to(evaluate, "torch GN(32)")}


def _baseline_skipped_launches(package):
    """The baseline package's own ``skipped_launches`` context: in its ``kernel_launch`` module, or in its
    ``launches`` module in commits before that existed."""
    for module in ("kernel_launch", "launches"):
        try:
            return importlib.import_module(f"{package.__name__}.{module}").skipped_launches()
        except (ImportError, AttributeError):
            continue
    raise ValueError(f"the baseline {package.__name__} has no skipped_launches")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: CUDA where available, else the CPU")
    parser.add_argument("--json", metavar="PATH", type=output_file, help="also write the rows as JSON")
    parser.add_argument(
        "--host-time",
        action="store_true",
        help="also time each layer's training step with its Triton launches skipped (needs the kernel path)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=15, help="--host-time: rounds, the layers in turn in each (default: 15)"
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="--host-time: also time each learned norm as commit REF of "
        "this checkout has it, side by side (rows 'NAME @COMMIT')",
    )
    return parser


def main(argv: Sequence[str] | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.baseline and not args.host_time:
        parser.error("--baseline times the host's work: give --host-time too")
    try:
        baseline = baseline_layers(args.baseline) if args.baseline else None
    except ValueError as error:
        parser.error(str(error))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.host_time and not map_passes.kernel_path(torch.empty(1, 1, 1, 1, device=device)):
        parser.error(
            f"--host-time needs the kernel path, which {device.type} tensors do not take here: "
            "a CUDA device, or the CPU with TRITON_INTERPRET=1 in the kernel-test environment"
        )
    rows = layer_counts(device)
    path = "the Triton kernel path" if rows[0]["kernel_path"] else "the PyTorch path (no Triton kernels here)"
    print(f"torch {torch.__version__}, {device.type}, {'x'.join(map(str, rows[0]['shape']))}: {path}")
    profiled = device.type == "cuda"
    header = (
        f"{'layer':13} {'train launches':>14} {'allocations':>11} {'syncs':>5} {'inference launches':>18} {'syncs':>5}"
    )
    header += f" {'profiler kernels':>16}" if profiled else ""
    print(header + "\n" + "-" * len(header))
    for row in rows:
        line = (
            f"{row['layer']:13} {row['train_launches']:14} {row['train_allocations']:11} {row['train_syncs']:5} "
            f"{row['inference_launches']:18} {row['inference_syncs']:5}"
        )
        print(line + (f" {row['train_kernels_profiled']:16}" if profiled else ""))
    if args.host_time:
        times = host_times(device, args.rounds, baseline=baseline)
        clock = "wall time" if device.type == "cuda" else "CPU time"
        print(
            f"\nhost time ({clock}) with the Triton launches skipped (torch GN whole), {args.rounds} rounds: a "
            "training step (forward + backward) and an evaluation forward, each beside torch GN(32)'s"
        )
        width = max(13, *map(len, times["train"]))
        print(
            f"{'layer':{width}} {'train':>8}    {'x torch GN':>10} {'(rounds)':>11} {'eval':>8}    {'x torch GN':>10} "
            f"{'(rounds)':>11}"
        )
        for label, train in times["train"].items():
            evaluation = times["eval"][label]
            print(
                f"{label:{width}} {train['seconds'] * 1e6:8.0f} us {train['ratio']:9.2f}x "
                f"({range_text(train['ratio_range'])}) "
                f"{evaluation['seconds'] * 1e6:8.0f} us {evaluation['ratio']:9.2f}x "
                f"({range_text(evaluation['ratio_range'])})"
            )
        for row in rows:
            row["host_time"] = times["train"].get(row["layer"])
            row["host_time_eval"] = times["eval"].get(row["layer"])
    if args.json:
        create_folder_of(args.json)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
