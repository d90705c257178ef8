"""Pretraining the ResNet of a detection config: the backbone it leaves loads into that config with no
missing or unexpected backbone key and computes the classifier trunk's features; a resumed run equals an
uninterrupted one; two processes with SyncSN equal one with the concatenated batch; any ImageFolder is
read; a run stopped at a top-1 is the run cut short there (the cache and the stopped runs made from cached ones:
test_backbone_cache.py, test_top1_stop.py)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.modeling import build_model
from PIL import Image
from tiny_pretraining import REPO, backbone_tensors, pretrain_killed_at, scripted_top1, tiny_cfg, tiny_pretraining

from sn_detection.d2 import trainers
from sn_detection.engine import pretrain_backbone
from sn_detection.pretraining import cache as pretraining_cache
from sn_detection.pretraining.model import BackboneClassifier, backbone_cfg, pretrained_norm
from sn_detection.pretraining.train import BACKBONE_FILE, RESULTS_FILE, pretrain

# small models on a shared CPU, and bit-exact reductions for the resume test (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


class RecordingCheckpointer(DetectionCheckpointer):
    def _load_model(self, checkpoint):
        self.incompatible = super()._load_model(checkpoint)
        return self.incompatible


def test_the_backbone_loads_into_the_detector_and_computes_the_trunks_features(tiny_classification_set, tmp_path):
    cfg = tiny_cfg(tiny_classification_set, tmp_path / "pretrain")
    torch.manual_seed(0)
    results = pretrain(cfg)
    path = tmp_path / "pretrain" / BACKBONE_FILE
    with open(tmp_path / "pretrain" / RESULTS_FILE) as f:
        assert json.load(f) == json.loads(json.dumps(results))
    assert results["classes"] == 24 and 0 <= results["val_top1"] <= 100
    assert results["input_convention"]["input_format"] == cfg.INPUT.FORMAT

    detector = build_model(cfg)
    checkpointer = RecordingCheckpointer(detector)
    checkpointer.load(str(path))
    missing, unexpected = checkpointer.incompatible.missing_keys, checkpointer.incompatible.unexpected_keys
    assert not [key for key in missing if key.startswith("backbone.bottom_up.")], missing
    assert not unexpected and not checkpointer.incompatible.incorrect_shapes

    trunk = BackboneClassifier(cfg, 24)
    trunk.backbone.load_state_dict(backbone_tensors(path), strict=False)  # BN's counters are not written
    x = torch.randn(2, 3, 32, 32)
    expected = trunk.eval().backbone(x)["res5"]
    torch.testing.assert_close(detector.eval().backbone.bottom_up(x)["res5"], expected, rtol=0, atol=0)


def test_a_resumed_pretraining_equals_an_uninterrupted_one(tiny_classification_set, tmp_path, monkeypatch):
    whole = pretrain(tiny_cfg(tiny_classification_set, tmp_path / "whole"))

    steps = []

    class RecordingTrainer(trainers.SimpleTrainer):
        def run_step(self):
            steps.append(self.iter)
            super().run_step()

    cfg = tiny_cfg(tiny_classification_set, tmp_path / "resumed")
    pretrain_killed_at(monkeypatch, cfg, 3)  # after the checkpoint of iteration 1 (period 2) and iteration 2's step
    with monkeypatch.context() as patch:
        patch.setattr(trainers, "SimpleTrainer", RecordingTrainer)
        resumed = pretrain(cfg, resume=True)

    # it went on from the checkpoint: a run that trained again from 0 would end alike
    assert steps == list(range(2, cfg.PRETRAIN.MAX_ITER))
    assert resumed["val_top1"] == whole["val_top1"]
    first, second = (
        backbone_tensors(tmp_path / "whole" / BACKBONE_FILE),
        backbone_tensors(tmp_path / "resumed" / BACKBONE_FILE),
    )
    assert first.keys() == second.keys()
    assert all(torch.equal(torch.as_tensor(first[key]), torch.as_tensor(second[key])) for key in first)


def test_an_ssn_pretraining_raises_the_radius_and_resumes_with_it(tiny_classification_set, tmp_path, monkeypatch):
    ssn = ("MODEL.RESNETS.NORM", "SSN")
    whole = pretrain(tiny_cfg(tiny_classification_set, tmp_path / "whole", *ssn))
    cfg = tiny_cfg(tiny_classification_set, tmp_path / "resumed", *ssn)
    pretrain_killed_at(monkeypatch, cfg, 3)
    resumed = pretrain(cfg, resume=True)
    assert resumed["val_top1"] == whole["val_top1"] and resumed["norm"] == "SSN"
    first, second = (backbone_tensors(tmp_path / name / BACKBONE_FILE) for name in ("whole", "resumed"))
    assert first.keys() == second.keys()
    assert all(torch.equal(torch.as_tensor(first[key]), torch.as_tensor(second[key])) for key in first)
    radii = {float(value) for key, value in first.items() if key.endswith(".radius")}
    assert radii == {0.75}  # PRETRAIN.SSN_RADIUS (0, 1) before the last of 4 iterations
    assert {int(value) for key, value in first.items() if key.endswith(".iteration")} == {3}


def test_a_stopped_pretraining_is_the_beginning_of_the_whole_run(tiny_classification_set, tmp_path):
    """PRETRAIN.STOP_ITER k trains the first k iterations of the PRETRAIN.MAX_ITER run, on that run's schedule,
    then batch-averages and evaluates; stopping at the end is the whole run, under the same cache key."""
    pretrain(tiny_cfg(tiny_classification_set, tmp_path / "whole"))  # 4 iterations, a checkpoint every 2
    stopped_cfg = tiny_cfg(tiny_classification_set, tmp_path / "stopped", "PRETRAIN.STOP_ITER", 2)
    results = pretrain(stopped_cfg)
    assert results["iterations"] == 2 and results["schedule_iterations"] == 4
    assert not (tmp_path / "stopped" / "model_0000003.pth").exists()
    with open(tmp_path / "stopped" / "metrics.json") as f:
        assert max(json.loads(line)["iteration"] for line in f) == 2  # the final evaluation, after 2 iterations
    # after 2 iterations: the whole run's weights and learning rates (a 2-iteration schedule's differ); the
    # running statistics of the stopped run's last checkpoint are its batch average (taken before the last
    # checkpoint, where detectron2 places PreciseBN)
    whole, stopped = (
        torch.load(tmp_path / run / "model_0000001.pth", map_location="cpu", weights_only=False)
        for run in ("whole", "stopped")
    )
    assert whole["model"].keys() == stopped["model"].keys()
    differ = [key for key in whole["model"] if not torch.equal(whole["model"][key], stopped["model"][key])]
    assert differ and all(key.endswith((".running_mean", ".running_var")) for key in differ), differ
    learning_rates = [
        [group["lr"] for group in run["trainer"]["optimizer"]["param_groups"]] for run in (whole, stopped)
    ]
    assert learning_rates[0] == learning_rates[1]
    pretrain(tiny_cfg(tiny_classification_set, tmp_path / "short", "PRETRAIN.MAX_ITER", 2))
    short = torch.load(tmp_path / "short" / "model_0000001.pth", map_location="cpu", weights_only=False)
    assert [group["lr"] for group in short["trainer"]["optimizer"]["param_groups"]] != learning_rates[0]

    key = pretraining_cache.cache_key
    whole_key = key(tiny_cfg(tiny_classification_set, tmp_path))
    assert key(tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.STOP_ITER", 4)) == whole_key
    assert key(stopped_cfg) != whole_key
    with pytest.raises(ValueError, match="is at iteration 1, past PRETRAIN.STOP_ITER=1: raise PRETRAIN.STOP_ITER"):
        pretrain(tiny_cfg(tiny_classification_set, tmp_path / "stopped", "PRETRAIN.STOP_ITER", 1), resume=True)


def evaluations(output_dir):
    with open(output_dir / "metrics.json") as f:
        return [(row["iteration"], row["val_top1"]) for row in map(json.loads, f) if "val_top1" in row]


def test_a_pretraining_stopped_at_a_top1_is_the_run_cut_short_there(tiny_classification_set, tmp_path, monkeypatch):
    """PRETRAIN.STOP_TOP1 X ends training at the first periodic evaluation that reaches X, then batch-averages
    and evaluates as at the end: the backbone of PRETRAIN.STOP_ITER at that iteration. Not reached, it is
    the whole run's."""
    six = ("PRETRAIN.MAX_ITER", 6, "PRETRAIN.EVAL_PERIOD", 2)  # evaluated after 2, 4 and 6 iterations
    scripted_top1(monkeypatch, 40.0)
    pretrain(tiny_cfg(tiny_classification_set, tmp_path / "cut", *six, "PRETRAIN.STOP_ITER", 4))
    whole = pretrain(tiny_cfg(tiny_classification_set, tmp_path / "whole", *six))
    assert "stop_top1" not in whole and whole["iterations"] == 6

    calls = scripted_top1(monkeypatch, 40.0, 60.0, 70.0)
    stopped = pretrain(tiny_cfg(tiny_classification_set, tmp_path / "stopped", *six, "PRETRAIN.STOP_TOP1", 50.0))
    assert calls == [40.0, 60.0, 70.0]  # after 2 and 4 iterations (moving averages), then the final evaluation
    assert stopped["iterations"] == 4 and stopped["stop_top1"] == 50 and stopped["stop_top1_reached"]
    assert stopped["val_top1"] == 70.0 and stopped["schedule_iterations"] == 6
    assert not (tmp_path / "stopped" / "model_0000005.pth").exists()
    # metrics.json is written every 20 iterations with the latest value: the stop's (logged at its iteration's
    # index, 3), then the final evaluation's, at the iteration that did not run (4)
    assert evaluations(tmp_path / "stopped") == [(3, 60.0), (4, 70.0)]
    tensors, expected = (backbone_tensors(tmp_path / run / BACKBONE_FILE) for run in ("stopped", "cut"))
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(torch.as_tensor(tensors[k]), torch.as_tensor(expected[k])) for k in expected)

    calls = scripted_top1(monkeypatch, 40.0)
    unreached = pretrain(tiny_cfg(tiny_classification_set, tmp_path / "unreached", *six, "PRETRAIN.STOP_TOP1", 50.0))
    assert calls == [40.0] * 3 and unreached["iterations"] == 6 and not unreached["stop_top1_reached"]
    first, second = (backbone_tensors(tmp_path / run / BACKBONE_FILE) for run in ("whole", "unreached"))
    assert all(torch.equal(torch.as_tensor(first[k]), torch.as_tensor(second[k])) for k in first)


def test_a_pretraining_stopped_at_a_top1_and_killed_after_its_last_checkpoint_resumes_to_its_end(
    tiny_classification_set, tmp_path, monkeypatch
):
    """The checkpoint of the iteration where the top-1 was reached holds the stop: resumed from it, the run
    trains no further step and ends with the uninterrupted one's backbone and top-1."""
    # a checkpoint every 3 iterations: the stop's, after 2, is the final one
    opts = ("PRETRAIN.EVAL_PERIOD", 2, "PRETRAIN.STOP_TOP1", 50.0, "PRETRAIN.CHECKPOINT_PERIOD", 3)
    scripted_top1(monkeypatch, 60.0)
    whole = pretrain(tiny_cfg(tiny_classification_set, tmp_path / "whole", *opts))

    class Killed(Exception):
        pass

    cfg = tiny_cfg(tiny_classification_set, tmp_path / "resumed", *opts)
    scripted_top1(monkeypatch, 60.0, Killed)  # killed in the final evaluation, after the stop's checkpoint
    with pytest.raises(Killed):
        pretrain(cfg, resume=True)
    assert sorted(path.name for path in (tmp_path / "resumed").glob("model_*.pth")) == ["model_final.pth"]
    steps = []

    class RecordingTrainer(trainers.SimpleTrainer):
        def run_step(self):
            steps.append(self.iter)
            super().run_step()

    scripted_top1(monkeypatch, 60.0)
    with monkeypatch.context() as patch:
        patch.setattr(trainers, "SimpleTrainer", RecordingTrainer)
        resumed = pretrain(cfg, resume=True)
    assert steps == [] and resumed["iterations"] == 2 and resumed["val_top1"] == whole["val_top1"]
    first, second = (backbone_tensors(tmp_path / run / BACKBONE_FILE) for run in ("whole", "resumed"))
    assert all(torch.equal(torch.as_tensor(first[k]), torch.as_tensor(second[k])) for k in first)


def run_tool(*args, succeeds=True, env=None):
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "pretrain_backbone.py"),
            "--config-file",
            os.path.join(REPO, "configs", "demo_compare_norms.yaml"),
            *args,
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert (result.returncode == 0) == succeeds, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def test_the_tool_refuses_a_bad_value_before_writing_anything(tmp_path):
    output = run_tool(
        "PRETRAIN.OUTPUT_DIR",
        str(tmp_path / "out"),
        "OUTPUT_DIR",
        str(tmp_path / "detector"),
        "PRETRAIN.CROP_AREA",
        "(0.5, 0.2)",
        succeeds=False,
    )
    assert "PRETRAIN.CROP_AREA=(0.5, 0.2) is invalid: it must be (low, high) with 0 < low <= high <= 1" in output
    assert list(tmp_path.iterdir()) == []


def test_two_processes_with_sync_sn_equal_one_process_on_the_concatenated_batch(tiny_classification_set, tmp_path):
    """Each process reads its half of every batch, with the crops and flips of one process; SyncSN pools
    the BN branch over both, and DDP averages the gradients. Two steps at a moderate learning rate (the
    warm-up's): the two runs take different paths (one process SN's closed forms, two SyncSN's autograd
    path, float32 rounding apart) and this tiny network (32 px, 1x1 maps at res5, 4 images) amplifies
    rounding as it trains: the weights agree to 1e-6 after two steps, and one-ulp changes of either path have
    moved them apart by 1e-3 at the third, the first at the full learning rate."""
    schedule = ["PRETRAIN.MAX_ITER", "2", "PRETRAIN.BASE_LR", "0.02", "PRETRAIN.CHECKPOINT_PERIOD", "100"]
    run_tool(*tiny_pretraining(tiny_classification_set, tmp_path / "one", *schedule))
    output = run_tool(
        "--num-gpus",
        "2",
        "--dist-url",
        "auto",
        *tiny_pretraining(tiny_classification_set, tmp_path / "two", "PRETRAIN.SYNC_NORMS", "True", *schedule),
        env={"CUDA_VISIBLE_DEVICES": ""},
    )  # the processes run on the CPU, also on a machine with a GPU
    assert "World size: 2" in output
    one, two = backbone_tensors(tmp_path / "one" / BACKBONE_FILE), backbone_tensors(tmp_path / "two" / BACKBONE_FILE)
    assert one.keys() == two.keys()
    for key in one:
        got, expected = torch.as_tensor(two[key]), torch.as_tensor(one[key])
        if "running" in key:
            # the batch average's statistics come from forwards of the trained network: its rounding grows with
            # the depth of the map (1.2e-4 of a tensor's largest value measured at res5) where the weights
            # agree to 1e-6
            assert (got - expected).abs().max() <= 1e-3 * expected.abs().max(), key
        else:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=key)


def test_any_image_folder_is_read(tmp_path):
    """Images of any size and format in train/<class>/ and val/<class>/, like ImageNet's."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 3), ("val", 1)):
        for label, name in enumerate(("n01440764", "n01443537")):
            folder = tmp_path / "images" / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                size = (40 + 7 * i, 30 + 5 * label)
                pixels = (torch.rand(size[1], size[0], 3, generator=generator) * 255).byte().numpy()
                Image.fromarray(pixels).save(folder / f"{i}.{'png' if i % 2 else 'JPEG'}")
    results = pretrain(tiny_cfg(tmp_path / "images", tmp_path / "out", "PRETRAIN.MAX_ITER", "2"))
    assert results["classes"] == 2 and results["val_top1"] in (0.0, 50.0, 100.0)


def test_a_folder_without_splits_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="PRETRAIN.DATA=.* is not a folder; PRETRAIN.DATA is 'embedded' or"):
        pretrain(tiny_cfg(tmp_path, tmp_path / "out"))


def test_a_split_without_images_is_refused(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split / "n01440764").mkdir(parents=True)
        (tmp_path / split / "n01440764" / "labels.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'train'} has class sub-folders but no images in them"):
        pretrain(tiny_cfg(tmp_path, tmp_path / "out"))


def test_mixed_precision_off_cuda_is_refused_naming_the_key(tiny_classification_set, tmp_path):
    cfg = tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.AMP", True, "MODEL.DEVICE", "cpu")
    with pytest.raises(ValueError, match="PRETRAIN.AMP=True needs the model on a CUDA device"):
        pretrain(cfg)


def test_a_run_resumes_only_with_its_model_and_not_past_its_last_iteration(tiny_classification_set, tmp_path):
    pretrain(tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.MAX_ITER", "2"))
    with pytest.raises(ValueError, match="cannot resume from .*: it is not a checkpoint of this model"):
        pretrain(
            tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.MAX_ITER", "4", "MODEL.RESNETS.NORM", "GN"),
            resume=True,
        )
    with pytest.raises(ValueError, match="is at iteration 1, past PRETRAIN.MAX_ITER=1: raise PRETRAIN.MAX_ITER"):
        pretrain(tiny_cfg(tiny_classification_set, tmp_path, "PRETRAIN.MAX_ITER", "1"), resume=True)


def test_a_frozen_bn_backbone_is_pretrained_as_bn(tiny_classification_set, tmp_path):
    """FrozenBN (BN-dagger) has fixed statistics and affine: only BN learns them, under the same keys."""
    cfg = tiny_cfg(tiny_classification_set, tmp_path, "MODEL.RESNETS.NORM", "FrozenBN", "PRETRAIN.MAX_ITER", "2")
    assert pretrain(cfg)["norm"] == "BN"
    tensors = backbone_tensors(tmp_path / BACKBONE_FILE)
    assert {"stem.conv1.norm.running_mean", "stem.conv1.norm.running_var"} <= set(tensors)
    assert torch.as_tensor(tensors["stem.conv1.norm.running_mean"]).abs().sum() > 0  # FrozenBN would keep 0


@pytest.mark.parametrize(
    "norm, problem",
    [
        ("DN", "PRETRAIN.SYNC_NORMS=True: DN has batch statistics that no synchronised layer pools"),
        ("BN", "PRETRAIN.SYNC_NORMS=True makes BN torch's SyncBatchNorm, which runs on CUDA only"),
    ],
)
def test_sync_norms_refuses_statistics_it_cannot_pool(tiny_classification_set, tmp_path, norm, problem):
    sync = ["MODEL.RESNETS.NORM", norm, "PRETRAIN.SYNC_NORMS", "True", "MODEL.DEVICE", "cpu"]
    with pytest.raises(ValueError, match=re.escape(problem)):
        BackboneClassifier(tiny_cfg(tiny_classification_set, tmp_path, *sync), 3)


def test_sync_norms_leaves_batch_independent_norms_alone(tiny_classification_set, tmp_path):
    cfg = tiny_cfg(tiny_classification_set, tmp_path, "MODEL.RESNETS.NORM", "GN", "PRETRAIN.SYNC_NORMS", "True")
    assert pretrained_norm(cfg) == "GN" and backbone_cfg(cfg).MODEL.RESNETS.NORM == "GN"


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--eval-only"], "--eval-only: pretraining has no evaluation-only run"),
        (["--cached", "--num-gpus", "2"], "--cached makes the backbone from the start in one process"),
        (["--cached", "--resume"], "--cached makes the backbone from the start in one process"),
    ],
)
def test_the_tool_refuses_flags_it_would_ignore(flags, problem, capsys):
    with pytest.raises(SystemExit):
        pretrain_backbone.main(["--config-file", os.path.join(REPO, "configs", "demo_compare_norms.yaml"), *flags])
    assert problem in capsys.readouterr().err
