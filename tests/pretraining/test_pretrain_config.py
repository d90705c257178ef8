"""The PRETRAIN keys are pretraining's (``add_pretrain_config``, ``validate_pretrain_config``), and every
config of sn_detection has them: ``add_sn_config`` adds them and ``validate_sn_config`` checks them, so
that a config file that sets them merges whatever the entry point. (Each rule's message:
tests/d2/test_config.py.)"""

import pytest
from detectron2.config import CfgNode, get_cfg

from sn_detection.d2 import add_sn_config, validate_sn_config
from sn_detection.pretraining.config import PRETRAIN_KEY_RULES, add_pretrain_config, validate_pretrain_config


def test_add_sn_config_adds_pretrainings_keys_with_their_defaults():
    cfg, alone = get_cfg(), CfgNode()
    add_sn_config(cfg)
    add_pretrain_config(alone)
    assert cfg.PRETRAIN == alone.PRETRAIN
    validate_pretrain_config(alone)
    assert set(PRETRAIN_KEY_RULES) <= set(alone.PRETRAIN)


def test_a_bad_value_fails_in_both_validations():
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.PRETRAIN.WARMUP_ITERS = -1
    for validate in (validate_pretrain_config, validate_sn_config):
        with pytest.raises(ValueError, match=r"PRETRAIN.WARMUP_ITERS=-1 is invalid: it must be an int >= 0"):
            validate(cfg)


def test_a_stop_past_the_schedule_is_refused():
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.PRETRAIN.MAX_ITER, cfg.PRETRAIN.STOP_ITER = 100, 101
    with pytest.raises(
        ValueError,
        match=r"PRETRAIN.STOP_ITER=101 is invalid: it must be 0 \(the whole schedule\) or "
        r"at most PRETRAIN.MAX_ITER=100",
    ):
        validate_pretrain_config(cfg)
    cfg.PRETRAIN.STOP_ITER = 100
    validate_pretrain_config(cfg)


def test_a_top1_stop_without_evaluations_is_refused():
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.PRETRAIN.STOP_TOP1, cfg.PRETRAIN.EVAL_PERIOD = 60.0, 0
    with pytest.raises(ValueError, match=r"PRETRAIN.STOP_TOP1=60.0 needs PRETRAIN.EVAL_PERIOD > 0"):
        validate_pretrain_config(cfg)
    cfg.PRETRAIN.EVAL_PERIOD = 100
    validate_pretrain_config(cfg)


def test_a_config_without_the_keys_is_refused_with_the_call_that_adds_them():
    with pytest.raises(ValueError, match=r"no PRETRAIN: call sn_detection.d2.add_sn_config\(cfg\)"):
        validate_pretrain_config(get_cfg())


def test_the_package_still_gives_its_names_when_imported_before_d2():
    """``sn_detection.pretraining`` imports its modules on first use (its docstring says why): the names it
    gave, in a fresh process where nothing has imported ``sn_detection.d2`` yet."""
    import subprocess
    import sys

    code = (
        "from sn_detection.pretraining import BackboneClassifier, cached_backbone, pretrain\n"
        "import sn_detection.pretraining as p\n"
        "assert pretrain.__module__ == 'sn_detection.pretraining.train'\n"
        "assert BackboneClassifier.__module__ == 'sn_detection.pretraining.model'\n"
        "try:\n    p.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "has no attribute 'no_such_name'" in done.stdout
