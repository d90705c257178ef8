"""``add_sn_config(cfg)``: the config keys of sn_detection; ``norm_factory_from_cfg(cfg, name)``: our layer
``name`` with the options they set; ``validate_sn_config(cfg)``: every value checked up front.

``MODEL.SN`` holds the options of all our norm layers, one key per layer option, shared by every layer
that has that option (``EPS`` is the eps of all of them, ``MOMENTUM`` of those with running statistics):

    EPS                  eps                 all
    MOMENTUM             momentum            SN, SyncSN, DN, MN, BNSR (PyTorch convention; None: cumulative)
    USE_BN               use_bn              SN, SyncSN: the BN branch (False for 1 image per GPU)
    GN_GROUPS            num_groups          GN
    NUM_MODES            num_modes           MN, MGN
    BNSR_P               p                   BNSR
    DN_INIT_GROUPS       init_groups         DN
    DN_INIT_BATCH_POOL   init_batch_pool     DN

and ``MODEL.SN.META_ARCHITECTURE``, the meta-architecture that ``MODEL.META_ARCHITECTURE: SNMetaArch``
builds with those options (see ``meta_arch``). ``SOLVER.GATE_WEIGHT_DECAY`` and ``SOLVER.GATE_LR_FACTOR``
apply to the gating parameters (SN's logits, DN's gates, MN's and MGN's gate), ``SOLVER.SSN_GATE_LR_FACTOR``
and ``SOLVER.SSN_GATE_CLIP_NORM`` to SSN's logits (by default the SSN authors' a tenth of the learning rate
and clipping at 1), see ``optimizer``; ``SOLVER.SSN_RADIUS`` (start, end) is SSN's radius before the first
iteration and after the last, linear in between (``hooks.SparsityRadius``; the authors' 0 to 1);
``TEST.BATCH_AVERAGE`` configures the batch-average hook; ``TEST.NORM_ANALYSIS.PERIOD`` the logging of
what the learned norms chose (``norm_analysis``; 0: off). The defaults are the layers' own defaults, the
papers' settings. The ``PRETRAIN`` keys of the classification pretraining of the config's ResNet are
pretraining's own (``sn_detection.pretraining.config``), which the engine's ``load_cfg`` adds and checks
beside these.

``validate_sn_config(cfg)`` checks the norm names of every ``MODEL.*.NORM`` key, these keys' values (a
layer option by the rules its layer states, ``sn_detection.layers.options``) and that our norms are
built by ``SNMetaArch``, so that a bad value fails with the key and its valid values before anything is
built or written (``SNMetaArch`` and the engine's ``load_cfg`` call it). Whether a group count suits each
layer's channels is only known when the model is built: ``SNMetaArch`` then names the keys of the layer
that refused its options.
"""

from __future__ import annotations

from detectron2.config import CfgNode as CN
from detectron2.modeling import META_ARCH_REGISTRY

from ..layers import NORM_NAMES, NormFactory, norm_class, norm_options
from ..layers.options import NON_NEGATIVE, POSITIVE_INT, RADIUS_RANGE, is_int

# The registered name of the meta-architecture that builds our norms with the config's options.
SN_META_ARCHITECTURE = "SNMetaArch"

# The names of the dict inside detectron2's get_norm (it exposes no list), for error messages.
DETECTRON2_NORM_NAMES = ("BN", "SyncBN", "FrozenBN", "GN", "nnSyncBN", "naiveSyncBN", "naiveSyncBN_N", "LN")

# layer option -> key of cfg.MODEL.SN
_OPTION_KEYS = {
    "eps": "EPS",
    "momentum": "MOMENTUM",
    "use_bn": "USE_BN",
    "num_groups": "GN_GROUPS",
    "num_modes": "NUM_MODES",
    "p": "BNSR_P",
    "init_groups": "DN_INIT_GROUPS",
    "init_batch_pool": "DN_INIT_BATCH_POOL",
}


def add_sn_config(cfg: CN) -> None:
    """Add sn_detection's keys, with their defaults, to a detectron2 config (before merging a file)."""
    cfg.MODEL.SN = CN()
    cfg.MODEL.SN.META_ARCHITECTURE = "GeneralizedRCNN"
    cfg.MODEL.SN.EPS = 1e-5
    cfg.MODEL.SN.MOMENTUM = 0.1
    cfg.MODEL.SN.USE_BN = True
    cfg.MODEL.SN.GN_GROUPS = 32
    cfg.MODEL.SN.NUM_MODES = 2
    cfg.MODEL.SN.BNSR_P = 1.01
    cfg.MODEL.SN.DN_INIT_GROUPS = 32
    cfg.MODEL.SN.DN_INIT_BATCH_POOL = False

    cfg.SOLVER.GATE_WEIGHT_DECAY = 0.0
    cfg.SOLVER.GATE_LR_FACTOR = 1.0
    cfg.SOLVER.SSN_GATE_LR_FACTOR = 0.1
    cfg.SOLVER.SSN_GATE_CLIP_NORM = 1.0
    cfg.SOLVER.SSN_RADIUS = (0.0, 1.0)

    cfg.TEST.BATCH_AVERAGE = CN()
    cfg.TEST.BATCH_AVERAGE.ENABLED = False
    cfg.TEST.BATCH_AVERAGE.NUM_BATCHES = 100

    cfg.TEST.NORM_ANALYSIS = CN()
    cfg.TEST.NORM_ANALYSIS.PERIOD = 0


def option_keys(name: str) -> dict[str, str]:
    """The config key of each option of our norm ``name``, e.g. {"num_groups": "MODEL.SN.GN_GROUPS", ...}."""
    return {option: f"MODEL.SN.{_OPTION_KEYS[option]}" for option in norm_options(name)}


def norm_factory_from_cfg(cfg: CN, name: str) -> NormFactory:
    """Our layer ``name`` with the options ``cfg.MODEL.SN`` sets for it."""
    return NormFactory(name, **{option: cfg.MODEL.SN[_OPTION_KEYS[option]] for option in norm_options(name)})


def valid_norm_names() -> tuple[str, ...]:
    """Every norm string the norm keys accept: ours, then detectron2's other built-in names."""
    return NORM_NAMES + tuple(name for name in DETECTRON2_NORM_NAMES if name not in NORM_NAMES)


def norm_keys(node: CN, prefix: str = "MODEL"):
    """(key, node, value) of every string key named NORM under ``node`` (the keys detectron2 resolves with
    ``get_norm``: RESNETS, FPN, ROI_BOX_HEAD, ROI_MASK_HEAD, RETINANET, SEM_SEG_HEAD, ...)."""
    for name, value in node.items():
        if isinstance(value, CN):
            yield from norm_keys(value, f"{prefix}.{name}")
        elif name == "NORM" and isinstance(value, str):
            yield f"{prefix}.{name}", node, value


_INT_AT_LEAST_0 = (lambda v: is_int(v) and v >= 0, "an int >= 0")

# Keys that are no layer option: key -> (whether a value is valid, the valid values in words).
_KEY_RULES = {
    "SOLVER.GATE_WEIGHT_DECAY": NON_NEGATIVE,
    "SOLVER.GATE_LR_FACTOR": NON_NEGATIVE,
    "SOLVER.SSN_GATE_LR_FACTOR": NON_NEGATIVE,
    "SOLVER.SSN_GATE_CLIP_NORM": NON_NEGATIVE,
    "SOLVER.SSN_RADIUS": RADIUS_RANGE,
    "TEST.NORM_ANALYSIS.PERIOD": _INT_AT_LEAST_0,
}


def validate_sn_config(cfg: CN) -> None:
    """Raise a ValueError naming the key and its valid values for the first invalid value among
    sn_detection's keys and the norm names of every ``MODEL.*.NORM`` key (module docstring)."""
    if "SN" not in cfg.MODEL:
        raise ValueError("the config has no MODEL.SN: call sn_detection.d2.add_sn_config(cfg) before merging a file")
    for key, _, norm in norm_keys(cfg.MODEL):
        if norm != "" and norm not in valid_norm_names():
            raise ValueError(
                f"{key}: unknown norm {norm!r}; valid names are {list(valid_norm_names())}, or '' for none"
            )
    for name in NORM_NAMES:
        rules = norm_class(name).option_rules
        for option, key in option_keys(name).items():
            _check(key, _value(cfg, key), rules[option].holds, rules[option].text)
    for key, (is_valid, valid_values) in _KEY_RULES.items():
        _check(key, _value(cfg, key), is_valid, valid_values)
    if cfg.TEST.BATCH_AVERAGE.ENABLED:
        key = "TEST.BATCH_AVERAGE.NUM_BATCHES"
        _check(key, _value(cfg, key), POSITIVE_INT.holds, "an int >= 1 when TEST.BATCH_AVERAGE.ENABLED")
    _check_meta_architecture(cfg)


# what detectron2's get_norm builds for "GN": nn.GroupNorm(32, C), eps 1e-5
_DETECTRON2_GN = NormFactory("GN", num_groups=32, eps=1e-5)


def _check_meta_architecture(cfg: CN) -> None:
    """Our norms get their options only when SNMetaArch builds the model, and it builds another one."""
    inner = cfg.MODEL.SN.META_ARCHITECTURE
    registered = [name for name, _ in META_ARCH_REGISTRY if name != SN_META_ARCHITECTURE]
    if inner not in registered:
        raise ValueError(
            f"MODEL.SN.META_ARCHITECTURE={inner!r} is invalid: it must be a registered meta-architecture other "
            f"than {SN_META_ARCHITECTURE!r}: one of {sorted(registered)}"
        )
    if cfg.MODEL.META_ARCHITECTURE == SN_META_ARCHITECTURE:
        return
    for key, _, norm in norm_keys(cfg.MODEL):
        theirs = norm == "GN" and norm_factory_from_cfg(cfg, "GN") == _DETECTRON2_GN  # the same layer
        if norm in NORM_NAMES and not theirs:
            raise ValueError(
                f"{key}={norm!r} is a norm of sn_detection, built with the options of MODEL.SN only by "
                f"MODEL.META_ARCHITECTURE {SN_META_ARCHITECTURE!r} (which builds MODEL.SN.META_ARCHITECTURE, "
                f"now {inner!r}); the config has MODEL.META_ARCHITECTURE {cfg.MODEL.META_ARCHITECTURE!r}"
            )


def _value(cfg: CN, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check(key: str, value, is_valid, valid_values: str) -> None:
    if not is_valid(value):
        raise ValueError(f"{key}={value!r} is invalid: it must be {valid_values}")
