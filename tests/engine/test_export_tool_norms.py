"""tools/export_model.py (``engine.export``) on a tiny trained Mask R-CNN of every norm, folded, to ONNX: through
onnxruntime it gives the trained model's boxes, scores, classes and masks (in a file of its own, so that the
test workers share the export tests)."""

import os

import pytest
from exported_models import assert_agrees, run_tool, trained_files

from sn_detection.layers import NORM_NAMES

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::UserWarning")


# SyncSN and SyncSSN fold to SN's and SSN's forms (tests/layers/test_inference.py)
@pytest.mark.parametrize("norm", ["FrozenBN", *(name for name in NORM_NAMES if not name.startswith("Sync"))])
def test_every_norm_folded_exports_to_onnx_and_runs_in_onnxruntime(norm, sample_image, tmp_path, capsys):
    config, weights = trained_files(norm, tmp_path)
    report = run_tool(config, weights, sample_image, tmp_path / "out", "--fold")
    assert report["file"] == str(tmp_path / "out" / "model.onnx") and os.path.isfile(report["file"])
    assert_agrees(report)  # against the trained model as built: the fold and the export together
    out = capsys.readouterr().out
    assert "(onnx, tracing, norms folded)" in out and "pred_boxes (64x85): max |difference|" in out
