"""Forward + backward time and memory of every norm of ``build_norm``, next to torch's GroupNorm and BatchNorm.

Not a test: a measurement to run by hand, on CPU and, when available, CUDA:

    tools/benchmark_norms.py [--shapes small] [--norms SN,DN] [--repeats 5] [--threads N] [--device cuda] [--amp]
                             [--json results.json] [--baseline REF]

Shapes are those of detection: two FPN levels at batch 2 (2, 256, 200, 336) and (2, 256, 100, 168), the
RoI box head (512, 256, 14, 14) and a stem-sized map (2, 64, 400, 672). Each layer runs in training mode in
float32; the time is the median of ``--repeats`` forward + backward passes after two warm-up passes, and
"rounds" the lowest and highest ratio to GroupNorm within one round: the run-to-run spread. ``--amp`` (CUDA)
times them as a mixed-precision network runs them: float16 input and gradient, under ``torch.autocast``.

Memory is what one forward + backward costs beyond its input and upstream gradient:

- CUDA: ``torch.cuda.max_memory_allocated()`` during the pass minus the memory allocated before it
  (output, tensors saved for backward, temporaries and the input gradient).
- CPU: PyTorch keeps no allocator statistics, so the number is what the layer keeps alive between
  forward and backward, the part that scales with network depth: the bytes of the distinct storages
  saved for backward (seen through ``torch.autograd.graph.saved_tensors_hooks``, each storage counted
  once) plus the output. Short-lived temporaries are not seen. The input is counted, since every layer
  saves it, so a ratio of 1.0 means "nothing beyond what GroupNorm keeps".

Ratios are relative to ``torch.nn.GroupNorm(32, C)`` on the same shape and device, and, for the
learned norms, to "SN multi-op": Switchable Norm written the straightforward way, as the authors'
reference code is, statistics by separate reductions and autograd through every op. Candidates are timed in
interleaved rounds, so that a load change on a shared machine hits all of them alike; ``--baseline REF``
adds, after each learned norm, its twin as commit REF of this checkout has it (``baseline``), timed in the
same rounds. On a shared
machine ``--threads 1`` gives steadier CPU ratios: with several threads every small (N, C)-sized op
opens a parallel region, which costs milliseconds when another process holds a core.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch
from torch import nn

from ..engine.arguments import create_folder_of, norm_names, output_file, positive_int
from ..layers import NORM_NAMES, build_norm
from .baseline import baseline_layers, baseline_twin
from .timing import WARMUP_ROUNDS, device_seconds, interleaved_seconds, range_text, ratio_to

SHAPES = {
    "full": [(2, 256, 200, 336), (2, 256, 100, 168), (512, 256, 14, 14), (2, 64, 400, 672)],
    "small": [(2, 64, 50, 84), (64, 64, 14, 14), (2, 32, 100, 168)],
}
REFERENCE = "torch GN(32)"
MULTI_OP = "SN multi-op"


class MultiOpSwitchableNorm(nn.Module):
    """SN the straightforward way: IN, LN and BN statistics by separate reductions, autograd everywhere."""

    def __init__(self, num_channels, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(1, num_channels, 1))
        self.bias = nn.Parameter(torch.zeros(1, num_channels, 1))
        self.mean_weight = nn.Parameter(torch.ones(3))
        self.var_weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        n, c, h, w = x.shape
        flat = x.view(n, c, -1)
        mean_in = flat.mean(-1, keepdim=True)
        var_in = flat.var(-1, keepdim=True, unbiased=False)
        second_moment = var_in + mean_in**2
        mean_ln = mean_in.mean(1, keepdim=True)
        var_ln = second_moment.mean(1, keepdim=True) - mean_ln**2
        mean_bn = mean_in.mean(0, keepdim=True)
        var_bn = second_moment.mean(0, keepdim=True) - mean_bn**2
        mw = torch.softmax(self.mean_weight, 0)
        vw = torch.softmax(self.var_weight, 0)
        mean = mw[0] * mean_in + mw[1] * mean_ln + mw[2] * mean_bn
        var = vw[0] * var_in + vw[1] * var_ln + vw[2] * var_bn
        normalized = (flat - mean) / (var + self.eps).sqrt()
        return (normalized * self.weight + self.bias).view(n, c, h, w)


def candidates(num_channels, baseline=None, norms=NORM_NAMES):
    """(label, layer) pairs: torch's references and the multi-op SN first, then each of ``norms`` (names of
    ``build_norm``), each followed by its twin of the ``baseline`` commit when one is given
    (``baseline.baseline_layers``)."""
    yield REFERENCE, nn.GroupNorm(32, num_channels)
    yield "torch BN", nn.BatchNorm2d(num_channels)
    yield MULTI_OP, MultiOpSwitchableNorm(num_channels)
    for name in norms:
        layer = build_norm(name, num_channels)
        yield name, layer
        if baseline is not None and name != "GN":  # GN is torch's group norm in both
            label, package = baseline
            yield f"{name} {label}", baseline_twin(package, layer)


def step(layer, x, grad_y):
    with torch.autocast(x.device.type, dtype=torch.float16, enabled=x.dtype == torch.float16):
        y = layer(x)
    y.backward(grad_y)
    x.grad = None
    layer.zero_grad(set_to_none=True)


def kept_bytes(layer, x):
    """Bytes of the distinct storages saved for backward, plus the output (see the module docstring)."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(x)
    storages[y.untyped_storage().data_ptr()] = y.untyped_storage().nbytes()
    return sum(storages.values())


def peak_cuda_bytes(layer, x, grad_y):
    torch.cuda.synchronize(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    before = torch.cuda.memory_allocated(x.device)
    step(layer, x, grad_y)
    torch.cuda.synchronize(x.device)
    return torch.cuda.max_memory_allocated(x.device) - before


def measure(device, shape, repeats, dtype=torch.float32, baseline=None, norms=NORM_NAMES):
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=generator).to(dtype).requires_grad_()
    grad_y = torch.randn(shape, device=device, generator=generator).to(dtype)
    layers = {label: layer.to(device).train() for label, layer in candidates(shape[1], baseline, norms)}
    rounds = range(repeats + WARMUP_ROUNDS)
    times = interleaved_seconds(layers, rounds, lambda layer, _: device_seconds(lambda: step(layer, x, grad_y), device))
    vs_gn, vs_multi_op = ratio_to(times, REFERENCE), ratio_to(times, MULTI_OP)
    rows = []
    for label, layer in layers.items():
        memory = peak_cuda_bytes(layer, x, grad_y) if device.type == "cuda" else kept_bytes(layer, x)
        rows.append(
            {
                "device": device.type,
                "dtype": str(dtype).replace("torch.", ""),
                "shape": list(shape),
                "layer": label,
                "seconds": vs_gn[label]["seconds"],
                "bytes": memory,
                "time_vs_gn": vs_gn[label]["ratio"],
                "time_vs_gn_range": vs_gn[label]["ratio_range"],
                "time_vs_multi_op": vs_multi_op[label]["ratio"],
            }
        )
    by_label = {row["layer"]: row for row in rows}
    for row in rows:
        for suffix, reference in (("gn", by_label[REFERENCE]), ("multi_op", by_label[MULTI_OP])):
            row[f"memory_vs_{suffix}"] = row["bytes"] / reference["bytes"]
    if device.type == "cuda":
        for row in rows:
            row["gpu"] = torch.cuda.get_device_name(device)
    return rows


def print_profile(device, shape, dtype, baseline=None, norms=NORM_NAMES):
    """Per layer, one forward + backward under torch's profiler: the wall time, the kernels' count and GPU time,
    and the kernels that took most of it."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    grad_y = torch.randn(shape, device=device).to(dtype)
    for label, layer in candidates(shape[1], baseline, norms):
        layer = layer.to(device).train()
        for _ in range(3):
            step(layer, x, grad_y)
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            seconds = device_seconds(lambda: step(layer, x, grad_y), device)  # noqa: B023 (called here)
        kernels = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(event.time_range.elapsed_us() for event in kernels) / 1e3
        names = {}
        for event in kernels:
            names[event.name] = names.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
        top = ", ".join(f"{name[:40]} {ms:.3f}" for name, ms in sorted(names.items(), key=lambda item: -item[1])[:5])
        print(
            f"{'x'.join(map(str, shape))} {label:23} wall {1e3 * seconds:7.3f} ms, {len(kernels):4} kernels, "
            f"GPU {busy:7.3f} ms: {top}"
        )


def print_table(rows):
    width = max(13, *(len(row["layer"]) for row in rows))
    header = (
        f"{'device':6} {'shape':20} {'layer':{width}} {'fwd+bwd ms':>10} {'x GN':>6} {'rounds':>11} "
        f"{'memory MiB':>10} {'x GN':>6} {'time x multi-op':>15} {'mem x multi-op':>14}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        shape = "x".join(map(str, row["shape"]))
        print(
            f"{row['device']:6} {shape:20} {row['layer']:{width}} {1e3 * row['seconds']:10.1f} "
            f"{row['time_vs_gn']:6.2f} {range_text(row['time_vs_gn_range']):>11} "
            f"{row['bytes'] / 2**20:10.1f} {row['memory_vs_gn']:6.2f} "
            f"{row['time_vs_multi_op']:15.2f} {row['memory_vs_multi_op']:14.2f}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="full")
    parser.add_argument(
        "--norms",
        default=",".join(NORM_NAMES),
        help="comma-separated names of build_norm to time "
        f"beside torch's references (default: all, {','.join(NORM_NAMES)})",
    )
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed forward + backward passes")
    parser.add_argument("--threads", type=positive_int, help="CPU threads (default: PyTorch's choice)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        action="append",
        help="time on this device only (repeatable; default: the CPU, and CUDA where available)",
    )
    parser.add_argument("--amp", action="store_true", help="float16 inputs under autocast (CUDA only)")
    parser.add_argument("--profile", action="store_true", help="also profile one step of each layer (CUDA only)")
    parser.add_argument("--json", metavar="PATH", type=output_file, help="also write the rows as JSON")
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also time each learned norm as commit REF of this checkout has it, side by side (rows 'NAME @COMMIT')",
    )
    return parser


def main(argv: Sequence[str] | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    norms = norm_names(parser, args.norms, NORM_NAMES)
    try:
        baseline = baseline_layers(args.baseline) if args.baseline else None
    except ValueError as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    if "cuda" in (args.device or []) and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")

    available = ["cpu"] + ["cuda"] * torch.cuda.is_available()
    devices = [torch.device(name) for name in dict.fromkeys(args.device or available)]
    if args.amp and [device.type for device in devices] != ["cuda"]:
        parser.error("--amp times CUDA only: give --device cuda on a machine with a CUDA device")
    dtype = torch.float16 if args.amp else torch.float32
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    if torch.cuda.is_available():
        print(f"CUDA device: {torch.cuda.get_device_name()}")
    rows = []
    for device in devices:
        for shape in SHAPES[args.shapes]:
            shape_rows = measure(device, shape, args.repeats, dtype, baseline, norms)
            rows += shape_rows
            print_table(shape_rows)
            print()
            if args.profile and device.type == "cuda":
                print_profile(device, shape, dtype, baseline, norms)
                print()
    if args.json:
        create_folder_of(args.json)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
