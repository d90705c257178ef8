"""Every layer exports, in evaluation mode, with the exporters detectron2 users take (``base.exporting``):

- ``torch.onnx.export`` (the TorchScript-based exporter, opset 17, N, H and W dynamic), called with grad
  enabled as users call it and under no_grad: onnxruntime runs the graph and gives PyTorch's outputs within
  1e-5 relative, at the traced shape and another;
- ``torch.export.export`` with the same dynamic dimensions: the exported program gives the same outputs;

and the exported layer is lean: SN's ONNX graph is counted against GN's. What cannot export refuses with an
error that names the fix. These run on the reference stack and on current torch (the kernel-test
environment; TorchScript is tests/layers/test_torchscript.py and tests/d2/test_export.py).
"""

import collections
import inspect
import io

import onnx
import onnxruntime
import pytest
import torch
from torch import nn

from sn_detection.layers import NORM_NAMES, build_norm
from sn_detection.layers import switchable as switchable_module

CHANNELS = 32
SHAPES = [(2, 8, 12, 10), (3, 8, 7, 16)]  # traced at the first; the second has other N, H and W
# torch >= 2.5 exports through dynamo unless told otherwise; the TorchScript-based exporter is the one
# detectron2's export_model.py uses
TORCHSCRIPT_EXPORTER = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
pytestmark = pytest.mark.usefixtures("one_thread")


def conv_and_norm(name: str, seed: int = 0) -> nn.Module:
    """A convolution and the norm ``name``, trained three steps' worth of statistics, in evaluation mode."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(8, CHANNELS, 3, padding=1), build_norm(name, CHANNELS))
    with torch.no_grad():
        for parameter in model[1].parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
        model.train()
        for _ in range(3):
            model(torch.randn(4, *SHAPES[0][1:]) * 2 + 1)
    return model.eval()


def onnx_bytes(model: nn.Module, grad: bool) -> bytes:
    buffer = io.BytesIO()
    with torch.set_grad_enabled(grad):
        torch.onnx.export(
            model,
            (torch.randn(SHAPES[0]),),
            buffer,
            opset_version=17,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}, "y": {0: "n", 2: "h", 3: "w"}},
            **TORCHSCRIPT_EXPORTER,
        )
    return buffer.getvalue()


def assert_same(got, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(torch.as_tensor(got), expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("name", NORM_NAMES)
def test_onnx_export_runs_in_onnxruntime_as_in_pytorch(name, grad):
    model = conv_and_norm(name)
    session = onnxruntime.InferenceSession(onnx_bytes(model, grad), providers=["CPUExecutionProvider"])
    for seed, shape in enumerate(SHAPES):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 - 1
        with torch.no_grad():
            expected = model(x)
        assert_same(session.run(None, {"x": x.numpy()})[0], expected)
    assert model[1].training is False  # the exporter restores the mode it found


@pytest.mark.parametrize("name", NORM_NAMES)
def test_torch_export_gives_pytorchs_outputs(name):
    model = conv_and_norm(name)
    batch, height, width = torch.export.Dim("batch"), torch.export.Dim("height"), torch.export.Dim("width")
    program = torch.export.export(
        model, (torch.randn(SHAPES[0]),), dynamic_shapes={"input": {0: batch, 2: height, 3: width}}
    )
    exported = program.module()
    for seed, shape in enumerate(SHAPES):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 - 1
        with torch.no_grad():
            assert_same(exported(x), model(x))


def node_counts(name: str) -> collections.Counter:
    """The ONNX operators of the layer ``name`` alone (its convolution left out)."""
    graph = onnx.load_from_string(onnx_bytes(conv_and_norm(name), grad=False)).graph
    return collections.Counter(node.op_type for node in graph.node if node.op_type != "Conv")


def test_exported_switchable_norm_is_lean():
    sn, gn = node_counts("SN"), node_counts("GN")
    # GN: InstanceNormalization between two reshapes, then the affine (9 nodes); SN computes three branches'
    # statistics from the IN moments and mixes them: 23 nodes, four of them reductions, one square root
    assert sum(sn.values()) <= 2.6 * sum(gn.values()), (sn, gn)
    assert sn["ReduceMean"] == 4 and sn["Sqrt"] == 1, sn
    assert not {"Cast", "Softmax", "Identity", "Where", "ScatterND"} & set(sn), sn  # constants folded, no branch


def test_sync_switchable_norm_refuses_a_training_export_across_processes(monkeypatch):
    layer = build_norm("SyncSN", CHANNELS).train()
    monkeypatch.setattr(switchable_module, "_several_processes", lambda: True)
    with pytest.raises(RuntimeError, match=r"cannot be exported in training mode.*model\.eval\(\)"):
        torch.jit.trace(layer, (torch.randn(2, CHANNELS, 4, 4),), check_trace=False)
    layer.eval()  # where it computes what SN does
    traced = torch.jit.trace(layer, (torch.randn(2, CHANNELS, 4, 4),), check_trace=False)
    x = torch.randn(3, CHANNELS, 5, 6)
    torch.testing.assert_close(traced(x), layer(x))
