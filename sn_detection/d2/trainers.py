"""The model in DDP (``ddp_model``) under detectron2's SimpleTrainer, or its AMPTrainer for mixed
precision (``step_trainer``), as every training path here needs them (tools/train_net.py's trainer, the
LazyConfig trainer, pretraining).

detectron2's ``create_ddp_model`` gives DDP the local rank as device id, which DDP rejects for a model
on the CPU: there it gets none. detectron2's AMPTrainer casts to float16 under CUDA's autocast only: it
fails at the first step on a machine without CUDA, and does not autocast a model on the CPU on a machine
with CUDA. So mixed precision for a model that is not on CUDA is refused, naming the config key.

The trainers give DDP ``broadcast_buffers=False``, as detectron2's do: BN, SN, DN, MN and BNSR then keep
running (and batch-averaged) statistics per process, while checkpoints hold the first process's. Each
process evaluates its share of the images, so before evaluating, ``share_first_process_buffers`` gives
every process the first one's buffers: the reported AP is that of the model saved, whatever the process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from detectron2.engine import AMPTrainer, SimpleTrainer, create_ddp_model
from detectron2.utils import comm


def ddp_model(model: torch.nn.Module, **ddp_options) -> torch.nn.Module:
    """``model`` in DistributedDataParallel with ``ddp_options`` when there are several processes."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    return create_ddp_model(model, **ddp_options, **({"device_ids": None} if on_cpu else {}))


def step_trainer(
    model: torch.nn.Module, data_loader, optimizer, amp: bool, amp_key: str, trainer_classes=None, **ddp_options
) -> SimpleTrainer:
    """The trainer of one step of ``ddp_model(model, **ddp_options)``, its ``model``: AMPTrainer if
    ``amp``, the value of the config key ``amp_key``, else SimpleTrainer; or the (float32, mixed precision)
    pair of their subclasses ``trainer_classes``."""
    device = next(model.parameters()).device
    if amp and device.type != "cuda":
        raise ValueError(
            f"{amp_key}=True needs the model on a CUDA device (detectron2's AMPTrainer autocasts on CUDA "
            f"only), but it is on {device}; set {amp_key} False to train in float32"
        )
    float32, mixed = trainer_classes or (SimpleTrainer, AMPTrainer)
    return (mixed if amp else float32)(ddp_model(model, **ddp_options), data_loader, optimizer)


def share_first_process_buffers(model: torch.nn.Module) -> None:
    """Every process gets the buffers of the first (module docstring); a collective, so all processes
    call it."""
    if comm.get_world_size() > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
