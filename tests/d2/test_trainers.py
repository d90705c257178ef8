"""The trainer of one step that every training path uses: SimpleTrainer, AMPTrainer only for a model on
CUDA (anything else refused, naming the key), and DDP that works for a model on the CPU in several
processes (detectron2's create_ddp_model alone would give it a device id)."""

import itertools

import pytest
import torch
from detectron2.engine import AMPTrainer, SimpleTrainer
from detectron2.utils.events import EventStorage
from gloo_processes import run_processes
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sn_detection.d2 import step_trainer


class Regression(nn.Module):
    """A model in detectron2's trainer convention: a batch in, a dict of losses out."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, batch):
        inputs, targets = batch
        return {"loss": ((self.linear(inputs) - targets) ** 2).mean()}


def one_step(model, batch, amp=False):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = step_trainer(model, itertools.repeat(batch), optimizer, amp, "SOLVER.AMP.ENABLED")
    with EventStorage():
        trainer.run_step()
    return trainer


def test_without_amp_one_process_trains_the_model_itself():
    torch.manual_seed(0)
    model = Regression()
    before = model.linear.weight.detach().clone()
    trainer = one_step(model, (torch.randn(4, 3), torch.randn(4, 1)))
    assert type(trainer) is SimpleTrainer and trainer.model is model
    assert not torch.equal(model.linear.weight, before)


def test_amp_for_a_model_off_cuda_is_refused_naming_the_key():
    with pytest.raises(
        ValueError,
        match=r"PRETRAIN.AMP=True needs the model on a CUDA device .* it is on cpu; "
        r"set PRETRAIN.AMP False",
    ):
        step_trainer(Regression(), None, None, True, "PRETRAIN.AMP")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_amp_for_a_model_on_cuda_trains_in_mixed_precision():
    model = Regression().cuda()
    trainer = one_step(model, (torch.randn(4, 3, device="cuda"), torch.randn(4, 1, device="cuda")), amp=True)
    assert isinstance(trainer, AMPTrainer) and trainer.model is model


def _batch_of(rank):
    generator = torch.Generator().manual_seed(rank)  # each process its own data
    return torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)


def _step_in_process(rank):
    torch.manual_seed(0)  # the same initial model in every process
    model = Regression()
    trainer = one_step(model, _batch_of(rank))
    assert isinstance(trainer.model, DistributedDataParallel) and trainer.model.module is model
    # DDP averages the gradients: the step of one process on both processes' batches together
    torch.manual_seed(0)
    alone = Regression()
    alone(tuple(torch.cat(parts) for parts in zip(_batch_of(0), _batch_of(1))))["loss"].backward()
    torch.optim.SGD(alone.parameters(), lr=0.1).step()
    for name, parameter in alone.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), parameter, rtol=1e-6, atol=1e-7, msg=name)


def test_several_processes_on_the_cpu_train_one_model_in_ddp():
    run_processes(_step_in_process, (), nprocs=2)
