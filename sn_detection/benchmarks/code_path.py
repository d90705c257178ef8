"""Which of the package's files a layer's training step runs through, in order: what a reader follows to
read it. Printed for every layer with kernels by

    TRITON_INTERPRET=1 $(tools/setup_kernel_env.sh) tools/code_path.py [--norms SN,PONO] [--calls]

The step (forward, then backward of a given upstream gradient, the parameters' gradients set to None first)
runs on the kernel path, CPU tensors under Triton's interpreter (on CUDA autograd would run the backward in
a thread of its own, which the hook below does not see), with its Triton launches skipped
(``layers.kernels.skipped_launches``), after a first step that made the layer's call plan, as every
step after the first does. Python's profiler hook (``sys.setprofile``) records each call of a function of the
model package, ``sn_detection/layers``, in order: its file and its name (a comprehension or a generator
expression is a call of its own, as Python runs it). Per direction, the forward (the layer's call) and the
backward (autograd's call of the layer's node):

- ``files``: the files called into, in the order they are first entered;
- ``hops``: how often consecutive calls go to different files; a file is *entered once* when its calls form
  one stretch, which ``reentered`` lists the files that do not.

``code_path(layer, x, grad_y)`` records one step.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..engine.arguments import nchw_shape, norm_names
from ..layers import NORM_NAMES, build_norm
from ..layers.kernels import kernel_path, skipped_launches

_GENERATOR = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
LAYERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "layers")


class Direction(NamedTuple):
    """The model package's calls of one direction: ``calls`` as (file name, function name)."""

    calls: tuple[tuple[str, str], ...]

    @property
    def files(self) -> tuple[str, ...]:
        """The files called into, in the order they are first entered."""
        return tuple(dict.fromkeys(file for file, _ in self.calls))

    @property
    def stretches(self) -> tuple[str, ...]:
        """The file of each stretch of consecutive calls into one file."""
        files = [file for file, _ in self.calls]
        return tuple(file for i, file in enumerate(files) if i == 0 or files[i - 1] != file)

    @property
    def hops(self) -> int:
        """How often consecutive calls go to different files."""
        return max(len(self.stretches) - 1, 0)

    @property
    def reentered(self) -> tuple[str, ...]:
        """The files entered more than once (whose calls form several stretches)."""
        stretches = self.stretches
        return tuple(file for file in self.files if stretches.count(file) > 1)


class CodePath(NamedTuple):
    """A training step's calls of the package's functions: ``forward`` and ``backward``."""

    forward: Direction
    backward: Direction

    @property
    def files(self) -> tuple[str, ...]:
        """Every file the step enters, in the order first entered."""
        return tuple(dict.fromkeys(self.forward.files + self.backward.files))

    @property
    def hops(self) -> int:
        return self.forward.hops + self.backward.hops


def recorded_calls(function: Callable[[], object], package: str = LAYERS) -> Direction:
    """Runs ``function()`` and records the calls of functions defined under ``package``, in order."""
    root = package + os.sep
    calls = []
    generators = set()  # a generator's frames, whose every resumption is a "call" event too (not a new call)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            if frame.f_code.co_flags & _GENERATOR:
                if frame in generators:
                    return
                generators.add(frame)
            calls.append((os.path.relpath(frame.f_code.co_filename, package), frame.f_code.co_name))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        function()
    finally:
        sys.setprofile(previous)
    return Direction(tuple(calls))


def code_path(layer: nn.Module, x: Tensor, grad_y: Tensor) -> CodePath:
    """The package's calls of a training step of ``layer`` on ``x`` (module docstring): a first step makes the
    call plan, the second is recorded; Triton's launches are skipped in both."""
    layer.train()
    x = x.detach().requires_grad_()

    def forget_gradients():
        for parameter in layer.parameters():
            parameter.grad = None
        x.grad = None

    with skipped_launches():
        forget_gradients()
        layer(x).backward(grad_y)
        forget_gradients()
        outputs = []
        forward = recorded_calls(lambda: outputs.append(layer(x)))
        backward = recorded_calls(lambda: outputs[0].backward(grad_y))
    return CodePath(forward, backward)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    planned = [name for name in NORM_NAMES if name != "GN"]  # GN is torch's group norm
    parser.add_argument("--norms", default=",".join(planned), help=f"comma-separated, of {', '.join(planned)}")
    parser.add_argument("--shape", default="2,64,3,5", help="N,C,H,W of the input (default: 2,64,3,5)")
    parser.add_argument("--calls", action="store_true", help="also list every call, in order")
    return parser


def main(argv: Sequence[str] | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    names = norm_names(parser, args.norms, NORM_NAMES)
    shape = nchw_shape(parser, args.shape)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    grad_y = torch.randn(shape, generator=generator)
    if not kernel_path(x):
        parser.error(
            "CPU tensors take the kernel path only under Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "kernel-test environment"
        )
    for name in names:
        path = code_path(build_norm(name, shape[1]), x, grad_y)
        print(f"{name}: {len(path.files)} files, {path.hops} hops")
        for label, direction in (("forward", path.forward), ("backward", path.backward)):
            again = f"; entered again: {', '.join(direction.reentered)}" if direction.reentered else ""
            print(f"  {label:8} {direction.hops:2} hops: {' -> '.join(direction.stretches)}{again}")
            if args.calls:
                for file, function in direction.calls:
                    print(f"    {file}: {function}")


if __name__ == "__main__":
    main()
