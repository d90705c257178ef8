"""A layer's training step reads in one sitting (``benchmarks.code_path``): on the kernel path, every learned layer
enters at most five of the package's files, each once per direction: the common base (the forward's skeleton),
the one autograd node of the fused path, the layer's kernel module, the shared kernel library and, where the
layer's call plan depends on it, the module of the paper's layer. NCHW and channels_last, one and two samples,
training and a frozen layer's evaluation step (x still needs its gradient)."""

import os

import pytest
import torch

from sn_detection.benchmarks.code_path import code_path
from sn_detection.layers import NORM_NAMES, build_norm

LEARNED = [name for name in NORM_NAMES if name != "GN"]  # GN is torch's group norm: its own forward
KERNEL_MODULE = {
    "SN": "switchable_kernels.py",
    "SyncSN": "switchable_kernels.py",
    "SSN": "switchable_kernels.py",
    "SyncSSN": "switchable_kernels.py",
    "DN": "dynamic_kernels.py",
    "MN": "mode_kernels.py",
    "MGN": "mode_kernels.py",
    "BNSR": "skewness_kernels.py",
    "PONO": "positional_kernels.py",
}
# the modules of the papers' layers, which a step may enter once, for its plan's key (SyncSN's process group)
LAYER_MODULES = {"switchable.py", "sparse_switchable.py", "dynamic.py", "mode.py", "skewness.py", "positional.py"}

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="the profiler hook sees the backward on the CPU only"
)


def features(layout, n):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, 3, 5, generator=generator).contiguous(memory_format=layout)
    return x, torch.randn(x.shape, generator=generator).contiguous(memory_format=layout)


def test_every_learned_layer_has_its_kernel_module():
    assert set(KERNEL_MODULE) == set(LEARNED)


@pytest.mark.parametrize("frozen", [False, True], ids=["training", "frozen"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", LEARNED)
def test_a_training_step_enters_five_files_at_most_each_once_per_direction(name, layout, n, frozen):
    layer = build_norm(name, 32)
    if frozen:
        layer.freeze()
    path = code_path(layer, *features(layout, n))
    assert path.forward.reentered == () and path.backward.reentered == (), path
    assert len(path.files) <= 5, path.files
    assert path.forward.stretches[0] == "base.py" and path.forward.stretches[-3:] == (
        "fused.py",
        KERNEL_MODULE[name],
        "kernels.py",
    ), path.forward
    assert path.backward.stretches == ("fused.py", KERNEL_MODULE[name], "kernels.py"), path.backward
    assert set(path.files) - {"base.py", "fused.py", KERNEL_MODULE[name], "kernels.py"} <= LAYER_MODULES


def test_the_recorded_step_is_the_one_the_kernels_run():
    # the step recorded launches the layer's kernels (skipped): the plan of the first step, not the PyTorch path
    path = code_path(build_norm("SN", 32), *features(torch.contiguous_format, 2))
    functions = [function for file, function in path.forward.calls if file == "kernels.py"]
    assert functions.count("launch") == 3 and "moments" in functions and "scale_shift" in functions
