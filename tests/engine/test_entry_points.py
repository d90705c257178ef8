"""Every detectron2 entry point builds the model the config describes.

A model trained one step with our trainer, with one norm in all four norm keys and every option of that
norm (and SOLVER.GATE_*) at a non-default value, is rebuilt by detectron2's ``DefaultPredictor(cfg)`` and
by ``detectron2.modeling.build_model(cfg)`` + ``DetectionCheckpointer``: the same layers with the same
options, every tensor of the checkpoint loaded (nothing missing, unexpected or skipped), the trained
state, and the trained model's outputs. (That a path which does not see the options cannot build our
layers with others: tests/d2/test_meta_arch.py.)"""

import copy

import pytest
import torch
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.data import DatasetCatalog
from detectron2.data.detection_utils import read_image
from detectron2.engine import DefaultPredictor, DefaultTrainer
from detectron2.modeling import build_model
from shrunk_training import shrunk_cfg

from sn_detection import d2
from sn_detection.engine import Trainer
from sn_detection.layers import NORM_CLASSES, gate_parameter_names, norm_options

NORM_KEYS = ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.ROI_BOX_HEAD.NORM", "MODEL.ROI_MASK_HEAD.NORM")
# every option at a value other than add_sn_config's default (group counts divide the shrunk model's widths)
NON_DEFAULT = {
    "eps": ("MODEL.SN.EPS", 1e-3),
    "momentum": ("MODEL.SN.MOMENTUM", 0.3),
    "use_bn": ("MODEL.SN.USE_BN", False),
    "num_groups": ("MODEL.SN.GN_GROUPS", 4),
    "num_modes": ("MODEL.SN.NUM_MODES", 3),
    "p": ("MODEL.SN.BNSR_P", 1.05),
    "init_groups": ("MODEL.SN.DN_INIT_GROUPS", 4),
    "init_batch_pool": ("MODEL.SN.DN_INIT_BATCH_POOL", True),
}
GATE_OPTIONS = ["SOLVER.GATE_WEIGHT_DECAY", "1e-3", "SOLVER.GATE_LR_FACTOR", "3.0"]
# each norm with all its options changed; SN also with its BN branch, so that momentum matters
CASES = [(name, {}) for name in ("SN", "SyncSN", "DN", "GN", "MGN", "MN", "BNSR", "PONO")] + [("SN", {"use_bn": True})]


def case_cfg(output_dir, norm, keep):
    options = {option: value for option, (_, value) in NON_DEFAULT.items() if option in norm_options(norm)}
    options.update(keep)
    opts = [item for key in NORM_KEYS for item in (key, norm)]
    for option, value in options.items():
        opts += [NON_DEFAULT[option][0], str(value)]
    opts += [
        *GATE_OPTIONS,
        "SOLVER.MAX_ITER",
        "1",
        "SEED",
        "1",
        "TEST.BATCH_AVERAGE.ENABLED",
        "True",
        "TEST.BATCH_AVERAGE.NUM_BATCHES",
        "1",
    ]
    return shrunk_cfg(output_dir, *opts), options


def assert_options(model, norm, options):
    layers = [m for m in model.modules() if isinstance(m, NORM_CLASSES)]
    assert len(layers) > 20, "the norm is in the backbone, FPN and both heads"
    for layer in layers:
        for option, value in options.items():
            assert getattr(layer, option) == value, (type(layer).__name__, option)


class RecordingCheckpointer(DetectionCheckpointer):
    """detectron2's checkpointer, keeping what did not load (missing, unexpected, other shape)."""

    def _load_model(self, checkpoint):
        self.incompatible = super()._load_model(checkpoint)
        return self.incompatible


def predictions(predictor, model, image):
    """DefaultPredictor's output for ``image`` with ``model`` (its preprocessing, its evaluation mode)."""
    shell = copy.copy(predictor)
    shell.model = model.eval()
    return shell(image)["instances"]


def assert_same_predictions(actual, expected):
    assert len(expected) > 0
    for field in ("pred_boxes", "scores", "pred_classes", "pred_masks"):
        a, e = actual.get(field), expected.get(field)
        a, e = getattr(a, "tensor", a), getattr(e, "tensor", e)
        assert torch.equal(a, e), field


@pytest.mark.parametrize("norm, keep", CASES, ids=[f"{n}{'-bn' if k else ''}" for n, k in CASES])
def test_predictor_and_build_model_rebuild_the_trained_model(tmp_path, norm, keep):
    cfg, options = case_cfg(tmp_path / "output", norm, keep)
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=False)
    trainer.train()
    trained = trainer.model
    assert_options(trained, norm, options)
    weights = str(tmp_path / "output" / "model_final.pth")
    image = read_image(DatasetCatalog.get("sn_shapes_val")[0]["file_name"], format=cfg.INPUT.FORMAT)

    predict_cfg = cfg.clone()
    predict_cfg.MODEL.WEIGHTS = weights
    predictor = DefaultPredictor(predict_cfg)
    assert_options(predictor.model, norm, options)
    loaded = predictor.model.state_dict()
    assert loaded.keys() == trained.state_dict().keys()
    assert all(torch.equal(value, loaded[key]) for key, value in trained.state_dict().items())
    expected = predictions(predictor, trained, image)
    assert_same_predictions(predictor(image)["instances"], expected)

    rebuilt = build_model(predict_cfg)
    checkpointer = RecordingCheckpointer(rebuilt)
    checkpointer.load(weights)
    incompatible = checkpointer.incompatible
    assert not (incompatible.missing_keys or incompatible.unexpected_keys or incompatible.incorrect_shapes)
    assert_options(rebuilt, norm, options)
    assert_same_predictions(predictions(predictor, rebuilt, image), expected)


def test_detectron2s_default_trainer_builds_the_same_model(tmp_path):
    cfg, options = case_cfg(tmp_path, "MGN", {})
    assert_options(DefaultTrainer.build_model(cfg), "MGN", options)


def test_detectron2s_default_trainer_takes_our_optimizer_as_the_readme_says(tmp_path):
    class OurOptimizerTrainer(DefaultTrainer):
        build_optimizer = staticmethod(d2.build_optimizer)

    cfg, _ = case_cfg(tmp_path, "MGN", {})
    trainer = OurOptimizerTrainer(cfg)
    # the lr before the warm-up's factor, which the scheduler already applies
    lr_of = {param: group["initial_lr"] for group in trainer.optimizer.param_groups for param in group["params"]}
    gates = [
        m.get_parameter(name)
        for m in trainer.model.modules()
        if isinstance(m, NORM_CLASSES)
        for name in gate_parameter_names(m)
    ]
    assert gates and all(lr_of[gate] == pytest.approx(cfg.SOLVER.BASE_LR * 3.0) for gate in gates)  # GATE_LR_FACTOR
