"""Weights given to a model (MODEL.WEIGHTS) that cannot be what the user meant fail with a message
naming the file and the problem; weights that fit in part load as detectron2 loads them; a run resumes
only from a checkpoint of its very model, and not past its last iteration."""

import pickle
import re

import pytest
import torch
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.modeling import build_model
from tiny_rcnn import tiny_cfg

from sn_detection.d2 import CheckedCheckpointer
from sn_detection.d2.checkpointer import check_resumed_iteration


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_model(tiny_cfg("SN", "c4"))


def load(model, path):
    CheckedCheckpointer(model).load(str(path))


def test_a_missing_file(model, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"checkpoint {tmp_path / 'absent.pth'} does not exist"):
        load(model, tmp_path / "absent.pth")


@pytest.mark.parametrize(
    "name, content",
    [("garbage.pth", bytes(range(256)) * 8), ("garbage.pkl", bytes(range(256)) * 8), ("empty.pth", b"")],
)
def test_a_file_that_is_no_checkpoint(model, tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=f"{tmp_path / name} is not a checkpoint: (UnpicklingError|EOFError)"):
        load(model, tmp_path / name)


def test_a_pickle_of_something_else(model, tmp_path):
    path = tmp_path / "list.pkl"
    path.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match=f"{path} is not a checkpoint"):
        load(model, path)


def test_the_training_checkpoint_of_another_code_base(model, tmp_path):
    """The SN authors' ImageNet checkpoints hold {"state_dict": ..., "epoch": ...}."""
    path = tmp_path / "resnet50_sn.pth"
    torch.save({"state_dict": {"module.conv1.weight": torch.zeros(64, 3, 7, 7)}, "epoch": 100}, path)
    with pytest.raises(ValueError) as error:
        load(model, path)
    message = str(error.value)
    assert f"{path} holds no model weights" in message and "'state_dict' is a dict, not a tensor" in message
    assert "tools/convert_pretrained.py" in message


def test_weights_that_fit_no_key_of_the_model(model, tmp_path):
    """An unconverted torchvision ResNet: none of its names is a detectron2 name."""
    path = tmp_path / "resnet50.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7), "bn1.running_mean": torch.zeros(64)}, path)
    with pytest.raises(ValueError) as error:
        load(model, path)
    message = str(error.value)
    assert message.startswith(f"no tensor of {path} fits the model: 2 keys the model does not have")
    assert "conv1.weight" in message and "tools/convert_pretrained.py" in message


def test_weights_of_another_shape_everywhere(model, tmp_path):
    path = tmp_path / "other_widths.pth"
    torch.save({key: torch.zeros(1, *value.shape) for key, value in model.state_dict().items()}, path)
    with pytest.raises(ValueError, match=f"no tensor of {path} fits the model: .* of another shape"):
        load(model, path)


def test_weights_that_fit_in_part_load_as_in_detectron2(model, tmp_path):
    """E.g. a backbone without heads, or heads for another number of classes: detectron2 warns."""
    source = build_model(tiny_cfg("SN", "c4"))
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(1.0)
    state = {key: value for key, value in source.state_dict().items() if key.startswith("backbone.")}
    state["roi_heads.box_predictor.cls_score.weight"] = torch.zeros(2, 2)  # another shape
    path = tmp_path / "backbone.pth"
    torch.save({"model": state}, path)
    load(model, path)
    for key, value in model.state_dict().items():
        if key.startswith("backbone."):
            torch.testing.assert_close(value, state[key], msg=key)


def test_a_run_resumes_only_from_a_checkpoint_of_its_model(model, tmp_path):
    CheckedCheckpointer(model, str(tmp_path)).save("model_0000001", iteration=1)
    other = build_model(tiny_cfg("BN", "c4"))  # the norm changed: SN's gate logits and identities are absent
    with pytest.raises(
        ValueError,
        match=rf"cannot resume from {tmp_path / 'model_0000001.pth'}: it is not a "
        r"checkpoint of this model: \d+ keys the model does not have .* Resume with "
        r"the config that made it",
    ):
        CheckedCheckpointer(other, str(tmp_path)).resume_or_load("", resume=True)
    CheckedCheckpointer(other, str(tmp_path)).load(str(tmp_path / "model_0000001.pth"))  # as weights: in part
    (tmp_path / "bn").mkdir()
    CheckedCheckpointer(other, str(tmp_path / "bn")).save("model_0000001", iteration=1)
    with pytest.raises(ValueError, match=r"it is not a checkpoint of this model: \d+ keys of the model it lacks"):
        CheckedCheckpointer(build_model(tiny_cfg("SN", "c4")), str(tmp_path / "bn")).resume_or_load("", resume=True)
    same = build_model(tiny_cfg("SN", "c4"))
    assert CheckedCheckpointer(same, str(tmp_path)).resume_or_load("", resume=True)["iteration"] == 1
    for key, value in same.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], msg=key)


def test_a_run_does_not_resume_past_its_last_iteration():
    check_resumed_iteration(5, 5, "SOLVER.MAX_ITER", "out")  # a finished run: nothing left to train
    with pytest.raises(
        ValueError,
        match=r"the last checkpoint in out is at iteration 5, past SOLVER.MAX_ITER=3: "
        r"raise SOLVER.MAX_ITER",
    ):
        check_resumed_iteration(6, 3, "SOLVER.MAX_ITER", "out")


def test_evaluation_needs_every_trained_tensor(model, tmp_path):
    with pytest.raises(ValueError, match="there are no weights to evaluate: MODEL.WEIGHTS is empty"):
        CheckedCheckpointer(model).evaluate_from("", "MODEL.WEIGHTS")
    full = tmp_path / "model_final.pth"
    torch.save({"model": model.state_dict()}, full)
    backbone = tmp_path / "backbone.pth"  # weights that finetuning loads in part
    torch.save({"model": {k: v for k, v in model.state_dict().items() if k.startswith("backbone.")}}, backbone)
    other = build_model(tiny_cfg("SN", "c4"))
    with pytest.raises(
        ValueError,
        match=rf"cannot evaluate {backbone}: it is not a checkpoint of this model: "
        r"\d+ keys of the model it lacks \(e.g. proposal_generator",
    ):
        CheckedCheckpointer(other).evaluate_from(str(backbone), "MODEL.WEIGHTS")
    CheckedCheckpointer(other).evaluate_from(str(full), "MODEL.WEIGHTS")
    for key, value in other.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], msg=key)


def test_a_frozen_bn_checkpoint_does_not_resume_a_bn_model(tmp_path):
    """FrozenBN's and BN's keys differ only by BN's training counter: on resume, its absence is another norm."""
    frozen = build_model(tiny_cfg("FrozenBN", "c4"))
    CheckedCheckpointer(frozen, str(tmp_path)).save("model_0000001", iteration=1)
    with pytest.raises(
        ValueError,
        match=r"it is not a checkpoint of this model: \d+ keys of the model it lacks "
        r"\(e.g. backbone.*num_batches_tracked",
    ):
        CheckedCheckpointer(build_model(tiny_cfg("BN", "c4")), str(tmp_path)).resume_or_load("", resume=True)


def test_what_is_no_weight_of_the_model_does_not_count(model, tmp_path):
    """pixel_mean / pixel_std, which the model does not save (other detectron2 versions did), and when
    evaluating, BatchNorm's counter, which a FrozenBN model lacks."""
    state = dict(model.state_dict(), pixel_mean=torch.zeros(3, 1, 1), pixel_std=torch.ones(3, 1, 1))
    torch.save({"model": state}, tmp_path / "with_pixel_statistics.pth")
    CheckedCheckpointer(model).evaluate_from(str(tmp_path / "with_pixel_statistics.pth"), "MODEL.WEIGHTS")
    bn = build_model(tiny_cfg("BN", "c4"))
    torch.save({"model": bn.state_dict()}, tmp_path / "bn.pth")
    CheckedCheckpointer(build_model(tiny_cfg("FrozenBN", "c4"))).evaluate_from(
        str(tmp_path / "bn.pth"), "MODEL.WEIGHTS"
    )


def test_a_tensor_of_another_shape_is_named_once(model, tmp_path):
    state = dict(model.state_dict())
    state["roi_heads.box_predictor.cls_score.weight"] = torch.zeros(2, 2)
    torch.save({"model": state}, tmp_path / "other_classes.pth")
    with pytest.raises(
        ValueError,
        match=r"it is not a checkpoint of this model: 1 of another shape \(e.g. "
        r"roi_heads.box_predictor.cls_score.weight .*To evaluate a training run, "
        r"give its checkpoint",
    ):
        CheckedCheckpointer(model).evaluate_from(str(tmp_path / "other_classes.pth"), "MODEL.WEIGHTS")


@pytest.mark.parametrize(
    "saved, loaded, ours, theirs",
    [
        (("GN",), ("PONO",), "PositionalNorm2d(eps=1e-05)", "GroupNorm2d(eps=1e-05, num_groups=8)"),
        (
            ("GN",),
            ("GN", "MODEL.SN.GN_GROUPS", 4),
            "GroupNorm2d(eps=1e-05, num_groups=4)",
            "GroupNorm2d(eps=1e-05, num_groups=8)",
        ),
        (
            ("SN",),
            ("SN", "MODEL.SN.EPS", 1e-3),
            "SwitchableNorm2d(eps=0.001, use_bn=True)",
            "SwitchableNorm2d(eps=1e-05, use_bn=True)",
        ),
    ],
    ids=["GN-into-PONO", "GN-groups", "SN-eps"],
)
def test_weights_of_another_norm_or_options_are_refused_on_every_load(tmp_path, saved, loaded, ours, theirs):
    """Tensors alike in name and shape (GN's and PONO's weight and bias; an option without a shape) would
    load silently: each layer's saved identity refuses them, through detectron2's own loader too."""
    CheckedCheckpointer(build_model(tiny_cfg(saved[0], "c4", *saved[1:])), str(tmp_path)).save("model_final")
    path = str(tmp_path / "model_final.pth")
    mismatch = (
        rf"roi_heads\.res5\.0\.conv1\.norm is {re.escape(ours)}, but the state dict was saved by {re.escape(theirs)}"
    )
    model = build_model(tiny_cfg(loaded[0], "c4", *loaded[1:]))
    with pytest.raises(ValueError, match=rf"cannot load weights from {path}: (.|\n)*{mismatch}"):
        CheckedCheckpointer(model).load(path)
    with pytest.raises(
        ValueError, match=rf"cannot evaluate {path}: it is not a checkpoint of this model: (.|\n)*{mismatch}"
    ):
        CheckedCheckpointer(model).evaluate_from(path, "MODEL.WEIGHTS")
    with pytest.raises(RuntimeError, match=mismatch):  # DefaultPredictor's loader
        DetectionCheckpointer(model).load(path)


def test_weights_without_identities_are_not_evaluated_by_a_model_with_them(tmp_path):
    """BatchNorm's tensors are all BNSR's: only the identity tells them apart. Weights without identities
    load as initial weights (converted ones have none), but are neither evaluated nor resumed from."""
    CheckedCheckpointer(build_model(tiny_cfg("BN", "c4")), str(tmp_path)).save("model_final")
    path = str(tmp_path / "model_final.pth")
    bnsr = build_model(tiny_cfg("BNSR", "c4"))
    CheckedCheckpointer(bnsr).load(path)
    with pytest.raises(
        ValueError,
        match=rf"cannot evaluate {path}: it is not a checkpoint of this model: \d+ keys of "
        r"the model it lacks \(e\.g\. [\w.]+norm\._extra_state",
    ):
        CheckedCheckpointer(bnsr).evaluate_from(path, "MODEL.WEIGHTS")
