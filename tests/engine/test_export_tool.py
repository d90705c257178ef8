"""tools/export_model.py (``engine.export``) on tiny trained Mask R-CNNs with SN: as built, to ONNX (through
onnxruntime) and TorchScript, traced and scripted, it gives PyTorch's boxes, scores, classes and masks; a
LazyConfig exports too; and the tool refuses what it cannot do, saying why. Every norm, folded:
test_export_tool_norms.py."""

import os

import pytest
import torch
from detectron2.config import LazyConfig, instantiate
from exported_models import assert_agrees, run_tool, trained_files
from tiny_rcnn import synthetic_batch

from sn_detection.engine import export as export_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::UserWarning")


@pytest.mark.parametrize(
    "flags",
    [["--format", "onnx"], ["--format", "torchscript"], ["--format", "torchscript", "--export-method", "scripting"]],
    ids=["onnx", "torchscript-tracing", "torchscript-scripting"],
)
def test_switchable_norm_exports_as_built(flags, sample_image, tmp_path):
    config, weights = trained_files("SN", tmp_path)
    report = run_tool(config, weights, sample_image, tmp_path / "out", *flags)
    assert report["file"].endswith("model.onnx" if "onnx" in flags else "model.ts")
    assert_agrees(report, traced="scripting" not in flags)


def test_a_lazy_config_exports_with_its_init_checkpoint(tmp_path):
    config = os.path.join(ROOT, "configs", "lazy", "demo_mask_rcnn_sn.py")
    cfg = LazyConfig.load(config)
    torch.manual_seed(0)
    weights = tmp_path / "model.pth"
    torch.save({"model": instantiate(cfg.model).state_dict()}, weights)
    overrides = [f"train.init_checkpoint={weights}", "model.roi_heads.box_predictor.test_score_thresh=0.0"]
    report = export_tool.main(["--config-file", config, "--output", str(tmp_path / "out"), "--fold", *overrides])
    assert_agrees(report)  # the sample is the first image of the config's test set, the embedded shapes


def test_the_tool_refuses_what_it_cannot_do(sample_image, tmp_path, capsys):
    with pytest.raises(SystemExit):
        export_tool.parse_args(["--config-file", "c.yaml", "--output", "o", "--format", "caffe2"])
    assert "invalid choice: 'caffe2' (choose from 'onnx', 'torchscript')" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_tool.parse_args(["--config-file", "c.yaml", "--output", "o", "--export-method", "scripting"])
    assert "scripting writes TorchScript only" in capsys.readouterr().err
    config, weights = trained_files("SN", tmp_path)
    with pytest.raises(FileNotFoundError, match="--sample-image nowhere.png does not exist"):
        run_tool(config, weights, "nowhere.png", tmp_path / "out")
    with pytest.raises(ValueError, match="no test dataset to take a sample from: give --sample-image"):
        export_tool.main(["--config-file", config, "--output", str(tmp_path / "out"), "MODEL.WEIGHTS", weights])
    model, _ = export_tool.load_model(config, ["MODEL.WEIGHTS", weights])
    with pytest.raises(ValueError, match=r"training mode.*call model.eval\(\) before exporting"):
        export_tool.export(model.train(), synthetic_batch()[0]["image"], str(tmp_path / "out"))
