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
hook. The defaults are the layers' own defaults, the papers' settings.
"""

from __future__ import annotations

from detectron2.config import CfgNode as CN

from ..layers import NORM_NAMES, norm_options

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


def norm_options_from_cfg(cfg: CN) -> dict[str, dict[str, object]]:
    """Norm name -> the keyword options ``cfg.MODEL.SN`` gives that layer (for ``set_norm_options``)."""
    if "SN" not in cfg.MODEL:
        raise ValueError("the config has no MODEL.SN: call sn_detection.d2.add_sn_config(cfg) before merging a file")
    return {name: {option: cfg.MODEL.SN[_OPTION_KEYS[option]] for option in norm_options(name)} for name in NORM_NAMES}
