"""A config with PRETRAIN.STOP_TOP1 made from the cached run of the same config without the stop, without
training (``sn_detection.pretraining.top1_stop``): a copy where that run never reached the top-1 before its
end, the batch average of the model it kept where it did; trained where the cached run cannot tell."""

import json
import os

import pytest
import torch
from tiny_pretraining import backbone_tensors, scripted_top1, tiny_cfg

from sn_detection.d2 import trainers
from sn_detection.data import cache as data_cache
from sn_detection.pretraining import cache as pretraining_cache
from sn_detection.pretraining.cache import cached_backbone
from sn_detection.pretraining.top1_stop import top1_curve
from sn_detection.pretraining.train import BACKBONE_FILE, RESULTS_FILE, pretrain

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_a_run_that_never_stops_is_cached_for_its_stop_as_a_copy(tiny_classification_set, tmp_path, monkeypatch):
    """A config with PRETRAIN.STOP_TOP1 X whose run is a cached one's, none of whose evaluations at its
    EVAL_PERIOD reached X, gets a copy of that backbone (the one it would train) without training; where
    the cached run does not tell where it would stop, it trains."""
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    run = ("PRETRAIN.MAX_ITER", 21, "PRETRAIN.EVAL_PERIOD", 20, "PRETRAIN.CHECKPOINT_PERIOD", 100)

    def cfg(*opts):
        return tiny_cfg(tiny_classification_set, tmp_path / "out", *run, *opts)

    scripted_top1(monkeypatch, 30.0, 50.0)  # after 20 iterations, then after 21
    source = os.path.dirname(cached_backbone(cfg()))
    same_run_stop = pretraining_cache.same_run_stop
    assert same_run_stop(cfg("PRETRAIN.STOP_TOP1", 25.0)) is None  # it stops after 20, where no model was kept
    assert same_run_stop(cfg("PRETRAIN.STOP_TOP1", 35.0, "PRETRAIN.EVAL_PERIOD", 10)) is None  # not evaluated at 10
    assert same_run_stop(cfg("PRETRAIN.STOP_TOP1", 35.0, "SEED", 2)) is None  # another run, not cached
    assert same_run_stop(cfg("PRETRAIN.STOP_TOP1", 35.0)) == (source, None)
    copied = cached_backbone(cfg("PRETRAIN.STOP_TOP1", 35.0))
    with open(os.path.join(os.path.dirname(copied), RESULTS_FILE)) as f:
        results = json.load(f)
    assert results["stop_top1"] == 35.0 and not results["stop_top1_reached"] and results["iterations"] == 21
    assert results["same_run_as"] == source

    scripted_top1(monkeypatch, 30.0, 50.0)
    trained = pretrain(tiny_cfg(tiny_classification_set, tmp_path / "trained", *run, "PRETRAIN.STOP_TOP1", 35.0))
    assert (
        trained["iterations"] == 21 and not trained["stop_top1_reached"] and trained["val_top1"] == results["val_top1"]
    )
    first, second = (backbone_tensors(path) for path in (copied, tmp_path / "trained" / BACKBONE_FILE))
    assert all(torch.equal(torch.as_tensor(first[k]), torch.as_tensor(second[k])) for k in first)


def test_a_run_stopped_at_a_top1_is_made_from_the_model_its_whole_run_kept_there(
    tiny_classification_set, tmp_path, monkeypatch
):
    """PRETRAIN.KEEP_EVALUATED_MODELS keeps the model at each periodic evaluation in the cache; a config with
    PRETRAIN.STOP_TOP1 X is then made from the model of the first evaluation that reached X by the batch
    average and the final evaluation alone: the trained stopped run's backbone, results and top-1 curve,
    without a training step."""
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    run = ("PRETRAIN.MAX_ITER", 41, "PRETRAIN.EVAL_PERIOD", 20, "PRETRAIN.CHECKPOINT_PERIOD", 100)

    def cfg(*opts):
        return tiny_cfg(tiny_classification_set, tmp_path / "out", *run, *opts)

    scripted_top1(monkeypatch, 40.0, 60.0, 70.0)  # after 20 and 40 iterations, then after 41
    stale = tmp_path / "work" / "evaluated" / "model_after_0000060.pth.tmp"  # a partial write of another attempt
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"partial")
    source = os.path.dirname(
        cached_backbone(cfg("PRETRAIN.KEEP_EVALUATED_MODELS", True), work_dir=str(tmp_path / "work"))
    )
    kept = sorted(os.listdir(os.path.join(source, "evaluated")))
    assert kept == ["model_after_0000020.pth", "model_after_0000040.pth"]
    assert pretraining_cache.is_cached(cfg())  # the same backbone, whether its models were kept or not

    stop = cfg("PRETRAIN.STOP_TOP1", 50.0)
    assert pretraining_cache.same_run_stop(stop) == (source, 40)
    assert pretraining_cache.same_run_stop(cfg("PRETRAIN.STOP_TOP1", 50.0, "MODEL.DEVICE", "cuda")) is None
    steps = []

    class RecordingTrainer(trainers.SimpleTrainer):
        def run_step(self):
            steps.append(self.iter)
            super().run_step()

    calls = scripted_top1(monkeypatch, 80.0)
    with monkeypatch.context() as patch:
        patch.setattr(trainers, "SimpleTrainer", RecordingTrainer)
        torch.set_num_threads(2)  # the batch average runs on the source's thread count, then this one is back
        made = os.path.dirname(cached_backbone(stop))
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
    assert steps == [] and calls == [80.0]  # the final evaluation only
    with open(os.path.join(made, RESULTS_FILE)) as f:
        results = json.load(f)
    assert results["same_run_as"] == source and results["threads"] == 1
    assert not os.path.exists(os.path.join(made, "evaluated"))

    scripted_top1(monkeypatch, 40.0, 60.0, 80.0)
    trained = pretrain(
        tiny_cfg(
            tiny_classification_set,
            tmp_path / "trained",
            *run,
            "PRETRAIN.STOP_TOP1",
            50.0,
            "PRETRAIN.KEEP_EVALUATED_MODELS",
            True,
        )
    )
    assert trained["iterations"] == 40 and trained["stop_top1_reached"]
    assert not (tmp_path / "trained" / "evaluated").exists()  # a stopped run is no source: it keeps nothing
    ignored = ("train_seconds", "same_run_as")
    assert {k: v for k, v in results.items() if k not in ignored} == {
        k: v for k, v in json.loads(json.dumps(trained)).items() if k not in ignored
    }
    curve = top1_curve
    assert (
        curve(os.path.join(made, "metrics.json"), 40)
        == curve(tmp_path / "trained" / "metrics.json", 40)
        == [(20, 40.0), (40, 80.0)]
    )
    first, second = (
        backbone_tensors(path) for path in (os.path.join(made, BACKBONE_FILE), tmp_path / "trained" / BACKBONE_FILE)
    )
    assert first.keys() == second.keys()
    assert all(torch.equal(torch.as_tensor(first[k]), torch.as_tensor(second[k])) for k in first)

    # a run of several processes batch-averaged each one's share of a batch: a stop is trained, not made
    with open(os.path.join(source, RESULTS_FILE)) as f:
        source_results = json.load(f)
    with open(os.path.join(source, RESULTS_FILE), "w") as f:
        json.dump(dict(source_results, processes=2), f)
    with open(os.path.join(source, data_cache.MANIFEST)) as f:
        manifest = json.load(f)
    with open(os.path.join(source, data_cache.MANIFEST), "w") as f:
        json.dump(dict(manifest, files=data_cache._list_files(source)), f)
    assert pretraining_cache.is_cached(cfg()) and pretraining_cache.same_run_stop(stop) is None
