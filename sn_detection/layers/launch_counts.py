"""What a layer's training step asks of the device, counted on any machine: kernel launches, allocations and
host synchronisations.

On a GPU each kernel launch costs microseconds of host time whatever it computes, so a layer made of many
small operations is bound by its launches, not by its arithmetic. The launches can be counted without a GPU:
every ATen operation reaches the dispatcher, where a ``TorchDispatchMode`` sees it, and every Triton kernel of
this package is launched through ``kernel_launch.launch``, where ``kernel_launch.observed_launches`` sees it.
Counted:

- ``launches``: ATen operations that compute something (each is at least one kernel on a GPU) plus Triton
  launches. Views (``expand``, ``view``, ``detach``, ...) and allocations launch nothing and are not
  counted; the ATen work Triton's interpreter does to run a kernel on the CPU is not seen either.
- ``allocations``: ``empty``-like operations (no kernel; the caching allocator serves them on the host).
- ``syncs``: operations that make the host wait for the device: reading a value (``item``, ``bool``, an
  ``if`` on a tensor: ``aten._local_scalar_dense``) or computing a shape from values (``nonzero``, boolean
  indexing, ``unique``, ...). A layer that has none can be captured in a CUDA graph.

Run on the kernel path (a CUDA GPU, or the CPU under ``TRITON_INTERPRET=1``) the layers' counts are the
kernels a GPU profiler records for them; some ATen operations launch several kernels on a GPU (torch's
group norm, for one), so for other code the count is a lower bound.
``layer_counts`` counts every layer of ``build_norm`` beside torch's GroupNorm and BatchNorm
(``tools/count_launches.py``).

``KERNEL_PATH_COUNTS`` is what each layer with kernels asks of the device on the kernel path, as the docs
state it (README, docs/layers.md, docs/benchmarks.md): the one place those numbers are written, which
tests/kernels/test_launches.py holds the code to exactly and tests/test_documented_counts.py the docs.

``kernel_launch.skipped_launches`` runs a layer with no Triton kernel, so that the host's work around its
kernels (its Python and ATen calls) can be timed on any machine with the kernel path
(``tools/count_launches.py --host-time``). On a GPU a layer whose kernels take less time than this is bound
by it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import map_passes
from .factory import NORM_NAMES, build_norm
from .kernel_launch import observed_launches

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
    whether the input takes the kernel path there (``map_passes.kernel_path``); on CUDA also the kernels the
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
                "kernel_path": map_passes.kernel_path(x),
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
