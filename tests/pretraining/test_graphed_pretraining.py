"""PRETRAIN.CUDA_GRAPH where it cannot apply, on the CPU: refused with the key and the way out, by the config
validation (MODEL.DEVICE not cuda), by the graphed trainers (a model off CUDA, several processes) and by the
benchmark's --cuda-graph; its backbones share the eager ones' cache entries; and the premise of its fixed
shapes: pretraining's loader gives full batches only, past the end of the training set too. (On CUDA:
test_graphed_pretraining_cuda.py.)"""

import itertools
import re

import pytest
import torch
from detectron2.config import get_cfg
from gloo_processes import run_processes
from tiny_pretraining import CONFIG, tiny_cfg
from torch import nn

from sn_detection.benchmarks import pretrain as benchmark_pretrain
from sn_detection.d2 import step_trainer
from sn_detection.pretraining.cache import cache_key
from sn_detection.pretraining.config import add_pretrain_config, validate_pretrain_config
from sn_detection.pretraining.graphed_step import GraphedAMPTrainer, GraphedTrainer
from sn_detection.pretraining.train import _splits, pretrain, train_loader

GRAPHED = (GraphedTrainer, GraphedAMPTrainer)
OFF_CUDA = (
    "PRETRAIN.CUDA_GRAPH=True captures the training step in a CUDA graph, which needs MODEL.DEVICE cuda, but it is"
)


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, batch):
        inputs, targets = batch
        return {"loss": ((self.linear(inputs) - targets) ** 2).mean()}


def test_the_key_is_off_by_default_and_needs_a_cuda_device():
    cfg = get_cfg()
    add_pretrain_config(cfg)
    assert cfg.PRETRAIN.CUDA_GRAPH is False
    cfg.PRETRAIN.CUDA_GRAPH = True
    for device in ("cpu", "meta"):
        cfg.MODEL.DEVICE = device
        with pytest.raises(ValueError, match=re.escape(f"{OFF_CUDA} {device!r}; set PRETRAIN.CUDA_GRAPH False")):
            validate_pretrain_config(cfg)
    for device in ("cuda", "cuda:1"):  # validated without a GPU: the device is the run's business
        cfg.MODEL.DEVICE = device
        validate_pretrain_config(cfg)


def test_a_value_that_is_not_a_boolean_is_refused_by_the_merge():
    cfg = get_cfg()
    add_pretrain_config(cfg)
    with pytest.raises(ValueError, match=r"Type mismatch .* for config key: PRETRAIN.CUDA_GRAPH"):
        cfg.merge_from_list(["PRETRAIN.CUDA_GRAPH", "1"])


def test_pretraining_on_the_cpu_is_refused_before_training(tiny_classification_set, tmp_path):
    cfg = tiny_cfg(tiny_classification_set, tmp_path / "out", "PRETRAIN.CUDA_GRAPH", "True", "MODEL.DEVICE", "cpu")
    with pytest.raises(ValueError, match=re.escape(OFF_CUDA)):
        pretrain(cfg)
    assert not any((tmp_path / "out").glob("*.pth"))


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_the_graphed_trainers_refuse_a_model_off_cuda(amp):
    optimizer = torch.optim.SGD(Regression().parameters(), lr=0.1)
    trainer_class = GRAPHED[amp]
    with pytest.raises(
        ValueError,
        match=r"PRETRAIN.CUDA_GRAPH=True captures the step in a CUDA graph, but the model "
        r"is on cpu; set MODEL.DEVICE cuda or PRETRAIN.CUDA_GRAPH False",
    ):
        trainer_class(Regression(), None, optimizer)


def _graphed_trainer_in_process(rank):
    model = Regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"PRETRAIN.CUDA_GRAPH=True trains in one process, but there are 2: DDP in a "
        r"CUDA graph needs .*; set PRETRAIN.CUDA_GRAPH False to train with several "
        r"processes",
    ):
        step_trainer(model, None, optimizer, False, "PRETRAIN.AMP", trainer_classes=GRAPHED)


def test_several_processes_are_refused():
    run_processes(_graphed_trainer_in_process, (), nprocs=2)


def test_the_benchmarks_graphed_rows_need_a_cuda_device():
    with pytest.raises(ValueError, match=re.escape(f"{OFF_CUDA} 'cpu'")):
        benchmark_pretrain.main(["--config-file", CONFIG, "--cuda-graph", "--norms", "BN", "MODEL.DEVICE", "cpu"])


def test_a_graphed_backbone_has_the_eager_ones_cache_entry(tiny_classification_set, tmp_path):
    """The same training to float32 rounding; and the key of every backbone cached before the option
    existed is unchanged."""
    eager = cache_key(tiny_cfg(tiny_classification_set, tmp_path, "MODEL.DEVICE", "cuda"))
    assert "CUDA_GRAPH" not in eager["pretrain"]
    graphed = tiny_cfg(tiny_classification_set, tmp_path, "MODEL.DEVICE", "cuda", "PRETRAIN.CUDA_GRAPH", "True")
    assert cache_key(graphed) == eager


def test_the_training_loader_gives_full_batches_only(tiny_classification_set, tmp_path):
    """Its stream of samples is infinite (data.SeededStream): no epoch ends in a partial batch, so a graph
    captured for one batch shape fits every batch. 72 images in batches of 5, for three passes."""
    cfg = tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.IMS_PER_BATCH", "5")
    _, images, _ = _splits(cfg)
    assert len(images) % 5
    batches = iter(train_loader(cfg, images, start_iter=7))
    shapes = {(tuple(pixels.shape), tuple(labels.shape)) for pixels, labels in itertools.islice(batches, 3 * 72 // 5)}
    assert shapes == {((5, 3, 32, 32), (5,))}
