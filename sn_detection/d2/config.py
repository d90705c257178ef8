"""``add_sn_config(cfg)``: the config keys of sn_detection; ``norm_options_from_cfg(cfg)``: the layers'
options they set.

``MODEL.SN`` holds the options of all our norm layers, one key per layer option, shared by every layer
that has that option (``EPS`` is the eps of all of them, ``MOMENTUM`` of those with running statistics):

    EPS                  eps                 all
    MOMENTUM             momentum            SN, SyncSN, DN, MN, BNSR (PyTorch convention)
    USE_BN               use_bn              SN, SyncSN: the BN branch (False for 1 image per GPU)
    GN_GROUPS            num_groups          GN
    NUM_MODES            num_modes           MN, MGN
    BNSR_P               p                   BNSR
    DN_INIT_GROUPS       init_groups         DN
    DN_INIT_BATCH_POOL   init_batch_pool     DN

``SOLVER.GATE_WEIGHT_DECAY`` and ``SOLVER.GATE_LR_FACTOR`` apply to the gating parameters (SN's logits,
DN's gates, MN's and MGN's gate), see ``optimizer``; ``TEST.BATCH_AVERAGE`` configures the batch-average
hook; ``TEST.NORM_ANALYSIS.PERIOD`` the logging of what the learned norms chose (``norm_analysis``;
0: off). The defaults are the layers' own defaults, the papers' settings.

``validate_sn_config(cfg)`` checks these keys' values and the norm names of every ``MODEL.*.NORM`` key
up front (``norm_options_from_cfg`` and the engine's ``load_cfg`` call it), so that a bad value fails
with the key and its valid values before anything is built or written. Whether a group count suits
each layer's channels is only known when the model is built: ``sn_detection.d2.build_model`` then names
the keys of the layer that refused its options.
"""

from __future__ import annotations

import numbers

from detectron2.config import CfgNode as CN

from ..layers import NORM_NAMES, norm_options
from .registry import valid_norm_names

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

    cfg.TEST.BATCH_AVERAGE = CN()
    cfg.TEST.BATCH_AVERAGE.ENABLED = False
    cfg.TEST.BATCH_AVERAGE.NUM_BATCHES = 100

    cfg.TEST.NORM_ANALYSIS = CN()
    cfg.TEST.NORM_ANALYSIS.PERIOD = 0


def norm_options_from_cfg(cfg: CN) -> dict[str, dict[str, object]]:
    """Norm name -> the keyword options ``cfg.MODEL.SN`` gives that layer (for ``set_norm_options``);
    ``validate_sn_config`` first."""
    validate_sn_config(cfg)
    return {name: {option: cfg.MODEL.SN[_OPTION_KEYS[option]] for option in norm_options(name)} for name in NORM_NAMES}


def option_keys(name: str) -> dict[str, str]:
    """The config key of each option of our norm ``name``, e.g. {"num_groups": "MODEL.SN.GN_GROUPS", ...}."""
    return {option: f"MODEL.SN.{_OPTION_KEYS[option]}" for option in norm_options(name)}


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# key -> (whether a value is valid, the valid values in words). Whether a group count suits the
# channels of each layer is checked when the model is built, where the channels are known.
_VALID_VALUES = {
    "MODEL.SN.EPS": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "MODEL.SN.MOMENTUM": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "MODEL.SN.USE_BN": (lambda v: isinstance(v, bool), "True or False"),
    "MODEL.SN.GN_GROUPS": (lambda v: _is_int(v) and v >= 1, "an int >= 1 dividing the channels of every GN layer"),
    "MODEL.SN.NUM_MODES": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "MODEL.SN.BNSR_P": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "MODEL.SN.DN_INIT_GROUPS": (
        lambda v: _is_int(v) and v >= 1,
        "an int >= 1: for every DN layer of C channels, C or a power of two dividing C",
    ),
    "MODEL.SN.DN_INIT_BATCH_POOL": (lambda v: isinstance(v, bool), "True or False"),
    "SOLVER.GATE_WEIGHT_DECAY": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "SOLVER.GATE_LR_FACTOR": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
}


def validate_sn_config(cfg: CN) -> None:
    """Raise a ValueError naming the key and its valid values for the first invalid value among
    sn_detection's keys and the norm names of every ``MODEL.*.NORM`` key."""
    if "SN" not in cfg.MODEL:
        raise ValueError("the config has no MODEL.SN: call sn_detection.d2.add_sn_config(cfg) before merging a file")
    for key, norm in _norm_keys(cfg.MODEL, "MODEL"):
        if norm != "" and norm not in valid_norm_names():
            valid = list(valid_norm_names())
            raise ValueError(f"{key}: unknown norm {norm!r}; valid names are {valid}, or '' for none")
    for key, (is_valid, valid_values) in _VALID_VALUES.items():
        _check(key, _value(cfg, key), is_valid, valid_values)
    if cfg.TEST.BATCH_AVERAGE.ENABLED:
        key = "TEST.BATCH_AVERAGE.NUM_BATCHES"
        _check(key, _value(cfg, key), lambda v: _is_int(v) and v >= 1, "an int >= 1 when TEST.BATCH_AVERAGE.ENABLED")


def _norm_keys(node: CN, prefix: str):
    """(key, value) of every string key named NORM under ``node`` (the keys detectron2 resolves with
    ``get_norm``: RESNETS, FPN, ROI_BOX_HEAD, ROI_MASK_HEAD, RETINANET, SEM_SEG_HEAD, ...)."""
    for name, value in node.items():
        if isinstance(value, CN):
            yield from _norm_keys(value, f"{prefix}.{name}")
        elif name == "NORM" and isinstance(value, str):
            yield f"{prefix}.{name}", value


def _value(cfg: CN, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check(key: str, value, is_valid, valid_values: str) -> None:
    if not is_valid(value):
        raise ValueError(f"{key}={value!r} is invalid: it must be {valid_values}")
