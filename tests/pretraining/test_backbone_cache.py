"""The backbone cache (``sn_detection.pretraining.cache``): a backbone is made once and reused, verified, and
made again when damaged; its key holds a top-1 stop and its evaluation period only when set."""

import logging
import os

import pytest
from tiny_pretraining import backbone_tensors, tiny_cfg

from sn_detection.pretraining import cache as pretraining_cache
from sn_detection.pretraining import train as pretraining_train
from sn_detection.pretraining.cache import cached_backbone
from sn_detection.pretraining.train import BACKBONE_FILE, RESULTS_FILE

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_cache_key_holds_a_top1_stop_and_its_evaluation_period_only_when_set(tiny_classification_set, tmp_path):
    key = pretraining_cache.cache_key
    plain = key(tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.EVAL_PERIOD", 2))
    assert "STOP_TOP1" not in plain["pretrain"] and "EVAL_PERIOD" not in plain["pretrain"]  # backbones made before
    assert key(tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.EVAL_PERIOD", 0)) == plain
    stopped = key(tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.EVAL_PERIOD", 2, "PRETRAIN.STOP_TOP1", 50.0))
    assert stopped["pretrain"]["STOP_TOP1"] == 50 and stopped["pretrain"]["EVAL_PERIOD"] == 2
    assert (
        key(tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.EVAL_PERIOD", 4, "PRETRAIN.STOP_TOP1", 50.0))
        != stopped
    )


def test_the_cached_backbone_is_made_once(tiny_classification_set, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    calls = []
    original = pretraining_cache.pretrain
    monkeypatch.setattr(
        pretraining_cache, "pretrain", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    )
    cfg = tiny_cfg(tiny_classification_set, tmp_path / "unused", "PRETRAIN.MAX_ITER", "2")
    logger = logging.getLogger(pretraining_train.__name__)  # detectron2's setup_logger may stop propagation
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, caplog.handler])
    monkeypatch.setattr(logger, "disabled", False)
    caplog.set_level(logging.INFO, logger=logger.name)  # setLevel: also clears the logger's level cache
    path = cached_backbone(cfg)
    assert len(calls) == 1 and os.path.isfile(path)
    assert sorted(os.listdir(os.path.dirname(path))) == [BACKBONE_FILE, "manifest.json", "metrics.json", RESULTS_FILE]
    assert cached_backbone(cfg) == path and len(calls) == 1  # reused, verified by its manifest
    # the log names where the backbone stays, not the folder it was made in
    assert f"MODEL.WEIGHTS {path} and this input convention" in caplog.text
    assert ".resnet" not in caplog.text
    with open(path, "ab") as f:
        f.write(b"damage")
    assert cached_backbone(cfg) == path and len(calls) == 2  # damaged: made again
    backbone_tensors(path)
