"""``GraphedBackbone``: a detectron2 backbone (ResNet + FPN, or any other) replayed as CUDA graphs where its
input size is fixed, so that the host's work of its layers, launches included, is paid once per shape.

detectron2's large-scale-jitter recipe crops every training image to 1024 x 1024, and GeneralizedRCNN
normalizes and pads the batch before the backbone: every training batch reaches the backbone with one
shape. NVIDIA's MLPerf Mask R-CNN graphs its backbone per padded shape in the same way.

- **Signatures.** A call's signature is its input's shape, dtype and device, the training flag, whether
  gradients are wanted and which parameters want them, the input's ``requires_grad``, and CUDA autocast's
  dtype (or none). The first ``warmup`` calls of a signature run eagerly, as ordinary calls: Triton
  compiles its kernels, cuDNN chooses its algorithms and cuBLAS allocates its workspaces outside any
  capture, and these calls train as any other. The next call captures the backbone's forward into a graph
  with a memory pool of its own and, when gradients are wanted, its backward as
  ``torch.autograd.grad`` of the outputs with respect to the input and the trainable parameters; from
  then on the signature is replayed.
- **A bound.** At most ``max_graphs`` signatures are captured (each holds its activations for good);
  later signatures run eagerly, which the log says once. So do training-mode calls without gradients (the
  batch average, precise BN: their layers pool statistics in Python-side state that a replay would not
  update) and calls while a module inside the backbone has hooks (a replay would skip them); each reason
  is logged once.
- **Training.** A replay is one autograd node whose inputs are the input and the trainable parameters:
  its backward replays the backward graph and hands autograd the parameters' gradients, which it
  accumulates into ``.grad`` as after an eager backward, so DistributedDataParallel's hooks fire as
  usual (its all-reduce stays outside the graph). Autograd may keep a handed gradient itself as a
  parameter's ``.grad`` (when ``.grad`` was None); before the next backward replay overwrites that
  memory, a ``.grad`` still in it is moved out (gradient accumulation works).
- **Statistics.** The norms' running statistics are updated in place inside the graph, once per replay,
  exactly as eagerly (our layers update them on the device, without host synchronisation). SyncSN's
  all-reduces with several processes are captured with the graph (NCCL supports capture).
- **Autocast.** The capture runs under the caller's CUDA autocast with its weight-cast cache off (a cast
  cached outside the graph would be read from freed memory at the next replay); detectron2's AMPTrainer
  keeps its cache on, which the graph does not see.
- **What stays valid.** The graphs read the parameters and buffers where they were at capture: moving or
  converting the model (``.to``, ``.half``, ...) or loading a state dict into it drops every graph
  (captured again after the warm-up); the optimizer's in-place updates and ``load_state_dict``'s copies
  are seen. The outputs of a replay live in the graph's memory until its next replay, as with
  ``torch.cuda.make_graphed_callables``: each training step runs its backward before the next forward.

The wrapper is the backbone to detectron2: ``output_shape()``, ``size_divisibility``,
``padding_constraints`` and every other attribute are the wrapped one's, and it registers the wrapped
backbone's submodules as its own, so module names and state-dict keys are unchanged (``backbone.res2...``,
not ``backbone.backbone.res2...``): checkpoints load into the model with or without the wrapper. CUDA only:
a call on another device fails.

Why not ``torch.cuda.make_graphed_callables``: it captures one signature per module by replacing the
module's ``forward``, always captures a backward (an inference graph would hold one for nothing), warms
up on its sample arguments (moving every running statistic three extra times), and refuses autocast's
cache, which detectron2's AMPTrainer turns on.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import NamedTuple

import torch
from detectron2.modeling import Backbone
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..layers.options import POSITIVE_INT, check_options

logger = logging.getLogger(__name__)


class GraphedBackbone(Backbone):
    """``backbone`` replayed as CUDA graphs, at most ``max_graphs`` of them, each captured after
    ``warmup`` eager calls of its input signature (module docstring)."""

    option_rules = {"max_graphs": POSITIVE_INT, "warmup": POSITIVE_INT}

    def __init__(self, backbone: Backbone, *, max_graphs: int = 2, warmup: int = 3):
        check_options(GraphedBackbone, self.option_rules, max_graphs=max_graphs, warmup=warmup)
        own = [name for name, _ in backbone.named_parameters(recurse=False)]
        own += [name for name, _ in backbone.named_buffers(recurse=False)]
        if own:
            raise ValueError(
                f"GraphedBackbone: the backbone {type(backbone).__name__} holds parameters or buffers of its own "
                f"({own}); it can wrap only a backbone whose tensors are in submodules (ResNet, FPN, ...)"
            )
        super().__init__()
        # its children are registered here, so that names do not change; it is no submodule itself (set
        # after them: while it is unset, attribute look-ups are not passed on to it)
        for name, child in backbone.named_children():
            self.add_module(name, child)
        self.__dict__["_backbone"] = backbone
        self.max_graphs = max_graphs
        self.warmup = warmup
        self._captures: dict = {}
        self._calls = collections.Counter()
        self._logged: set = set()
        self._inner_modules = [m for m in self.modules() if m is not self]
        self._params = list(self.parameters())
        self.register_load_state_dict_post_hook(_drop_graphs_after_loading)
        self.training = backbone.training

    @property
    def size_divisibility(self) -> int:
        return self._backbone.size_divisibility

    @property
    def padding_constraints(self) -> dict:
        return self._backbone.padding_constraints

    def output_shape(self):
        return self._backbone.output_shape()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            backbone = self.__dict__.get("_backbone")
            if backbone is None:
                raise
            return getattr(backbone, name)

    @property
    def captured(self) -> list:
        """The signatures captured so far, in capture order (module docstring)."""
        return list(self._captures)

    def reset_graphs(self) -> None:
        """Drop every graph and warm-up count (and the graphs' memory, once their outputs are freed)."""
        self._captures.clear()
        self._calls.clear()

    def forward(self, x: Tensor) -> dict:
        if not x.is_cuda:
            raise RuntimeError(
                f"GraphedBackbone replays CUDA graphs: its input must be on a CUDA device, not {x.device}; "
                "run the backbone without the wrapper elsewhere"
            )
        self._backbone.training = self.training  # the flag may have been set on this module alone
        signature = self._signature(x)
        capture = None if signature is None else self._captures.get(signature)
        if capture is None and signature is not None:
            capture = self._capture_when_warm(x, signature)
        return self._backbone(x) if capture is None else capture(x)

    def _signature(self, x: Tensor) -> _Signature | None:
        """The call's signature (module docstring), or None for a call that must run eagerly."""
        grad = torch.is_grad_enabled()
        if self.training and not grad:
            self._log_once(
                "no grad",
                "GraphedBackbone: training-mode calls without gradients (the batch average, precise BN) run "
                "eagerly: their layers pool statistics in state that a replay would not update",
            )
            return None
        if any(_has_hooks(m) for m in self._inner_modules):
            self._log_once(
                "hooks",
                "GraphedBackbone: modules inside the backbone have hooks, which a replay would skip: calls run "
                "eagerly while they are registered",
            )
            return None
        trainable = tuple(p.requires_grad for p in self._params) if grad else ()
        needs_grad = grad and (x.requires_grad or any(trainable))
        return _Signature(
            tuple(x.shape),
            x.dtype,
            x.device,
            self.training,
            needs_grad,
            x.requires_grad,
            trainable,
            _autocast_dtype(),
            torch.is_inference_mode_enabled(),
        )

    def _capture_when_warm(self, x: Tensor, signature: _Signature) -> _Capture | None:
        if len(self._captures) >= self.max_graphs:
            self._log_once(
                "bound",
                f"GraphedBackbone: {len(self._captures)} graphs captured (max_graphs={self.max_graphs}); "
                f"{_describe(signature)} and every other new input signature run eagerly",
            )
            return None
        self._calls[signature] += 1
        if self._calls[signature] <= self.warmup:
            return None
        del self._calls[signature]
        params = tuple(p for p, wants in zip(self._params, signature.trainable) if wants)
        start = time.perf_counter()
        capture = _Capture(self._backbone, x, params, needs_grad=signature.needs_grad, autocast=signature.autocast)
        self._captures[signature] = capture
        seconds = time.perf_counter() - start
        logger.info(
            f"GraphedBackbone: captured {_describe(signature)} in {seconds:.1f} s "
            f"(graph {len(self._captures)} of at most {self.max_graphs})"
        )
        return capture

    def _log_once(self, reason: str, message: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info(message)

    def _apply(self, *args, **kwargs):
        # what .to(), .cuda(), .half() ... call (torch's RNNs override it too): the tensors the graphs read
        # may move, so the graphs go, and the parameter list is read again (they may be new objects)
        self.reset_graphs()
        result = super()._apply(*args, **kwargs)
        self._params = list(self.parameters())
        return result

    def __getstate__(self):
        # graphs cannot be copied or pickled: a copy captures its own
        state = self.__dict__.copy()
        state["_captures"], state["_calls"] = {}, collections.Counter()
        return state

    def extra_repr(self) -> str:
        return f"max_graphs={self.max_graphs}, warmup={self.warmup}"


def _drop_graphs_after_loading(module: GraphedBackbone, incompatible_keys) -> None:
    # load_state_dict(assign=True) replaces tensors; copies in place would keep the graphs valid, but a
    # load is rare enough to capture again after it
    module.reset_graphs()
    module._params = list(module.parameters())


def graph_backbone(model: nn.Module, *, max_graphs: int = 2, warmup: int = 3) -> nn.Module:
    """``model`` with its ``backbone`` (every detectron2 meta-architecture has one) replaced by
    ``GraphedBackbone(model.backbone, max_graphs=..., warmup=...)``; call it before DDP wraps the model."""
    backbone = getattr(model, "backbone", None)
    if not isinstance(backbone, Backbone):
        raise ValueError(f"graph_backbone: {type(model).__name__} has no detectron2 Backbone called 'backbone'")
    if isinstance(backbone, GraphedBackbone):
        raise ValueError("graph_backbone: the model's backbone is a GraphedBackbone already")
    model.backbone = GraphedBackbone(backbone, max_graphs=max_graphs, warmup=warmup)
    return model


class _Capture:
    """One captured signature: its static input, the forward graph (and the backward graph), the static
    outputs and gradients; called like the backbone."""

    def __init__(self, backbone: nn.Module, x: Tensor, params: tuple, *, needs_grad: bool, autocast):
        self.params = params
        self.input = x.detach().clone().requires_grad_(x.requires_grad)
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph = torch.cuda.CUDAGraph()
        self.backward_graph = None
        # data-loading threads may allocate while the main thread captures: only this thread is checked
        with torch.cuda.device(x.device), _autocast(autocast):
            with torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
                outputs = backbone(self.input)
        self.names = tuple(outputs)
        self.outputs = tuple(outputs.values())
        self.differentiable = tuple(o.requires_grad for o in self.outputs)
        if needs_grad:
            wrt = ((self.input,) if x.requires_grad else ()) + params
            targets = [o for o in self.outputs if o.requires_grad]
            self.grad_outputs = tuple(torch.empty_like(o) for o in targets)
            self.backward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(x.device):
                with torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
                    grads = torch.autograd.grad(targets, wrt, self.grad_outputs, allow_unused=True)
            self.input_grad = grads[0] if x.requires_grad else None
            self.param_grads = grads[1:] if x.requires_grad else grads
        self.outputs = tuple(o.detach() for o in self.outputs)  # the capture's autograd graph is spent

    def __call__(self, x: Tensor) -> dict:
        if self.backward_graph is None:
            outputs = self.replay_forward(x)
        else:
            outputs = _Replay.apply(self, x, *self.params)
        return dict(zip(self.names, outputs))

    def replay_forward(self, x: Tensor) -> tuple:
        with torch.no_grad():
            self.input.copy_(x)
        self.forward_graph.replay()
        return tuple(o.detach() for o in self.outputs)

    def replay_backward(self, grads: tuple) -> tuple:
        """The gradients of the input and of the trainable parameters for ``grads`` of the outputs."""
        wanted = [g for g, differentiable in zip(grads, self.differentiable) if differentiable]
        for static, grad in zip(self.grad_outputs, wanted):
            static.copy_(grad)
        for param, grad in zip(self.params, self.param_grads):
            # a .grad that autograd kept from the last replay is in the memory this one overwrites
            if param.grad is not None and grad is not None and param.grad.data_ptr() == grad.data_ptr():
                param.grad = param.grad.clone()
        self.backward_graph.replay()
        input_grad = None if self.input_grad is None else self.input_grad.detach()
        return (input_grad, *(None if g is None else g.detach() for g in self.param_grads))


class _Replay(torch.autograd.Function):
    """One replay as one autograd node: its inputs are the input and the trainable parameters."""

    @staticmethod
    def forward(ctx, capture: _Capture, x: Tensor, *params: Tensor):
        ctx.capture = capture
        outputs = capture.replay_forward(x)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, capture.differentiable) if not d))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.capture.replay_backward(grads))


class _Signature(NamedTuple):
    """What a graph is captured for (module docstring)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    training: bool
    needs_grad: bool
    input_grad: bool
    trainable: tuple  # requires_grad of every parameter, when gradients are wanted
    autocast: torch.dtype | None
    inference_mode: bool


def _has_hooks(module: nn.Module) -> bool:
    # nn.Module has no public "has hooks"; these are the dicts make_graphed_callables checks too
    hooks = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module, name, None) for name in hooks)


def _autocast_dtype() -> torch.dtype | None:
    """CUDA autocast's dtype, or None where it is off (``is_autocast_enabled()`` without a device is CUDA's
    on every torch; ``get_autocast_dtype`` is torch >= 2.4's name)."""
    if not torch.is_autocast_enabled():
        return None
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype("cuda")
    return torch.get_autocast_gpu_dtype()


def _autocast(dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=dtype, cache_enabled=False)


def _describe(signature: _Signature) -> str:
    mode = "training" if signature.training else "evaluation"
    grads = "with" if signature.needs_grad else "no"
    autocast = "" if signature.autocast is None else f", autocast {signature.autocast}"
    where = f"{signature.dtype} on {signature.device}"
    return f"input {list(signature.shape)} {where} ({mode}, {grads} gradients{autocast})"
