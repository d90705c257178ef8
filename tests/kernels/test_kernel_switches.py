"""The switches of the Triton path where they act (``kernels``'s module docstring), each in processes
of its own since they are read at import:

- ``SN_DETECTION_KERNELS=0``: every layer's training step on a tensor the kernels take (CUDA, or the CPU
  under Triton's interpreter) launches no Triton kernel, and computes what the kernels compute;
- ``SN_DETECTION_DIRECT_LAUNCH=0``: with a Triton whose internals were read, every launch takes Triton's
  ordinary path where the default goes straight to the compiled kernel from the second launch on (Triton's
  JIT over a stand-in for the GPU, on any machine)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton

from sn_detection.layers import NORM_NAMES, kernels

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELPERS = os.path.join(REPO, "tests", "helpers")
SWITCHES = (kernels.KERNELS_VARIABLE, kernels.DIRECT_LAUNCH_VARIABLE)


def run_python(script: str, **variables: str) -> dict:
    """The JSON that ``script`` prints last, run in a new process with this checkout and tests/helpers on its
    path and ``variables`` set (the switches not set unless given; TRITON_INTERPRET as here)."""
    env = {key: value for key, value in os.environ.items() if key not in SWITCHES}
    env.update(variables, PYTHONPATH=os.pathsep.join(filter(None, [REPO, HELPERS, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# every planned layer's training step (GN is torch's GroupNorm: no kernel either way) on the kernel path's
# device: the Triton launches it made, and its output and input gradient, saved for the other process's
TRAINING_STEPS = """
    import json
    import torch
    from sn_detection.layers import NORM_NAMES, build_norm, kernels
    from sn_detection.benchmarks.launch_counts import count_training_step

    device = "{device}"
    results = {{}}
    for name in NORM_NAMES:
        if name == "GN":
            continue
        torch.manual_seed(0)
        layer = build_norm(name, 16).to(device)
        x = torch.randn(2, 16, 5, 7, device=device)
        grad_y = torch.randn(x.shape, device=device)
        counts = count_training_step(layer, x, grad_y)
        x = x.detach().requires_grad_()
        y = layer(x)
        y.backward(grad_y)
        torch.save({{"y": y.detach().cpu(), "grad_x": x.grad.cpu()}}, "{folder}/" + name + ".pt")
        triton = sum(number for op, number in counts.operations.items() if op.startswith("triton:"))
        results[name] = {{"triton": triton, "launches": counts.launches, "kernel_path": kernels.kernel_path(x)}}
    print(json.dumps(results))
"""


@pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs the kernel path: CUDA or the interpreter"
)
def test_kernels_off_runs_every_layer_without_a_triton_kernel_and_computes_the_same(tmp_path):
    device = "cpu" if INTERPRET else "cuda"
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    on = run_python(TRAINING_STEPS.format(device=device, folder=tmp_path / "on"))
    off = run_python(TRAINING_STEPS.format(device=device, folder=tmp_path / "off"), SN_DETECTION_KERNELS="0")
    assert set(on) == set(off) == set(NORM_NAMES) - {"GN"}
    for name in on:
        assert on[name]["kernel_path"] and on[name]["triton"] == on[name]["launches"] > 0, (name, on[name])
        assert not off[name]["kernel_path"] and off[name]["triton"] == 0, (name, off[name])
        assert off[name]["launches"] > on[name]["launches"]  # the PyTorch path: many more operations
        kernels, torch_path = (torch.load(tmp_path / folder / f"{name}.pt") for folder in ("on", "off"))
        for key in ("y", "grad_x"):
            torch.testing.assert_close(torch_path[key], kernels[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")


# three launches of one call through kernels.launch, on Triton's JIT over a stand-in for the GPU
STAND_IN_LAUNCHES = """
    import json
    import torch
    from stand_in_gpu import stand_in_jit
    from sn_detection.layers import kernels

    x, y = torch.zeros(256), torch.zeros(256)
    with stand_in_jit() as (kernel, launches):
        for _ in range(3):
            kernels.launch(kernel, (2,), (x, y, 200, 2.0), {"BLOCK": 128})
    counts = kernels.counts
    print(json.dumps({"direct": counts.direct, "ordinary": counts.ordinary, "launched": len(launches),
                      "direct_launch": kernels.direct_launch()}))
"""


@pytest.mark.skipif(
    triton.__version__ not in kernels.TRITON_VERSIONS,
    reason=f"Triton {triton.__version__} takes the ordinary path only",
)
def test_direct_launch_off_takes_tritons_ordinary_path_for_every_launch():
    default = run_python(STAND_IN_LAUNCHES)
    assert default == {"direct": 2, "ordinary": 1, "launched": 3, "direct_launch": True}
    off = run_python(STAND_IN_LAUNCHES, SN_DETECTION_DIRECT_LAUNCH="0")
    assert off == {"direct": 0, "ordinary": 3, "launched": 3, "direct_launch": False}
    assert run_python(STAND_IN_LAUNCHES, SN_DETECTION_DIRECT_LAUNCH="1") == default
