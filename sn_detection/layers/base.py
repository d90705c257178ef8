"""The one base of every layer of this package, as torch's ``_NormBase`` is for its BatchNorms: ``NormBase``
owns what every layer does alike, the forward's skeleton included, and its extensions add what only some do
(``running.RunningMoments``: running statistics and the batch average;
``moment_normalizer.MomentNormalizer``: the PyTorch path of the layers whose statistics derive from the IN
moments).

Construction. A layer takes the channel count first and its options as keyword-only parameters, and lists
the rules of their values in ``option_rules`` (``options``); its constructor passes the channel count and
every option to ``NormBase.__init__``, which checks them (a ValueError naming the layer, the option and
its valid values), keeps each option as an attribute of the same name, and creates ``weight`` and
``bias`` of shape (C,). The layer then adds its own tensors and calls ``reset_parameters()``; the base's
sets the affine to 1, 0 and each extension adds its own part. A class whose ``option_rules`` do not name
exactly its constructor's keyword-only parameters is refused when it is defined.

Identity. Tensors alone do not say which normalization used them: GN and PONO both have only ``weight``
and ``bias``, BNSR has BatchNorm's tensors, and GN's group count or a layer's eps has no shape at all. So
every layer saves its identity in its state dict (torch's ``get_extra_state``, under
``<module>._extra_state``): the class that defines its computation (the one that declares
``option_rules``) and the options that change what it computes. Loading a state dict whose identity
differs fails, naming the module and both identities, on every path that loads state dicts
(``load_state_dict``, detectron2's checkpointers and so ``DefaultPredictor``). A state dict without
identities (converted or foreign weights, which know no options) loads unchecked and with no warning;
detectron2's loaders cannot tell such a file from one of another norm, so ``d2.checkpointer`` requires
the identities when it evaluates or resumes.

- Not part of the identity: options that only set where training starts or how fast the running
  estimates move (momentum, DN's initial gates), which a trained state does not depend on.
- SyncSN's identity is SN's: the same tensors and the same computation in evaluation.
- TorchScript compiles neither method: a scripted layer's state dict has no identity.
- It is stored as a fixed-size uint8 tensor (UTF-8, zero-padded), because detectron2's loader compares
  every entry's shape first and would skip one of another shape with a warning, never reaching the check.

Freezing. A frozen BatchNorm is PyTorch's BatchNorm in evaluation mode with fixed parameters (detectron2
swaps in ``FrozenBatchNorm2d`` for that when it freezes a stage). Our layers are not swapped; they freeze
themselves, keeping their class, parameters, buffers and state-dict keys:

- a layer is ``frozen`` when none of its parameters requires a gradient, which is exactly how
  detectron2's ``ResNet.freeze`` (``MODEL.BACKBONE.FREEZE_AT``, ``freeze_at`` in a LazyConfig) marks a
  frozen stage; ``freeze()`` does the same by hand;
- a frozen layer stays in evaluation mode, also when ``train()`` is called on it or on a parent, and its
  forward first puts it there (for a model trained without ever calling ``train()``); for a layer whose
  training-mode output depends on the batch (SN, SyncSN, DN, MN, MGN, BNSR) the batch-dependent
  statistics (SN's BN branch, DN's batch pooling, MN's mode estimates, BNSR's moments) are the stored
  running ones and are not updated, while per-sample statistics (IN, LN, MN's gates, ...) still come
  from each sample, exactly as at test time. GN and PONO compute the same in both modes.

Freezing is derived, never stored: every entry point that builds a model with frozen stages (detectron2's
``build_model``, ``DefaultPredictor``, a LazyConfig's ``instantiate``) gets frozen layers, with no step of
ours after the build. A frozen layer takes no part in a batch average either (in evaluation mode it
records nothing). Under TorchScript a scripted layer follows the mode it was scripted in.

The forward. Every layer but GN (torch's group norm) runs one skeleton, ``NormBase.forward``:

- under TorchScript, ``scripted_forward``: the paper's formula in plain tensor operations (``plain_forward``);
- otherwise a frozen layer is put in evaluation mode (above); while an exporter records the call
  (``exporting``), ``exported_forward``: plain tensor operations again;
- otherwise the call's plan: a layer's kernels for inputs like x (``fused.FusedPlan``), run as one autograd
  node (``fused.fused_normalize``), or None, and the layer's PyTorch path, ``autograd_forward``.

A layer says what it is through its ``plain_forward`` (the paper's formula, written once: for the layers built
on IN moments, their ``scale_and_shift``), ``make_call_plan`` and, where its PyTorch path or its exported form
is faster than the plain formula, ``autograd_forward`` and ``exported_forward``; the skeleton is written once,
here.

Call plans. What a layer's forward decides about its input (its path: kernels or autograd; tiles, grids and
the kernels' constants) depends on the input's shape, dtype, device and strides, on the
training mode, and on little else; so it is decided on the first call with such an input and kept for the
next ones (``call_plan``), which then skip the checks and the arithmetic: on a GPU a layer's host time is
its step time. The plans hold no tensor. A layer keeps the plans of its ``_MAX_CALL_PLANS`` latest input
signatures (a detector's RoI heads see a new RoI count every iteration; an evaluation, new image sizes);
whatever else a path depends on (a running batch average, the process group of SyncSN) is in the key or
clears the plans when it changes (``clear_call_plans``), as does moving or casting the layer. Copies and
pickles of a layer start without plans.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from . import kernels
from .fused import fused_normalize
from .inference import EvaluationForm
from .options import Rule, check_num_channels, check_options

IDENTITY_KEY = "_extra_state"  # where torch saves get_extra_state(), after the module's prefix
_IDENTITY_SIZE = 256  # bytes; fixed forever, see the module docstring
_NOT_IDENTITY = frozenset({"momentum", "init_groups", "init_batch_pool"})
_MAX_CALL_PLANS = 16
_PLANS = "_call_plans"  # the attribute that holds them, in the module's __dict__


class NormBase(nn.Module):
    """Base of every norm layer of this package: checked options, ``weight`` and ``bias``,
    ``reset_parameters``, ``extra_repr``, the saved identity and freezing (module docstring)."""

    # declared by each layer class (option name -> Rule), and only there: its identity names that class
    option_rules: ClassVar[Mapping[str, Rule]]
    # the parameters that choose statistics rather than scale and shift (the optimizer's gate rules)
    gate_parameters: ClassVar[tuple[str, ...]] = ()
    __jit_unused_properties__ = ["frozen"]  # TorchScript compiles properties otherwise
    __jit_ignored_attributes__ = [_PLANS]  # the call plans: host-side Python, typed as nothing TorchScript has

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "option_rules" in vars(cls):
            parameters = inspect.signature(cls.__init__).parameters.values()
            options = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
            if sorted(options) != sorted(cls.option_rules):
                raise TypeError(
                    f"{cls.__name__}: option_rules {sorted(cls.option_rules)} do not match the keyword-only "
                    f"parameters of its constructor {sorted(options)}"
                )

    def __init__(self, num_channels: int, **options):
        self.check_arguments(num_channels, **options)
        super().__init__()
        self.num_channels = num_channels
        for name, value in options.items():
            setattr(self, name, value)
        self.weight = nn.Parameter(torch.empty(num_channels))
        self.bias = nn.Parameter(torch.empty(num_channels))

    @classmethod
    def check_arguments(cls, num_channels, **options) -> None:
        """Raise a ValueError naming this class and the problem for a channel count that is not a positive
        int, an option without a rule, or the first option whose value breaks its rule."""
        check_num_channels(cls, num_channels)
        unknown = [name for name in options if name not in cls.option_rules]
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown option {unknown[0]!r}; the options are {list(cls.option_rules)}")
        check_options(cls, cls.option_rules, **options)

    def reset_parameters(self) -> None:
        """Affine 1, 0 (extensions and layers add their own tensors' initial values)."""
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        """The channel count and every option, as the constructor takes them."""
        return ", ".join([str(self.num_channels), *(f"{name}={getattr(self, name)}" for name in self.option_rules)])

    def evaluation_form(self):
        """What this layer is at inference (``inference.evaluation_form``): by default itself, for layers that
        already evaluate as one moments pass and one affine pass; layers that reduce to less say so."""
        return EvaluationForm(None, self)

    # the forward ----------------------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        """The layer's output (module docstring, "The forward"): under TorchScript ``scripted_forward``; else, a
        frozen layer in evaluation mode first, ``exported_forward`` while an exporter records (``exporting``),
        and otherwise the path of the call's plan: the plan's kernels (``fused.fused_normalize``), or without a
        plan ``autograd_forward``."""
        if torch.jit.is_scripting():
            return self.scripted_forward(x)
        return self._forward(x)

    @torch.jit.unused
    def _forward(self, x: Tensor) -> Tensor:
        parameters = self.parameter_tuple()
        trainable = False
        for parameter in parameters:
            if parameter.requires_grad:
                trainable = True
                break
        if self.training and not trainable:  # frozen (module docstring)
            self.train(False)
        if exporting():
            return self.exported_forward(x)
        plan = self.call_plan(x)
        if plan is None:
            return self.autograd_forward(x, parameters)
        return fused_normalize(self, plan, x, parameters, trainable)

    def plain_forward(self, x: Tensor) -> Tensor:
        """The paper's formula in plain tensor operations, differentiable, in the statistics dtype: by default
        the layer's PyTorch path, its TorchScript and exported forms and what a double backward replays, and the
        oracle its kernels are tested against; layers with a forward define it."""
        raise NotImplementedError(f"{type(self).__name__} has no forward")

    def scripted_forward(self, x: Tensor) -> Tensor:
        """What TorchScript compiles: the checked input's ``plain_forward``."""
        check_input(x, self.num_channels)
        return self.plain_forward(x)

    @torch.jit.unused
    def exported_forward(self, x: Tensor) -> Tensor:
        """The layer as exporters record it (``exporting``): plain tensor operations, no autograd Function, no
        call plan, no branch on a tensor's values; by default ``scripted_forward``."""
        return self.scripted_forward(x)

    @torch.jit.unused
    def autograd_forward(self, x: Tensor, parameters: tuple[Tensor, ...]) -> Tensor:
        """The layer's PyTorch path, differentiated by autograd, for the calls its plan leaves to it (None), with
        its ``parameters`` (``parameter_tuple()``); by default ``plain_forward``."""
        return self.plain_forward(x)

    @torch.jit.unused
    def replayed_forward(self, x: Tensor) -> Tensor:
        """The layer in plain differentiable operations, recording no statistics (``fused.replaying``): what a
        backward under create_graph differentiates (``fused.replayed_gradients``); by default
        ``plain_forward``."""
        return self.plain_forward(x)

    # identity -------------------------------------------------------------------------------------------

    def norm_identity(self) -> str:
        """The class defining this layer's computation (the one that declares its ``option_rules``) with
        the options that change it, e.g. ``GroupNorm2d(eps=1e-05, num_groups=32)``."""
        defining = next(cls for cls in type(self).__mro__ if "option_rules" in vars(cls))
        options = [
            f"{name}={getattr(self, name)!r}" for name in sorted(defining.option_rules) if name not in _NOT_IDENTITY
        ]
        return f"{defining.__name__}({', '.join(options)})"

    def get_extra_state(self) -> Tensor:
        data = self.norm_identity().encode()
        if len(data) > _IDENTITY_SIZE:
            raise ValueError(f"the identity {data!r} is longer than the {_IDENTITY_SIZE} bytes a checkpoint stores")
        return torch.tensor(list(data.ljust(_IDENTITY_SIZE, b"\0")), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Nothing to set: ``_load_from_state_dict`` has checked the identity, where it knows the module's name."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        key = prefix + IDENTITY_KEY
        if key in state_dict:
            saved, own = _decode(state_dict[key]), self.norm_identity()
            if saved != own:
                errors.append(
                    f"{prefix[:-1] or 'the layer'} is {own}, but the state dict was saved by {saved}: "
                    "load it into a model built with that norm and those options"
                )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        if key in missing:  # weights without an identity load unchecked (module docstring)
            missing.remove(key)

    # call plans -----------------------------------------------------------------------------------------

    @torch.jit.unused
    def call_plan(self, x: Tensor):
        """The plan of this layer for inputs like ``x`` (module docstring): ``make_call_plan(x)``'s on the
        first call with x's shape, dtype, device, strides, training mode and ``plan_context()``, kept for
        the next ones. The first plan for a CUDA tensor without Triton 3 warns
        (``kernels.warn_if_kernels_off``)."""
        key = (x.shape, x.dtype, x.device, x.stride(), self.training, self.plan_context())
        plans = self.__dict__.get(_PLANS)
        if plans is None:
            plans = self.__dict__[_PLANS] = {}
        try:
            return plans[key]
        except KeyError:
            pass
        plan = self.make_call_plan(x)  # may raise (bad input): nothing is kept then
        kernels.warn_if_kernels_off(x)  # here, on a new signature, rather than on every call
        if len(plans) >= _MAX_CALL_PLANS:
            del plans[next(iter(plans))]  # the oldest
        plans[key] = plan
        return plan

    @torch.jit.unused
    def make_call_plan(self, x: Tensor):
        """What this layer decides for ``x`` and every input with the same key (``call_plan``); layers that
        plan their calls define it."""
        raise NotImplementedError(f"{type(self).__name__} does not plan its calls")

    @torch.jit.unused
    def plan_context(self):
        """Whatever else a plan depends on, part of its key (None: nothing)."""
        return None

    def clear_call_plans(self) -> None:
        """Forget the plans: what they depend on has changed."""
        self.__dict__.pop(_PLANS, None)

    def register_parameter(self, name: str, param) -> None:
        self.clear_call_plans()  # a plan may have checked the parameter it replaces
        super().register_parameter(name, param)

    def _apply(self, *args, **kwargs):
        self.clear_call_plans()  # devices and dtypes of the layer's tensors change
        return super()._apply(*args, **kwargs)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop(_PLANS, None)
        return state

    # freezing -------------------------------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        """True when no parameter requires a gradient (detectron2's mark of a frozen stage)."""
        return not any(p.requires_grad for p in self.parameter_tuple())

    def parameter_tuple(self) -> tuple[Tensor, ...]:
        """``tuple(self.parameters())``, read from the parameter dicts of the layer and of its submodules (MN's
        and MGN's gate) where no submodule has submodules of its own: the same tensors in the same order
        without ``nn.Module``'s generators, which cost a layer call a measurable share of its host time
        (``tools/count_launches.py --host-time``)."""
        if not self._modules:
            return tuple(p for p in self._parameters.values() if p is not None)
        parameters = list(self._parameters.values())
        for module in self._modules.values():
            if module is not None:
                if module._modules:
                    return tuple(self.parameters())
                parameters += module._parameters.values()
        return tuple(p for p in parameters if p is not None)

    def freeze(self) -> nn.Module:
        """Fix the parameters, and so the running statistics, for good (see the module docstring)."""
        self.requires_grad_(False)
        return self.train(False)

    def train(self, mode: bool = True) -> nn.Module:
        return super().train(mode and not self.frozen)


@torch.jit.unused  # never reached under TorchScript: callers test torch.jit.is_scripting() first
def exporting():  # (no annotation: this module's are strings, which TorchScript does not resolve here)
    """Whether an exporter is recording the call: ``torch.jit.trace`` (and so the TorchScript-based
    ``torch.onnx.export``), the ONNX exporter, or torch.compile / ``torch.export`` (dynamo or the non-strict
    tracer). The layers then take their plain path (``NormBase.exported_forward``): tensor operations only, no
    autograd Function, no call plan, no branch on a tensor's values, so that what is recorded is what runs."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()


def check_input(x: Tensor, num_channels: int) -> None:
    """Every layer takes floating-point (N, C, H, W) input with its C channels."""
    if x.dim() != 4 or x.shape[1] != num_channels:
        raise ValueError(f"expected input of shape (N, {num_channels}, H, W), got {list(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"expected floating-point input, got {x.dtype}")


def _decode(state) -> str:
    if not (isinstance(state, Tensor) and state.dtype == torch.uint8 and state.shape == (_IDENTITY_SIZE,)):
        return f"an unreadable identity ({type(state).__name__} {getattr(state, 'shape', '')})"
    return bytes(state.tolist()).rstrip(b"\0").decode(errors="replace")
