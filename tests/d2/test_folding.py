"""``fold_norms`` on tiny Mask R-CNNs with every norm: the folded model gives the trained model's features and
detections (1e-5 relative), its constant affines are gone into the convolutions, and it refuses to train or
to take weights that do not match its folding."""

import io

import pytest
import torch
from detectron2.layers import FrozenBatchNorm2d
from detectron2.modeling import build_model
from tiny_rcnn import norms_under, synthetic_batch, tiny_cfg, train_step
from torch import nn

from sn_detection.d2 import CheckedCheckpointer, FoldedModelError, fold_norms, is_folded
from sn_detection.layers import NORM_NAMES, DynamicNorm2d, GroupNorm2d, SkewnessReducedBatchNorm2d
from sn_detection.layers.inference import ChannelAffine
from sn_detection.layers.skewness import SignedPowerAffine

pytestmark = pytest.mark.usefixtures("one_thread")
# detectron2's own norms first: FrozenBN in the backbone (with random statistics), BatchNorm everywhere
NORMS = ["FrozenBN", "BN", *NORM_NAMES]


def trained_model(norm: str, *opts):
    cfg = tiny_cfg(norm, "fpn", "MODEL.RESNETS.DEPTH", 18, "MODEL.RESNETS.RES2_OUT_CHANNELS", 64, *opts)
    cfg.merge_from_list(["MODEL.ROI_HEADS.SCORE_THRESH_TEST", 0.0, "TEST.DETECTIONS_PER_IMAGE", 10])
    if norm == "FrozenBN":
        cfg.merge_from_list(["MODEL.FPN.NORM", "", "MODEL.ROI_BOX_HEAD.NORM", "", "MODEL.ROI_MASK_HEAD.NORM", ""])
    torch.manual_seed(0)
    model = build_model(cfg)
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, FrozenBatchNorm2d):  # converted BN statistics rather than the identity
            for name in ("weight", "bias", "running_mean"):
                getattr(module, name).copy_(torch.randn(module.num_features, generator=generator) * 0.5)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
    train_step(cfg, model)
    train_step(cfg, model)
    return cfg, model.eval()


def outputs(model) -> tuple[dict, list]:
    inputs = [{"image": record["image"]} for record in synthetic_batch(seed=3)]
    with torch.no_grad():
        features = model.backbone(model.preprocess_image(inputs).tensor)
        return features, model.inference(inputs, do_postprocess=False)


def assert_relative(got, expected, what):
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale, msg=what)


@pytest.mark.parametrize("norm", NORMS)
def test_a_folded_model_gives_the_trained_models_outputs(norm):
    _, model = trained_model(norm)
    features, detections = outputs(model)
    fold_norms(model)
    assert is_folded(model)
    folded_features, folded_detections = outputs(model)
    for level in features:
        assert_relative(folded_features[level], features[level], level)
    for got, expected in zip(folded_detections, detections):
        assert len(expected) > 0
        for field in ("pred_boxes", "scores", "pred_masks"):
            value, reference = getattr(got, field), getattr(expected, field)
            value, reference = getattr(value, "tensor", value), getattr(reference, "tensor", reference)
            assert_relative(value, reference, field)
        assert torch.equal(got.pred_classes, expected.pred_classes)


@pytest.mark.parametrize("norm", ["FrozenBN", "BN", "BNSR", "DN"])
def test_constant_affines_vanish_into_the_convolutions(norm):
    _, model = trained_model(norm)
    if norm == "DN":  # the batch gate on: statistics are the running ones, a constant affine
        for layer in model.modules():
            if isinstance(layer, DynamicNorm2d):
                layer.batch_gate.data.fill_(1.0)
    convs = {name: module for name, module in model.named_modules() if hasattr(module, "norm") and module.norm}
    fold_norms(model)
    kinds = (FrozenBatchNorm2d, nn.BatchNorm2d, SkewnessReducedBatchNorm2d, DynamicNorm2d, ChannelAffine)
    assert not [name for name, module in model.named_modules() if isinstance(module, kinds)]
    for name, conv in convs.items():
        assert conv.bias is not None, name
        if norm == "BNSR":
            assert isinstance(conv.norm, SignedPowerAffine), name
        else:
            assert conv.norm is None, name


def test_dn_pooling_contiguous_groups_folds_to_group_norm():
    _, model = trained_model("DN")  # tiny_cfg starts DN as GN(8)
    fold_norms(model)
    layers = norms_under(model, "backbone.")
    assert layers and all(isinstance(layer, GroupNorm2d) and layer.num_groups == 8 for layer in layers.values())


def test_a_folded_model_refuses_to_train():
    cfg, model = trained_model("SN")
    fold_norms(model)
    assert not any(parameter.requires_grad for parameter in model.parameters())
    model.train()
    with pytest.raises(FoldedModelError, match="folded for inference.*cannot train"):
        model(synthetic_batch())
    with pytest.raises(FoldedModelError, match="folded already"):
        fold_norms(model.eval())


def test_folded_and_unfolded_weights_do_not_mix(tmp_path):
    cfg, model = trained_model("FrozenBN")  # no layer of ours: only the fold's marker tells the files apart
    unfolded_state = {key: value.clone() for key, value in model.state_dict().items()}
    fold_norms(model)
    folded_file = tmp_path / "folded.pth"
    torch.save({"model": model.state_dict()}, folded_file)
    fresh = build_model(cfg)
    with pytest.raises(ValueError, match="folded for inference.*Load the trained, unfolded checkpoint"):
        CheckedCheckpointer(fresh).load(str(folded_file))
    with pytest.raises(RuntimeError, match="state dict is an unfolded model's: load the trained weights first"):
        model.load_state_dict(unfolded_state, strict=False)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    other = fold_norms(trained_model("FrozenBN")[1])
    other.load_state_dict(torch.load(buffer))  # a folded state dict into a folded model of the config: fine
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
