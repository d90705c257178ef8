"""Export of detectron2 models whose backbone, FPN and heads use our norms, the ways detectron2 tests
its own models (its tests/test_export_torchscript.py and tests/modeling/test_backbone.py):

- ``torch.jit.script`` of the backbone as built (training mode; tests/layers/test_torchscript.py saves
  and loads every scripted layer);
- ``detectron2.export.scripting_with_instances`` of the whole Mask R-CNN in evaluation mode;
- ``detectron2.export.TracingAdapter`` + ``torch.jit.trace`` of the whole Mask R-CNN, traced on one
  image and run on another.

Each exported model must give the eager model's outputs in evaluation mode. The models first train one
step, so that running statistics and gates have left their initial values.
"""

import pytest
import torch
from detectron2.export import TracingAdapter, scripting_with_instances
from detectron2.modeling import build_model
from detectron2.structures import Boxes
from tiny_rcnn import IMAGE_SIZE, synthetic_batch, tiny_cfg, train_step
from torch import Tensor

from sn_detection.layers import NORM_NAMES

# What Instances hold in R-CNN inference (detectron2's own scripting test declares the same fields).
INSTANCE_FIELDS = {
    "proposal_boxes": Boxes,
    "objectness_logits": Tensor,
    "pred_boxes": Boxes,
    "scores": Tensor,
    "pred_classes": Tensor,
    "pred_masks": Tensor,
}
# The fields compared between exported and eager outputs.
OUTPUT_FIELDS = ("pred_boxes", "scores", "pred_classes", "pred_masks")
# DN and MN keep their batch-average state in an instance attribute that is None outside a batch
# average; TorchScript reads it as None (and warns that it cannot use its annotation).
pytestmark = [
    pytest.mark.filterwarnings("ignore:The TorchScript type system doesn't support instance-level"),
    pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
]


@pytest.fixture(scope="module", params=NORM_NAMES)
def model(request):
    """A tiny Mask R-CNN with the norm in every norm key, after one training step, in evaluation mode.

    ResNet-18: scripting and tracing take time per module, whatever its width.
    """
    cfg = tiny_cfg(request.param, "fpn", "MODEL.RESNETS.DEPTH", 18, "MODEL.RESNETS.RES2_OUT_CHANNELS", 64)
    cfg.merge_from_list(["MODEL.ROI_HEADS.SCORE_THRESH_TEST", 0.0, "TEST.DETECTIONS_PER_IMAGE", 10])
    torch.manual_seed(0)
    model = build_model(cfg)
    train_step(cfg, model)
    return model.eval()


def images():
    return [record["image"] for record in synthetic_batch(seed=3)]


def assert_same_detections(got, expected):
    assert len(expected) > 0, "nothing to compare"
    for field in OUTPUT_FIELDS:
        got_value, expected_value = getattr(got, field), getattr(expected, field)
        if isinstance(expected_value, Boxes):
            got_value, expected_value = got_value.tensor, expected_value.tensor
        torch.testing.assert_close(got_value, expected_value, rtol=1e-4, atol=1e-4, msg=field)


def test_backbone_scripts_and_matches_eager(model):
    # importing detectron2.export made ResNet and FPN scriptable (patch_nonscriptable_classes)
    backbone = model.backbone.train()  # scripted as built: the training code paths compile too
    try:
        scripted = torch.jit.script(backbone)
    finally:
        backbone.eval()
    scripted.eval()
    x = torch.stack(images()) - 128
    # the first call of a script module is a profiling pass anyway; without optimisation it is quicker
    with torch.no_grad(), torch.jit.optimized_execution(False):
        expected, got = backbone(x), scripted(x)
    assert got.keys() == expected.keys()
    for level in expected:
        torch.testing.assert_close(got[level], expected[level], rtol=1e-4, atol=1e-4, msg=level)


def test_mask_rcnn_scripts_with_instances_and_matches_eager(model):
    scripted = scripting_with_instances(model, INSTANCE_FIELDS)
    inputs = [{"image": image} for image in images()]
    with torch.no_grad(), torch.jit.optimized_execution(False):  # see below
        expected = model.inference(inputs, do_postprocess=False)
        got = scripted.inference(inputs, do_postprocess=False)
    for got_instances, expected_instances in zip(got, expected):
        assert_same_detections(got_instances, expected_instances)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # detectron2's and ours: shape checks become constants
def test_mask_rcnn_traces_and_matches_eager(model):

    def inference(model, image):
        return model.inference([{"image": image}], do_postprocess=False)[0]

    image, other_image = images()
    adapter = TracingAdapter(model, image, inference)
    with torch.no_grad():
        # traced on another image, as detectron2's test does: the trace must not bake in the first one;
        # the comparison below replaces torch.jit.trace's own (slow) check
        traced = torch.jit.trace(adapter, (other_image,), check_trace=False)
        expected = inference(model, image)
        got = adapter.outputs_schema(traced(image))
    assert tuple(got.image_size) == (IMAGE_SIZE, IMAGE_SIZE)
    assert_same_detections(got, expected)
