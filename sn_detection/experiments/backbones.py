"""The pretraining configs of the sweeps' backbones, made one way by both (``with_pretrain_overrides``), so that
tools/pretrain_grid.py's cells are the backbones ``tools/compare_norms.py --finetune`` asks the cache for
(``sn_detection.pretraining.cache``), and their draws with other seeds (``backbone_configs``).
"""

from __future__ import annotations

from collections.abc import Sequence

from detectron2.config import CfgNode

from ..d2 import validate_sn_config
from ..pretraining.config import validate_pretrain_config

# tools/compare_norms.py's seeds, so also the draws of a backbone that tools/pretrain_grid.py looks for
DEFAULT_SEEDS = (1, 2, 3)


def override_list(overrides: dict) -> list[str]:
    """PRETRAIN ``overrides`` (key -> value) as KEY VALUE arguments of a subprocess's config, each value
    written so that the config parses it back to the value ``with_pretrain_overrides`` merges."""
    return [item for key, value in overrides.items() for item in (key, repr(value))]


def with_pretrain_overrides(cfg, norm: str, overrides: dict) -> CfgNode:
    """``cfg`` with MODEL.RESNETS.NORM ``norm`` and the PRETRAIN ``overrides`` (key -> value): how both
    sweeps make a pretraining config, so that their cache keys agree."""
    bad = [key for key in overrides if not str(key).startswith("PRETRAIN.")]
    if bad:
        raise ValueError(f"only PRETRAIN keys select a pretraining setting, got {bad}")
    result = cfg.clone()
    result.defrost()
    result.MODEL.RESNETS.NORM = norm
    result.merge_from_list([item for key, value in overrides.items() for item in (key, value)])
    validate_sn_config(result)
    validate_pretrain_config(result)
    return result


def backbone_configs(
    configs: dict[str, CfgNode], seeds: Sequence[int], per_seed: bool
) -> dict[tuple[str, int], CfgNode]:
    """(backbone norm, run seed) -> the config that pretrains the run's backbone: ``configs[norm]`` (of
    ``pretraining_configs``) for every seed, or with ``per_seed`` (``--backbone-seeds``) with SEED the run's
    seed, which seeds the backbone's initialisation and data order."""
    result = {}
    for norm, config in configs.items():
        for seed in seeds:
            seeded = config
            if per_seed and seed != config.SEED:
                seeded = config.clone()
                seeded.defrost()
                seeded.SEED = seed
            result[norm, seed] = seeded
    return result
