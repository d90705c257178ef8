"""The switches of the Triton path (``kernels``'s module docstring) as the layers read them, on the
reference stack: an environment variable read once, when the layers are imported, 0 or 1 (unset: 1), any
other value refused at import with the variable and its values named. ``SN_DETECTION_KERNELS=0`` takes CUDA
tensors off the kernel path and silences the warning of a missing Triton 3.

No GPU here: a CPU tensor that reports ``is_cuda`` stands for a CUDA input (as in test_kernels_off_warning.py),
in a process of its own for each setting, since the switches are read at import. What the switches do on the
kernel path itself is in tests/kernels/test_kernel_switches.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sn_detection.layers import kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWITCHES = (kernels.KERNELS_VARIABLE, kernels.DIRECT_LAUNCH_VARIABLE)


def run_python(script: str, **variables: str) -> subprocess.CompletedProcess:
    """``script`` in a new process with this checkout first on its path and ``variables`` set (the switches
    not set unless given)."""
    env = {key: value for key, value in os.environ.items() if key not in SWITCHES}
    env.update(variables, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "value, on", [(None, True), ("", True), ("1", True), (" 1 ", True), ("0", False), ("0\n", False)]
)
def test_a_switch_is_on_unless_it_is_0(value, on, monkeypatch):
    if value is None:
        monkeypatch.delenv("SN_DETECTION_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("SN_DETECTION_TEST_SWITCH", value)
    assert kernels.environment_switch("SN_DETECTION_TEST_SWITCH", off="off", on="on") is on


@pytest.mark.parametrize("value", ["yes", "false", "2", "on"])
def test_any_other_value_is_refused_naming_the_variable_and_its_values(value, monkeypatch):
    monkeypatch.setenv("SN_DETECTION_TEST_SWITCH", value)
    with pytest.raises(ValueError) as error:
        kernels.environment_switch("SN_DETECTION_TEST_SWITCH", off="what 0 does", on="what 1 does")
    assert str(error.value) == (
        f"SN_DETECTION_TEST_SWITCH={value!r} is invalid: set it to 0 (what 0 does) or 1 (what 1 does; the "
        "default), or leave it unset"
    )


@pytest.mark.parametrize("variable", SWITCHES)
def test_a_bad_value_stops_the_import(variable):
    result = run_python("import sn_detection.layers", **{variable: "yes"})
    assert result.returncode == 1
    assert f"ValueError: {variable}='yes' is invalid: set it to 0 (" in result.stderr


# Every planned layer (GN is torch's GroupNorm: no plan, no kernel) on a CUDA-looking input: whether it is on
# the kernel path with Triton 3 (made to look installed, whatever is), and the KernelsOffWarnings raised
# without it, training and evaluating.
LAYERS_ON_CUDA = """
    import json, warnings
    import torch
    from sn_detection.layers import NORM_NAMES, build_norm, kernels

    class CudaLooking(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    planned = [name for name in NORM_NAMES if name != "GN"]
    x = torch.randn(2, 8, 3, 4).as_subclass(CudaLooking)
    kernels._TRITON = True
    on_kernel_path_with_triton_3 = kernels.kernel_path(x)
    if not on_kernel_path_with_triton_3:  # the PyTorch path: every layer runs on the CPU tensor behind x
        outputs = [build_norm(name, 8).train(training)(x) for name in planned for training in (True, False)]
    kernels._TRITON = False  # a Triton older than 3, or none (the reference stack has 2.3.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in planned:
            for training in (True, False):
                build_norm(name, 8).train(training)(x)
    warned = [str(w.message) for w in caught if issubclass(w.category, kernels.KernelsOffWarning)]
    print(json.dumps({"kernel_path": on_kernel_path_with_triton_3, "warned": warned}))
"""


def layers_on_cuda(**variables):
    result = run_python(LAYERS_ON_CUDA, **variables)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_kernels_off_takes_cuda_inputs_off_the_kernel_path_without_a_warning():
    default, off = layers_on_cuda(), layers_on_cuda(SN_DETECTION_KERNELS="0")
    assert default["kernel_path"] and not off["kernel_path"]
    assert len(default["warned"]) == 1 and f"set {kernels.KERNELS_VARIABLE}=0" in default["warned"][0]
    assert off["warned"] == []  # asked for: nothing to warn of
    assert layers_on_cuda(SN_DETECTION_KERNELS="1")["kernel_path"]
