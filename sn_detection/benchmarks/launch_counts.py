"""What a layer's training step asks of the device, counted on any machine: kernel launches, allocations and
host synchronisations; and ``tools/count_launches.py``, which prints them for every layer of ``build_norm``
beside torch's GroupNorm and BatchNorm:

    tools/count_launches.py [--device cuda] [--json counts.json] [--host-time [--baseline REF]]
    TRITON_INTERPRET=1 $(tools/setup_kernel_env.sh) tools/count_launches.py   # the GPU's path, on the CPU

On a GPU each kernel launch costs microseconds of host time whatever it computes, so a layer made of many
small operations is bound by its launches, not by its arithmetic. The launches can be counted without a GPU:
every ATen operation reaches the dispatcher, where a ``TorchDispatchMode`` sees it, and every Triton kernel of
the layers is launched through ``layers.kernels.launch``, where ``kernels.observed_launches`` sees
it. Counted:

- ``launches``: ATen operations that compute something (each is at least one kernel on a GPU) plus Triton
  launches. Views (``expand``, ``view``, ``detach``, ...) and allocations launch nothing and are not
  counted; the ATen work Triton's interpreter does to run a kernel on the CPU is not seen either.
- ``allocations``: ``empty``-like operations (no kernel; the caching allocator serves them on the host).
- ``syncs``: operations that make the host wait for the device: reading a value (``item``, ``bool``, an
  ``if`` on a tensor: ``aten._local_scalar_dense``) or computing a shape from values (``nonzero``, boolean
  indexing, ``unique``, ...). A layer that has none can be captured in a CUDA graph.

Run on the kernel path (a CUDA GPU, or the CPU under ``TRITON_INTERPRET=1``) the layers' counts are the
kernels a GPU profiler records for them; some ATen operations launch several kernels on a GPU (torch's
group norm, for one), so for other code the count is a lower bound. Without a GPU and without the
interpreter, the layers run their PyTorch path, and that is what is counted (``layer_counts``).

``KERNEL_PATH_COUNTS`` is what each layer with kernels asks of the device on the kernel path, as the docs
state it (README, docs/layers.md, docs/benchmarks.md): the one place those numbers are written, which
tests/kernels/test_launches.py holds the code to exactly and tests/test_documented_counts.py the docs.

``--host-time`` also times each layer's training step and evaluation forward on the kernel path (a CUDA
device, or the interpreter as in the second line) with its Triton launches skipped
(``kernels.skipped_launches``): the host's work around the kernels (its Python and ATen calls), beside
torch's GroupNorm(32) (``host_times``). On a GPU a layer whose kernels take less time than this is bound by
it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import importlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine.arguments import create_folder_of, output_file, positive_int
from ..layers import NORM_NAMES, build_norm, kernels
from ..layers.kernels import observed_launches, skipped_launches
from .baseline import baseline_layers, baseline_twin
from .timing import WARMUP_ROUNDS, device_seconds, interleaved_seconds, range_text, ratio_to

_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_SYNCS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
    "unique_consecutive", "unique_dim", "equal", "is_nonzero", "_assert_async", "repeat_interleave",
})  # fmt: skip
# indexing with a boolean mask computes the mask's nonzero positions first
_INDEXING = frozenset({"index", "_index_put_impl_", "index_put", "index_put_"})


class KernelPathCounts(NamedTuple):
    """A layer's counts on the kernel path: Triton launches per training forward + backward (gradients set
    to None first, as ``zero_grad`` leaves them) and per inference forward (evaluation mode, no gradients),
    both with no other launch, and allocations per training step."""

    training: int
    inference: int
    allocations: int


# every layer with Triton kernels (GN is torch's GroupNorm), in one process (SyncSN across processes adds
# its all-reduces)
KERNEL_PATH_COUNTS = {
    "SN": KernelPathCounts(training=6, inference=3, allocations=10),
    "SyncSN": KernelPathCounts(training=6, inference=3, allocations=10),
    "SSN": KernelPathCounts(training=6, inference=3, allocations=10),
    "SyncSSN": KernelPathCounts(training=6, inference=3, allocations=10),
    "DN": KernelPathCounts(training=7, inference=3, allocations=10),
    "MGN": KernelPathCounts(training=6, inference=3, allocations=10),
    "MN": KernelPathCounts(training=6, inference=3, allocations=10),
    "BNSR": KernelPathCounts(training=6, inference=1, allocations=9),
    "PONO": KernelPathCounts(training=3, inference=1, allocations=6),
}


def _has_mask_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices)


class DispatchCount(NamedTuple):
    """Counts of one call (module docstring); ``operations`` names each launch, ``"triton:<kernel>"`` for
    Triton's."""

    launches: int
    allocations: int
    syncs: int
    operations: collections.Counter


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.operations = collections.Counter()
        self.allocations = 0
        self.syncs = 0
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_triton:
            name = func.overloadpacket.__name__
            if name in _SYNCS or (name in _INDEXING and _has_mask_index(args)):
                self.syncs += 1
            if name in _ALLOCATIONS:
                self.allocations += 1
            elif not func.is_view:
                self.operations[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def triton_launch(self, kernel, args, meta) -> Iterator[None]:
        self.operations["triton:" + getattr(kernel, "__name__", repr(kernel))] += 1
        self._in_triton += 1
        try:
            yield
        finally:
            self._in_triton -= 1


@contextlib.contextmanager
def recorded_kernels() -> Iterator[list]:
    """The names of the Triton kernels launched within the block, in order."""
    names = []

    def observe(kernel, args, meta):
        names.append(getattr(kernel, "__name__", repr(kernel)))
        return contextlib.nullcontext()

    with observed_launches(observe):
        yield names


def triton_launches(counts: DispatchCount) -> int:
    """The Triton kernel launches among ``counts``' launches."""
    return sum(number for name, number in counts.operations.items() if name.startswith("triton:"))


def count_dispatch(function: Callable[[], object]) -> DispatchCount:
    """Runs ``function()`` and counts what it dispatched (module docstring)."""
    counter = _Counter()
    with observed_launches(counter.triton_launch), counter:
        function()
    return DispatchCount(sum(counter.operations.values()), counter.allocations, counter.syncs, counter.operations)


def count_training_step(layer: nn.Module, x: Tensor, grad_y: Tensor) -> DispatchCount:
    """The counts of one training forward and backward of ``layer`` on ``x`` (which gets a gradient too),
    its parameters' gradients set to None first, as ``zero_grad`` leaves them."""
    layer.train()
    for parameter in layer.parameters():
        parameter.grad = None
    x = x.detach().requires_grad_()

    def step():
        layer(x).backward(grad_y)

    return count_dispatch(step)


def profiled_cuda_kernels(function: Callable[[], object]) -> int:
    """The CUDA kernels (and memory operations) ``function()`` ran, as torch's profiler records them: what
    ``count_dispatch`` estimates, seen on the device."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        function()
        torch.cuda.synchronize()
    return sum(1 for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def layer_counts(device: torch.device, shape=(2, 256, 6, 6)) -> list[dict]:
    """Per layer (torch's GroupNorm(32) and BatchNorm2d, then every name of ``build_norm``): the counts of a
    training step and of an inference forward (without gradients, in evaluation mode) on ``shape``, and
    whether the input takes the kernel path there (``kernels.kernel_path``); on CUDA also the kernels the
    profiler saw in a second training step."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(device)
    grad_y = torch.randn(shape, generator=generator).to(device)
    layers = {"torch GN(32)": nn.GroupNorm(32, shape[1]), "torch BN": nn.BatchNorm2d(shape[1])}
    layers.update((name, build_norm(name, shape[1])) for name in NORM_NAMES)
    rows = []
    for label, layer in layers.items():
        layer = layer.to(device)
        train = count_training_step(layer, x, grad_y)
        profiled = (
            profiled_cuda_kernels(functools.partial(count_training_step, layer, x, grad_y))
            if device.type == "cuda"
            else None
        )
        with torch.no_grad():
            inference = count_dispatch(lambda: layer.eval()(x))  # noqa: B023 (called here)
        rows.append(
            {
                "layer": label,
                "device": device.type,
                "shape": list(shape),
                "kernel_path": kernels.kernel_path(x),
                "train_launches": train.launches,
                "train_allocations": train.allocations,
                "train_syncs": train.syncs,
                "inference_launches": inference.launches,
                "inference_syncs": inference.syncs,
                "train_operations": dict(train.operations),
                "train_kernels_profiled": profiled,
            }
        )
    return rows


def host_times(device: torch.device, rounds: int, shape=(2, 256, 6, 6), steps: int = 100, baseline=None) -> dict:
    """Per layer (torch's GroupNorm(32), then every name of ``build_norm``): seconds of one training forward +
    backward (gradients set to None first, ``"train"``) and of one evaluation forward without gradients
    (``"eval"``), averaged over ``steps``, with the Triton launches skipped (``kernels.skipped_launches``;
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
    """The baseline package's own ``skipped_launches`` context: in its ``kernels`` module, or in its
    ``launches`` module in commits before that existed."""
    for module in ("kernels", "kernel_launch", "launches"):
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
    if args.host_time and not kernels.kernel_path(torch.empty(1, 1, 1, 1, device=device)):
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
