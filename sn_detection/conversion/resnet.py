"""detectron2's ResNet names, and the steps every source format shares: collect, check, emit.

A source module recognises its own key names and hands each tensor to a ``ResNetCollector`` under
detectron2's module name -- ``stem.conv1``, ``res2.0.conv1`` ... ``res5.2.conv3``, ``res2.0.shortcut``
-- with ``param`` ``"weight"`` for the conv and ``"norm.<name>"`` for its norm, ``<name>`` being the
parameter's name in this package's layers (weight, bias, running_mean, running_var, mean_weight,
var_weight). ``ResNetCollector.build`` then

1. infers the architecture from the blocks present: four stages, blocks per stage, bottleneck (a conv3
   exists) or basic, which must be one of the depths detectron2's ``ResNet.make_default_stages``
   builds (18, 34, 50, 101, 152);
2. checks that every tensor detectron2's ResNet of that depth needs is there, convs with exactly
   detectron2's shapes and norm vectors with the conv's channel count; absent ones are reported by
   their *source* names (so the message says what the file should have contained), wrong shapes as
   mismatched, and either makes the conversion fail;
3. emits ``<module>.weight`` for each conv and ``<module>.norm.<name>`` for its norm, laid out as the
   state dict of the norm layer the target model builds:

   - ``BN``: weight, bias, running_mean, running_var: detectron2's ``FrozenBatchNorm2d``, the usual
     norm of a pretrained backbone. No ``num_batches_tracked``: it is a training counter, FrozenBN has
     none, and a trainable ``BatchNorm2d`` only reads it when its momentum is None.
   - ``GN``: weight, bias (``GroupNorm2d`` / detectron2's ``nn.GroupNorm(32, C)``).
   - ``SN``: the state dict of ``SwitchableNorm2d(C, use_bn=...)``: weight, bias, mean_weight,
     var_weight and, with the BN branch, running_mean, running_var, num_batches_tracked.
   - ``SSN``: the state dict of ``SparseSwitchableNorm2d(C, use_bn=...)``: SN's, then radius, mean_fixed,
     var_fixed, mean_fixed_at, var_fixed_at and iteration (scalars).

   A key the source has no value for (SN's logits and counter when SN is initialised from BN) is taken
   from a freshly constructed target layer, i.e. the layer's own initialisation, and listed as
   initialised. Source values the target cannot hold (BN running statistics going into GN) are skipped.

Keys are emitted without a model prefix: ``DetectionCheckpointer``'s name matching (the output sets
``matching_heuristics``) aligns ``res2.0.conv1.weight`` with ``backbone.bottom_up.res2.0.conv1.weight``
in an FPN model and with ``backbone.res2...`` / ``roi_heads.res5...`` in a C4 model alike.
"""

import re
from collections import defaultdict
from collections.abc import Callable

from torch import Tensor, nn

from ..layers import IDENTITY_KEY, GroupNorm2d, SparseSwitchableNorm2d, SwitchableNorm2d
from .report import ConversionError, ConversionReport

# The norm layout of each target, and the targets each source norm can become.
TARGET_NORMS = ("BN", "GN", "SN", "SSN")
TARGETS_OF_SOURCE_NORM = {"BN": ("BN", "GN", "SN"), "GN": ("GN",), "SN": ("SN",), "SSN": ("SSN",)}
_SWITCHABLE = ("SN", "SSN")  # logits [IN, LN(, BN)], running statistics with the BN branch only

_REQUIRED_NORM_PARAMS = {
    "BN": ("weight", "bias", "running_mean", "running_var"),
    "GN": ("weight", "bias"),
    # and running_mean, running_var when the layer has a BN branch (3 logits)
    "SN": ("weight", "bias", "mean_weight", "var_weight"),
    "SSN": ("weight", "bias", "mean_weight", "var_weight", "mean_fixed", "var_fixed", "radius"),
}
_SCALARS = ("mean_fixed", "var_fixed", "radius")  # one value each
_SN_LOGITS = ("mean_weight", "var_weight")
_SN_RUNNING = ("running_mean", "running_var")

# (bottleneck, blocks per stage) -> depth, as in detectron2's ResNet.make_default_stages
_DEPTHS = {
    (False, (2, 2, 2, 2)): 18,
    (False, (3, 4, 6, 3)): 34,
    (True, (3, 4, 6, 3)): 50,
    (True, (3, 4, 23, 3)): 101,
    (True, (3, 8, 36, 3)): 152,
}
_STAGES = (2, 3, 4, 5)
_MODULE = re.compile(r"stem\.conv1|res([2-5])\.(\d+)\.(conv[123]|shortcut)")

SourceKey = Callable[[str, str], str]


class ResNetCollector:
    """Gathers a source's tensors under detectron2 names, then checks and emits them (``build``).

    Args:
        source_norm: the norm the source network was trained with: "BN", "GN" or "SN".
        source_key: ``source_key(module, param)``: the key the source format uses for a detectron2
            module's parameter, for naming what is missing.
        report: the conversion's report; converted / initialised / skipped / mismatched / missing
            entries are appended to it.
    """

    def __init__(self, source_norm: str, source_key: SourceKey, report: ConversionReport):
        self.source_norm = source_norm
        self.source_key = source_key
        self.report = report
        self._tensors: dict[str, dict[str, tuple[str, Tensor]]] = defaultdict(dict)

    def add(self, module: str, param: str, key: str, tensor: Tensor) -> None:
        """Record ``tensor`` (found under the source's ``key``) as ``module``'s ``param``."""
        if not _MODULE.fullmatch(module):
            raise ValueError(f"not a detectron2 ResNet module name: {module!r}")
        self._tensors[module][param] = (key, tensor)

    def build(self, norm: str) -> dict[str, Tensor]:
        """The detectron2 state dict for a backbone whose norm is ``norm``; raises ConversionError,
        with the report filled in, when a tensor is missing or has the wrong shape."""
        if norm not in TARGETS_OF_SOURCE_NORM[self.source_norm]:
            raise ConversionError(
                f"a {self.source_norm} checkpoint cannot initialise {norm} layers; "
                f"possible norms: {list(TARGETS_OF_SOURCE_NORM[self.source_norm])}"
            )
        if not self._tensors:
            raise ConversionError("no key of the expected layout was found")
        self.report.norm = norm
        shapes = self._expected_conv_shapes()
        use_bn = self._sn_has_bn_branch() if self.source_norm in _SWITCHABLE else True
        self._check_unexpected_modules(shapes)
        state = {}
        for module, shape in shapes.items():
            conv = self._conv(module, shape)
            norm_params = self._norm_params(module, shape[0], use_bn)
            if conv is None or norm_params is None:
                continue
            state[f"{module}.weight"] = conv
            state.update(self._emit_norm(module, shape[0], norm_params, norm, use_bn))
        if not self.report.ok:
            counts = [(len(self.report.missing), "missing"), (len(self.report.mismatched), "mismatched")]
            found = " and ".join(f"{count} {kind}" for count, kind in counts if count)
            raise ConversionError(f"{found} tensor(s) for {self.report.architecture or 'a ResNet'}", self.report)
        return state

    def _expected_conv_shapes(self) -> dict[str, tuple[int, int, int, int]]:
        """detectron2's conv shapes of the architecture the present keys describe, in module order."""
        blocks = defaultdict(int)
        for module in self._tensors:
            match = _MODULE.fullmatch(module)
            if match.group(1):
                stage, block = int(match.group(1)), int(match.group(2))
                blocks[stage] = max(blocks[stage], block + 1)
        absent = [stage for stage in _STAGES if stage not in blocks]
        if absent or "stem.conv1" not in self._tensors:
            parts = (["stem"] if "stem.conv1" not in self._tensors else []) + [f"res{s}" for s in absent]
            self.report.missing += [f"{self.source_key(_first_module(p), 'weight')} (and all of {p})" for p in parts]
            raise ConversionError(f"no keys for {', '.join(parts)} of a ResNet", self.report)
        bottleneck = any(module.endswith(".conv3") for module in self._tensors)
        counts = tuple(blocks[stage] for stage in _STAGES)
        depth = _DEPTHS.get((bottleneck, counts))
        if depth is None:
            kind = "bottleneck" if bottleneck else "basic"
            raise ConversionError(
                f"{kind} blocks per stage {counts} are none of the ResNets detectron2 builds: "
                + ", ".join(f"R-{d} {c}" for (_, c), d in _DEPTHS.items()),
                self.report,
            )
        self.report.architecture = f"ResNet-{depth}"
        return _conv_shapes(bottleneck, counts)

    def _check_unexpected_modules(self, shapes: dict) -> None:
        for module in self._tensors.keys() - shapes.keys():
            for key, _ in self._tensors[module].values():
                self.report.mismatched.append((key, f"{self.report.architecture} has no {module}"))

    def _conv(self, module: str, shape: tuple) -> Tensor | None:
        if "weight" not in self._tensors[module]:
            self.report.missing.append(self.source_key(module, "weight"))
            return None
        key, tensor = self._tensors[module]["weight"]
        if tuple(tensor.shape) != shape:
            self.report.mismatched.append((key, f"shape {tuple(tensor.shape)}, detectron2 expects {shape}"))
            return None
        self.report.converted.append((key, f"{module}.weight"))
        return tensor.detach()

    def _norm_params(self, module: str, channels: int, use_bn: bool) -> dict[str, tuple[str, Tensor]] | None:
        """The norm's tensors as (source key, tensor) with vectors flattened to (C,), or None when one
        is missing or has the wrong size (both reported)."""
        found = {param[len("norm.") :]: value for param, value in self._tensors[module].items() if param != "weight"}
        required = _REQUIRED_NORM_PARAMS[self.source_norm]
        if self.source_norm in _SWITCHABLE and use_bn:
            required += _SN_RUNNING
        elif self.source_norm in _SWITCHABLE:
            for name in set(found) & set(_SN_RUNNING):
                key, _ = found.pop(name)
                self.report.skipped.append(
                    (key, f"{self.source_norm} without a BN branch (2 logits) has no running statistics")
                )
        absent = [name for name in required if name not in found]
        self.report.missing += [self.source_key(module, f"norm.{name}") for name in absent]
        params = {}
        for name, (key, tensor) in found.items():
            size = (2 + use_bn) if name in _SN_LOGITS else 1 if name in _SCALARS else channels
            if tensor.numel() == size and sum(dim != 1 for dim in tensor.shape) <= 1:
                params[name] = (key, tensor.detach().reshape(size))
            else:
                self.report.mismatched.append((key, f"shape {tuple(tensor.shape)}, expected {size} values"))
        return params if len(params) == len(found) and not absent else None

    def _sn_has_bn_branch(self) -> bool:
        """Whether the source's SN layers have the BN branch (3 logits rather than 2); all must agree."""
        counts = {
            tensor.numel(): key
            for params in self._tensors.values()
            for param, (key, tensor) in params.items()
            if param == "norm.mean_weight"
        }
        if len(counts) > 1:
            example = ", ".join(f"{key} has {n}" for n, key in sorted(counts.items()))
            raise ConversionError(
                f"{self.source_norm} layers disagree on the number of logits ({example})", self.report
            )
        use_bn = counts.keys() != {2}
        if not use_bn:
            self.report.notes.append(
                f"{self.source_norm} without a BN branch (2 logits): set MODEL.SN.USE_BN False (layers built with "
                "use_bn=False)"
            )
        return use_bn

    def _emit_norm(self, module: str, channels: int, params: dict, norm: str, use_bn: bool) -> dict[str, Tensor]:
        layer = _target_layer(norm, channels, use_bn)
        template = layer.state_dict()
        template.pop(IDENTITY_KEY, None)  # converted weights know no options: they load unchecked
        if norm == "BN":
            template.pop("num_batches_tracked")
        out = {}
        for name, default in template.items():
            dst = f"{module}.norm.{name}"
            if name in params:
                key, tensor = params.pop(name)
                self.report.converted.append((key, dst))
                out[dst] = tensor.reshape(default.shape)
            else:
                self.report.initialised.append((dst, f"{type(layer).__name__}'s init ({name})"))
                out[dst] = default
        for name, (key, _) in params.items():
            self.report.skipped.append((key, f"{norm} layers have no {name}"))
        return out


def _target_layer(norm: str, channels: int, use_bn: bool) -> nn.Module:
    if norm == "SSN":
        return SparseSwitchableNorm2d(channels, use_bn=use_bn)
    if norm == "SN":
        return SwitchableNorm2d(channels, use_bn=use_bn)
    if norm == "GN":
        return GroupNorm2d(channels)
    return nn.BatchNorm2d(channels)


def _first_module(part: str) -> str:
    return "stem.conv1" if part == "stem" else f"{part}.0.conv1"


def _conv_shapes(bottleneck: bool, counts: tuple[int, ...]) -> dict[str, tuple[int, int, int, int]]:
    """detectron2's conv weight shapes for a standard ResNet (ResNet.make_default_stages)."""
    shapes = {"stem.conv1": (64, 3, 7, 7)}
    in_channels = 64
    for index, (stage, blocks) in enumerate(zip(_STAGES, counts)):
        out_channels = (256 if bottleneck else 64) * 2**index
        width = out_channels // 4
        for block in range(blocks):
            name = f"res{stage}.{block}"
            if bottleneck:
                shapes[f"{name}.conv1"] = (width, in_channels, 1, 1)
                shapes[f"{name}.conv2"] = (width, width, 3, 3)
                shapes[f"{name}.conv3"] = (out_channels, width, 1, 1)
            else:
                shapes[f"{name}.conv1"] = (out_channels, in_channels, 3, 3)
                shapes[f"{name}.conv2"] = (out_channels, out_channels, 3, 3)
            # detectron2's blocks have a projection shortcut exactly where the width changes
            if in_channels != out_channels:
                shapes[f"{name}.shortcut"] = (out_channels, in_channels, 1, 1)
            in_channels = out_channels
    return shapes
