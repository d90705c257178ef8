"""The LazyConfigs of configs/lazy: ``LazyConfig.load`` + ``instantiate`` build the model they describe, our
layers with their options as plain arguments; each is the twin of a yaml config (the same state-dict keys
and shapes, the same optimizer settings and learning rate at every iteration); and
tools/lazyconfig_train_net.py trains one a step, with the batch average and the norm analysis, and
evaluates it; mixed precision off CUDA is refused, naming the key. The LSJ configs are detectron2's
large-scale-jitter recipe with our norms exactly where it has SyncBN, cropping to 1024 x 1024; their graphed
backbone is refused off CUDA, naming the key, and wraps the backbone without changing the state-dict keys."""

import json
import os
import subprocess
import sys

import pytest
import torch
from detectron2.config import LazyConfig, get_cfg, instantiate
from detectron2.data import DatasetCatalog
from detectron2.layers import NaiveSyncBatchNorm, ShapeSpec
from detectron2.model_zoo import get_config
from detectron2.modeling import build_model
from detectron2.solver import LRMultiplier, build_lr_scheduler
from torch import nn

from sn_detection import model_zoo
from sn_detection.d2 import add_sn_config, get_optimizer_params
from sn_detection.d2.graphed_backbone import GraphedBackbone
from sn_detection.d2.optimizer import GateClippingSGD
from sn_detection.data.datasets import register_shapes_datasets
from sn_detection.engine import lazy
from sn_detection.layers import NORM_CLASSES, NormFactory
from sn_detection.pretraining.config import add_pretrain_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAZY = model_zoo.LAZY_CONFIG_DIR
# LazyConfig -> (its yaml twin, the norm of its layers and their options)
TWINS = {
    "mask_rcnn_sn_2x.py": ("mask_rcnn_sn_2x", NormFactory("SN", eps=1e-5, momentum=0.1, use_bn=True)),
    "mask_rcnn_ssn_2x.py": ("mask_rcnn_ssn_2x", NormFactory("SSN", eps=1e-5, momentum=0.1, use_bn=True)),
    "mask_rcnn_dn_2x.py": (
        "mask_rcnn_dn_2x",
        NormFactory("DN", eps=1e-5, momentum=0.1, init_groups=32, init_batch_pool=False),
    ),
    "mask_rcnn_mgn_2x.py": ("mask_rcnn_mgn_2x", NormFactory("MGN", eps=1e-5, num_modes=2)),
    "demo_mask_rcnn_sn.py": ("demo_mask_rcnn_sn", NormFactory("SN", eps=1e-5, momentum=0.1, use_bn=True)),
}
# the LSJ configs -> the norm of their layers
LSJ = {
    "mask_rcnn_sn_lsj_100ep.py": NormFactory("SyncSN", eps=1e-5, momentum=0.1, use_bn=True),
    "mask_rcnn_gn_lsj_100ep.py": NormFactory("GN", num_groups=32, eps=1e-5),
}
LSJ_RECIPE = "new_baselines/mask_rcnn_R_50_FPN_100ep_LSJ.py"


def yaml_config(name):
    cfg = get_cfg()
    add_sn_config(cfg)
    add_pretrain_config(cfg)  # the SN demo's config sets the PRETRAIN keys of its backbone
    cfg.merge_from_file(os.path.join(model_zoo.CONFIG_DIR, f"{name}.yaml"))
    cfg.merge_from_list(["MODEL.DEVICE", "cpu"])
    return cfg


def yaml_twin(name):
    return build_model(yaml_config(name))


def learning_rates(scheduler, max_iter):
    """The learning rate of every iteration, as the trainers step it."""
    rates = []
    for _ in range(max_iter):
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.step()
    return rates


def settings(model):
    """What a model does beyond its parameters' shapes: input standardisation, frozen weights, anchors, the
    RPN's and the box head's sampling, proposals and test-time filtering."""
    rpn, heads = model.proposal_generator, model.roi_heads
    predictor = heads.box_predictor
    return {
        "pixels": (model.pixel_mean.flatten().tolist(), model.pixel_std.flatten().tolist(), model.input_format),
        "frozen": sorted(name for name, p in model.named_parameters() if not p.requires_grad),
        "anchors": [a.tolist() for a in rpn.anchor_generator.cell_anchors],
        "rpn": (rpn.batch_size_per_image, rpn.positive_fraction, rpn.pre_nms_topk, rpn.post_nms_topk, rpn.nms_thresh),
        "roi_heads": (heads.batch_size_per_image, heads.positive_fraction, heads.num_classes, heads.proposal_append_gt),
        "test": (predictor.test_score_thresh, predictor.test_nms_thresh, predictor.test_topk_per_image),
    }


@pytest.mark.parametrize("lazy", TWINS)
def test_the_lazy_model_is_its_yaml_twin(lazy):
    twin, factory = TWINS[lazy]
    cfg = LazyConfig.load(os.path.join(LAZY, lazy))
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    expected = factory(64)
    ours = [m for m in model.modules() if isinstance(m, NORM_CLASSES)]
    assert len(ours) > 30 and all(type(m) is type(expected) for m in ours)
    for layer in ours:
        for option, value in factory.options.items():
            assert getattr(layer, option) == value, option
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    expected_model = yaml_twin(twin)
    assert shapes == {key: value.shape for key, value in expected_model.state_dict().items()}
    assert settings(model) == settings(expected_model)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no training here
@pytest.mark.parametrize("lazy", TWINS)
def test_the_lazy_schedule_is_its_yaml_twin(lazy):
    """The same optimizer settings and the same learning rate at every iteration (warm-up, steps, length)."""
    cfg, twin = LazyConfig.load(os.path.join(LAZY, lazy)), yaml_config(TWINS[lazy][0])
    solver, optimizer = twin.SOLVER, cfg.optimizer
    assert cfg.train.max_iter == solver.MAX_ITER
    assert (optimizer.lr, optimizer.momentum, optimizer.weight_decay) == (
        solver.BASE_LR,
        solver.MOMENTUM,
        solver.WEIGHT_DECAY,
    )
    params = optimizer.params
    assert (params.weight_decay_norm, params.gate_lr_factor, params.gate_weight_decay) == (
        solver.WEIGHT_DECAY_NORM,
        solver.GATE_LR_FACTOR,
        solver.GATE_WEIGHT_DECAY,
    )
    # SSN's rules and radius: the arguments' defaults where a config does not set them, as the yaml's keys
    assert (params.get("ssn_gate_lr_factor", 0.1), params.get("ssn_gate_clip_norm", 1.0)) == (
        solver.SSN_GATE_LR_FACTOR,
        solver.SSN_GATE_CLIP_NORM,
    )
    assert tuple(cfg.train.get("ssn_radius", (0.0, 1.0))) == tuple(solver.SSN_RADIUS)
    if "ssn" in lazy:  # the optimizer whose step clips the SSN logits' gradients, as the yaml trainer's
        assert cfg.optimizer._target_ is GateClippingSGD
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optimizer.lr)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=solver.BASE_LR)
    lazy_rates = learning_rates(LRMultiplier(ours, instantiate(cfg.lr_multiplier), cfg.train.max_iter), solver.MAX_ITER)
    yaml_rates = learning_rates(build_lr_scheduler(twin, theirs), solver.MAX_ITER)
    assert lazy_rates == pytest.approx(yaml_rates, rel=1e-9)


def test_a_saved_lazy_config_builds_the_same_model(tmp_path):
    cfg = LazyConfig.load(os.path.join(LAZY, "mask_rcnn_sn_2x.py"))
    LazyConfig.save(cfg, str(tmp_path / "saved.yaml"))
    saved = LazyConfig.load(str(tmp_path / "saved.yaml"))
    first, second = instantiate(cfg.model), instantiate(saved.model)
    assert repr(first) == repr(second)
    assert first.state_dict().keys() == second.state_dict().keys()


def tiny_demo(output_dir):
    """configs/lazy/demo_mask_rcnn_sn.py shrunk in Python (16-wide FPN and heads, 64 px, two iterations,
    from scratch), as a user would, and saved as the file the tool reads."""
    cfg = LazyConfig.load(os.path.join(LAZY, "demo_mask_rcnn_sn.py"))
    cfg.model.backbone.out_channels = 16
    cfg.model.proposal_generator.head.in_channels = 16
    cfg.model.roi_heads.box_head.input_shape = ShapeSpec(channels=16, height=7, width=7)
    cfg.model.roi_heads.box_head.conv_dims = [16] * 4
    cfg.model.roi_heads.box_head.fc_dims = [32]
    cfg.model.roi_heads.box_predictor.input_shape = ShapeSpec(channels=32)
    cfg.model.roi_heads.mask_head.input_shape = ShapeSpec(channels=16, height=14, width=14)
    cfg.model.roi_heads.mask_head.conv_dims = [16] * 5
    cfg.dataloader.train.mapper.augmentations[0].short_edge_length = (64,)
    cfg.dataloader.train.mapper.augmentations[0].max_size = 107
    cfg.dataloader.train.num_workers = 0
    cfg.dataloader.test.mapper.augmentations[0].short_edge_length = 64
    cfg.dataloader.test.mapper.augmentations[0].max_size = 107
    cfg.dataloader.test.num_workers = 0
    cfg.train.max_iter = 2
    cfg.train.output_dir = str(output_dir)
    cfg.train.batch_average.num_batches = 2
    cfg.train.norm_analysis_period = 1
    path = output_dir / "tiny_demo.yaml"
    os.makedirs(output_dir, exist_ok=True)
    LazyConfig.save(cfg, str(path))
    return path


def test_the_tool_trains_with_the_hooks_and_evaluates(tmp_path):
    config = tiny_demo(tmp_path / "run")
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "lazyconfig_train_net.py"), "--config-file", str(config)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    output = tmp_path / "run"
    assert "Batch average: statistics of" in result.stdout + result.stderr
    with open(output / "eval_results.json") as f:
        results = json.load(f)["sn_shapes_val"]
    assert {"bbox", "segm"} <= set(results) and all(0 <= results[t]["AP"] <= 100 for t in ("bbox", "segm"))
    with open(output / "metrics.json") as f:
        logged = [json.loads(line) for line in f]
    assert any(key.startswith("norm/SN/box_head/") for row in logged for key in row)
    assert (output / "model_final.pth").is_file() and (output / "norm_evolution_SN.png").is_file()


def test_mixed_precision_off_cuda_is_refused_naming_the_key(tmp_path):
    register_shapes_datasets()
    cfg = LazyConfig.load(str(tiny_demo(tmp_path / "run")))
    cfg.train.device = "cpu"
    cfg.train.amp.enabled = True
    with pytest.raises(ValueError, match="train.amp.enabled=True needs the model on a CUDA device"):
        lazy.train(cfg, resume=False)


@pytest.mark.parametrize(
    "averaging, message",
    [
        (dict(enable=True, num_batches=2), r"train.batch_average has unknown keys \['enable'\]"),
        (dict(enabled=True, num_batches=0), r"train.batch_average.num_batches=0 is invalid: it must be an int >= 1"),
        (dict(enabled=True), r"train.batch_average.num_batches=None is invalid"),
    ],
    ids=["misspelt", "zero", "absent"],
)
def test_a_wrong_batch_average_is_refused_before_training(tmp_path, averaging, message):
    """A misspelt key turned the batch average off without a word; 0 batches failed after training."""
    cfg = LazyConfig.load(str(tiny_demo(tmp_path)))
    cfg.train.batch_average = averaging
    with pytest.raises(ValueError, match=message):
        lazy.train(cfg, resume=False)
    assert not list(tmp_path.glob("*.pth")) and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("lazy", LSJ)
def test_the_lsj_configs_are_detectrons_recipe_with_our_norms_where_it_has_syncbn(lazy):
    cfg, recipe = LazyConfig.load(os.path.join(LAZY, lazy)), get_config(LSJ_RECIPE)
    assert cfg.dataloader == recipe.dataloader and cfg.lr_multiplier == recipe.lr_multiplier
    assert all(cfg.train[key] == recipe.train[key] for key in recipe.train if key != "output_dir")
    assert (cfg.optimizer.lr, cfg.optimizer.momentum, cfg.optimizer.weight_decay) == (0.1, 0.9, 4e-5)
    assert cfg.optimizer.params._target_ is get_optimizer_params
    assert cfg.train.graphed_backbone == dict(enabled=True, max_graphs=1, warmup=3)
    torch.manual_seed(0)
    ours, theirs = instantiate(cfg.model), instantiate(recipe.model)
    assert settings(ours) == settings(theirs) and settings(ours)["frozen"] == []  # from scratch
    norms = {name: m for name, m in ours.named_modules() if isinstance(m, NORM_CLASSES)}
    synced = (nn.SyncBatchNorm, NaiveSyncBatchNorm)
    assert sorted(norms) == sorted(name for name, m in theirs.named_modules() if isinstance(m, synced))
    assert len(norms) > 60 and all(type(m) is type(LSJ[lazy](64)) for m in norms.values())
    for layer in norms.values():
        assert all(getattr(layer, option) == value for option, value in LSJ[lazy].options.items())
    # everything else has the recipe's tensors
    not_norm = lambda key: not key.startswith(tuple(name + "." for name in norms))  # noqa: E731
    assert {k: v.shape for k, v in ours.state_dict().items() if not_norm(k)} == {
        k: v.shape for k, v in theirs.state_dict().items() if not_norm(k)
    }


def test_the_lsj_crops_are_1024_square():
    register_shapes_datasets()
    cfg = LazyConfig.load(os.path.join(LAZY, "mask_rcnn_sn_lsj_100ep.py"))
    cfg.dataloader.train.mapper.instance_mask_format = "bitmask"  # the embedded dataset's masks are RLE
    mapper = instantiate(cfg.dataloader.train.mapper)
    torch.manual_seed(0)
    for record in DatasetCatalog.get("sn_shapes_train")[:4]:
        mapped = mapper(record)
        assert mapped["image"].shape == (3, 1024, 1024)
        assert mapped["instances"].image_size == (1024, 1024)


@pytest.mark.parametrize(
    "graphing, message",
    [
        (dict(enabled=True), r"train.graphed_backbone.enabled=True needs CUDA graphs, but train.device='cpu'"),
        (dict(enable=True), r"train.graphed_backbone has unknown keys \['enable'\]"),
    ],
    ids=["cpu", "misspelt"],
)
def test_a_graphed_backbone_that_cannot_run_is_refused_before_training(tmp_path, graphing, message):
    cfg = LazyConfig.load(str(tiny_demo(tmp_path)))
    cfg.train.graphed_backbone = graphing
    with pytest.raises(ValueError, match=message):
        lazy.train(cfg, resume=False)
    assert not list(tmp_path.glob("*.pth")) and not (tmp_path / "metrics.json").exists()


def test_the_graphed_backbone_keeps_the_models_keys(tmp_path):
    cfg = LazyConfig.load(str(tiny_demo(tmp_path)))
    cfg.train.graphed_backbone = dict(enabled=True, max_graphs=2)
    cfg.train.device = "cuda"  # the options are checked for a CUDA run; the model is built where it is
    options = lazy.graphed_backbone_options(cfg.train)
    assert options == dict(max_graphs=2)
    cfg.train.device = "cpu"
    torch.manual_seed(0)
    graphed = lazy.built_model(cfg, options)
    torch.manual_seed(0)
    eager = lazy.built_model(cfg, None)
    assert isinstance(graphed.backbone, GraphedBackbone) and graphed.backbone.max_graphs == 2
    assert graphed.state_dict().keys() == eager.state_dict().keys()
    cfg.train.graphed_backbone.max_graphs = 0
    cfg.train.device = "cuda"
    with pytest.raises(ValueError, match=r"train.graphed_backbone.max_graphs=0 is invalid: it must be an int >= 1"):
        lazy.graphed_backbone_options(cfg.train)
