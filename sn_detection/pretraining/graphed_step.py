"""``GraphedTrainer`` and ``GraphedAMPTrainer``: detectron2's SimpleTrainer and AMPTrainer whose training step
-- forward, backward and optimizer step -- is captured once in a CUDA graph and replayed at every later
iteration (PRETRAIN.CUDA_GRAPH).

On a GPU a step of a network of many small layers waits for the host, which launches its kernels one by
one; a replay launches the whole recorded step at once, so the host's cost per layer disappears. A graph
replays fixed work on fixed memory, whence the rules:

- warm-up: the first ``WARMUP_STEPS`` steps of a run (a resumed one too), and more until the optimizer has
  made a step (mixed precision skips those with non-finite gradients), are the base trainer's own eager
  steps, on the side stream that then captures: they compile the kernels and make the optimizer's momentum
  buffers and the libraries' handles for that stream, which a capture cannot. The next step is captured
  (a capture records, it runs nothing) and replayed, and so is every later one.
- the batch: copied into tensors made at capture. A batch of other shapes or dtypes is refused
  (pretraining's loader gives full batches only: its stream of samples is infinite).
- the learning rate: ``graph_sgd.DeviceLRSGD``, torch's fused SGD reading each group's rate from a device
  tensor set before each replay from the optimizer that the schedule moves. That optimizer keeps its state
  (the momentum buffers are shared), so the checkpoints are those of eager training and either resumes the
  other; the fused update rounds in another order than the foreach one, so the losses agree with eager
  training to float32 rounding, not bit for bit.
- mixed precision: autocast inside the capture (its weight-cast cache off, as for any graphed callable),
  and GradScaler with the fused step, which unscales, skips a step with non-finite gradients and updates
  the scale on the device; the eager AMPTrainer reads the found-inf flag on the host before stepping, which
  a capture cannot.
- the losses: the loss dict that the trainer logs holds the captured step's static losses, read after the
  replay by detectron2's ``write_metrics``, which waits for the device once per step as in eager training.
  It raises FloatingPointError for a non-finite loss as eager training does, but after that step's update,
  which is part of the replay (the checkpointer refuses to save non-finite weights).
- hooks run eagerly between replays (schedule, evaluation, batch average, checkpoints): they must keep the
  storage of the parameters, buffers and momentum buffers and the optimizer's other hyperparameters, all
  of which are checked before each replay, and leave the model in training mode; a hook that acts between
  the backward and the optimizer step (``after_backward``) cannot, and is refused.
- one process: DDP under a graph needs its own construction on the capturing stream, eleven eager
  iterations, NCCL's asynchronous error handling off before the process group starts and every rank
  capturing alike (torch's CUDA-graph notes); ``launch`` and ``step_trainer`` do none of that, so several
  processes are refused, and so is a model off CUDA.
"""

from __future__ import annotations

import time

import torch
from detectron2.engine import AMPTrainer, HookBase, SimpleTrainer
from detectron2.utils import comm

from ..d2.optimizer import clip_gate_gradients
from .graph_sgd import DeviceLRSGD, has_stepped

WARMUP_STEPS = 3  # eager steps before the capture, as in torch's whole-network example
KEY = "PRETRAIN.CUDA_GRAPH"


class GraphedSteps:
    """The graphed step over a detectron2 trainer class (module docstring): the subclass's
    ``_captured_step(batch)`` is what is captured."""

    def __init__(self, model: torch.nn.Module, data_loader, optimizer, *args, **kwargs):
        if comm.get_world_size() > 1:
            raise ValueError(
                f"{KEY}=True trains in one process, but there are {comm.get_world_size()}: DDP in a CUDA graph needs "
                "NCCL's asynchronous error handling off before the processes start, DDP built on the capturing "
                f"stream and 11 eager iterations, which this launch does not arrange; set {KEY} False to train "
                "with several processes"
            )
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(
                f"{KEY}=True captures the step in a CUDA graph, but the model is on {device}; set MODEL.DEVICE cuda "
                f"or {KEY} False"
            )
        super().__init__(model, data_loader, optimizer, *args, **kwargs)
        if getattr(self, "async_write_metrics", False):
            raise ValueError(
                f"{KEY}=True logs the losses of the replayed step before the next replay overwrites them: "
                "async_write_metrics cannot apply"
            )
        self._stream = torch.cuda.Stream(device)
        self._eager_steps_left = WARMUP_STEPS
        self._graph = None

    @property
    def captured(self) -> bool:
        """Whether the step is captured: the steps from now on are replays."""
        return self._graph is not None

    def register_hooks(self, hooks) -> None:
        hooks = [hook for hook in hooks if hook is not None]
        acting = [type(h).__name__ for h in hooks if type(h).after_backward is not HookBase.after_backward]
        if acting:
            raise ValueError(
                f"{KEY}=True replays the backward and the optimizer step at once: hooks that act between them "
                f"(after_backward) cannot run; got {', '.join(acting)}"
            )
        super().register_hooks(hooks)

    def run_step(self):
        if self._graph is None and (self._eager_steps_left or not has_stepped(self.optimizer)):
            self._eager_steps_left = max(self._eager_steps_left - 1, 0)
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                super().run_step()
            torch.cuda.current_stream().wait_stream(self._stream)
            return
        assert self.model.training, "[GraphedTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        batch = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        if self._graph is None:
            self._capture(batch)
        self._check_unchanged()
        for static, tensor in zip(self._static_batch, self._checked(batch)):
            static.copy_(tensor)
        self._sgd.load_lrs()
        self._graph.replay()
        self._write_metrics(self._loss_dict, data_time)

    def _capture(self, batch) -> None:
        device = next(self.model.parameters()).device
        self._static_batch = tuple(t.to(device, copy=True) for t in self._checked(batch))
        self._sgd = DeviceLRSGD(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)  # the gradients are made by the captured backward, in its memory
        self._stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream):
            self._loss_dict = self._captured_step(self._static_batch)
        torch.cuda.current_stream().wait_stream(self._stream)
        self._graph = graph
        self._captured_tensors = [*self.model.parameters(), *self.model.buffers()]
        self._storage = [t.data_ptr() for t in self._captured_tensors]

    def _checked(self, batch) -> tuple:
        """``batch`` as a tuple of tensors of the shapes and dtypes the graph was captured with."""
        if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
            raise ValueError(
                f"{KEY}=True copies each batch into the captured one: it must be a tuple of tensors, got "
                f"{type(batch).__name__}"
            )
        if self._graph is not None:
            got = [(tuple(t.shape), t.dtype) for t in batch]
            captured = [(tuple(t.shape), t.dtype) for t in self._static_batch]
            if got != captured:
                raise ValueError(
                    f"{KEY}=True replays the step captured for batches of (shape, dtype) {captured}, but got {got}: "
                    "every batch must have the same shapes"
                )
        return tuple(batch)

    def _check_unchanged(self) -> None:
        """The captured step reads and writes the storage it was captured with: refuse a hook's change to the
        storage of the parameters and buffers it captured (walking the modules for replaced tensors would cost
        the host many times more, at every step) and to the optimizer's (``DeviceLRSGD.check_unchanged``)."""
        if [t.data_ptr() for t in self._captured_tensors] != self._storage:
            raise RuntimeError(
                f"{KEY}=True: the model's parameters or buffers were given new storage after the step was captured "
                "(a hook that assigns .data rather than copying into it, say): the captured step would train the "
                "old one"
            )
        self._sgd.check_unchanged()


def _as_loss_dict(losses) -> dict:
    return {"total_loss": losses} if isinstance(losses, torch.Tensor) else losses


class GraphedTrainer(GraphedSteps, SimpleTrainer):
    """SimpleTrainer whose step is captured and replayed (module docstring)."""

    def _captured_step(self, batch) -> dict:
        loss_dict = _as_loss_dict(self.model(batch))
        sum(loss_dict.values()).backward()
        clip_gate_gradients(self.optimizer)
        self._sgd.optimizer.step()
        return loss_dict


class GraphedAMPTrainer(GraphedSteps, AMPTrainer):
    """AMPTrainer whose step is captured and replayed, with GradScaler's work on the device (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.log_grad_scaler:
            raise ValueError(
                f"{KEY}=True: log_grad_scaler reads the scale between the backward and the optimizer step, both of "
                "which the replay runs at once"
            )

    def _captured_step(self, batch) -> dict:
        with torch.autocast("cuda", dtype=self.precision, cache_enabled=False):
            loss_dict = _as_loss_dict(self.model(batch))
            losses = sum(loss_dict.values())
        self.grad_scaler.scale(losses).backward()
        # the fused step unscales inside its kernel: the clip bounds the gradients scaled as they are
        clip_gate_gradients(self.optimizer, self.grad_scaler._scale)
        self.grad_scaler.step(self._sgd.optimizer)
        self.grad_scaler.update()
        return loss_dict
