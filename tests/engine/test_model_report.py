"""The `make demo` chain on a shrunk demo: tools/train_net.py trains with the norm-analysis hook, then
tools/analyze_norms.py and tools/demo.py write the analysis and the drawn predictions of the model it
trained; plus the checkpoint-only analysis and the tools' errors."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets import register_coco_instances
from detectron2.structures import Boxes, BoxMode, Instances
from PIL import Image

from sn_detection.engine import analyze_norms as analyze
from sn_detection.engine import demo
from sn_detection.layers import DynamicNorm2d, ModeGroupNorm2d, SwitchableNorm2d

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_CONFIG = os.path.join(REPO, "configs", "demo_mask_rcnn_sn.yaml")
# The demo shrunk to seconds: ResNet-18 (basic blocks), narrow FPN and heads, 128 px, 2 iterations.
SHRINK = [
    "MODEL.RESNETS.DEPTH", "18", "MODEL.RESNETS.RES2_OUT_CHANNELS", "64", "MODEL.FPN.OUT_CHANNELS", "32",
    "MODEL.ROI_BOX_HEAD.CONV_DIM", "32", "MODEL.ROI_MASK_HEAD.CONV_DIM", "32",
    "SOLVER.WARMUP_ITERS", "2", "SOLVER.STEPS", "()", "SOLVER.MAX_ITER", "2", "DATALOADER.NUM_WORKERS", "0",
    "INPUT.MIN_SIZE_TRAIN", "(128,)", "INPUT.MIN_SIZE_TEST", "128", "TEST.BATCH_AVERAGE.ENABLED", "False",
    "TEST.DETECTIONS_PER_IMAGE", "5",
]  # fmt: skip
COMPONENTS = ["stem", "res2", "res3", "res4", "res5", "FPN", "box head", "mask head"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The SN demo trained for 2 iterations with the analysis logged every iteration, no evaluation."""
    output_dir = str(tmp_path_factory.mktemp("demo"))
    command = [
        sys.executable,
        os.path.join(REPO, "tools", "train_net.py"),
        "--config-file",
        DEMO_CONFIG,
        *SHRINK,
        "TEST.NORM_ANALYSIS.PERIOD",
        "1",
        "DATASETS.TEST",
        "()",
        "OUTPUT_DIR",
        output_dir,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return output_dir


def test_training_logs_the_sn_weights_to_metrics_and_draws_their_evolution(trained):
    with open(os.path.join(trained, "metrics.json")) as f:
        rows = [json.loads(line) for line in f]
    last = next(row for row in rows if row["iteration"] == 1)
    for component in COMPONENTS:
        key = f"norm/SN/{component.replace(' ', '_')}"
        weights = [last[f"{key}/mean_{s}"] for s in ("IN", "LN", "BN")]
        assert sum(weights) == pytest.approx(1.0) and all(0 < w < 1 for w in weights)
    assert Image.open(os.path.join(trained, "norm_evolution_SN.png")).format == "PNG"


def test_analyze_norms_of_the_trained_model(trained, capsys):
    paths = analyze.main(["--config-file", DEMO_CONFIG, *SHRINK, "OUTPUT_DIR", trained])
    folder = os.path.join(trained, "norm_analysis")
    assert paths == [
        os.path.join(folder, name)
        for name in ("norm_analysis.md", "norm_analysis.csv", "norm_layers.csv", "sn_importance.png")
    ]
    assert f"chart: {os.path.join(folder, 'sn_importance.png')}" in capsys.readouterr().out
    text = open(paths[0], encoding="utf-8").read()
    assert os.path.join(trained, "model_final.pth") in text  # the last checkpoint of OUTPUT_DIR
    assert "![norm_evolution_SN.png](../norm_evolution_SN.png)" in text
    with open(paths[1], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["component"] for row in rows if row["metric"] == "mean_BN"] == COMPONENTS
    assert {row["layers"] for row in rows if row["component"] == "res4"} == {"5"}  # 2 basic blocks, 1 shortcut


def test_the_checkpoint_of_another_config_is_refused(trained):
    """SN's checkpoint under a GN config would load in part, and GN's learned values would be initial ones."""
    gn = [
        item
        for key in ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM", "MODEL.ROI_BOX_HEAD.NORM", "MODEL.ROI_MASK_HEAD.NORM")
        for item in (key, "GN")
    ]
    with pytest.raises(ValueError, match="cannot evaluate .*model_final.pth: it is not a checkpoint of this model"):
        analyze.main(["--config-file", DEMO_CONFIG, *SHRINK, *gn, "OUTPUT_DIR", trained])


def test_demo_draws_predictions_beside_the_ground_truth(trained, tmp_path):
    written = demo.main(
        [
            "--config-file",
            DEMO_CONFIG,
            "--num-images",
            "2",
            "--output",
            str(tmp_path),
            "--confidence-threshold",
            "0",
            *SHRINK,
            "OUTPUT_DIR",
            trained,
        ]
    )
    assert [os.path.basename(path) for path in written] == ["000_000000.png", "001_000001.png"]
    objects = sum(len(record["annotations"]) for record in demo.dataset_records("sn_shapes_val", 2))
    report = (tmp_path / demo.OBJECTS_FILE).read_text(encoding="utf-8")
    assert f"{objects} objects: " in report and report.count("\n| ") == 1 + 5  # header + one row per class
    for path in written:
        image = np.asarray(Image.open(path).convert("RGB"))
        height, width = image.shape[:2]
        assert width == 2 * (width // 2) and height > 100 and image.std() > 10
        # two panels of the same picture, drawn differently (predictions | ground truth)
        assert not np.array_equal(image[:, : width // 2], image[:, width // 2 :])


def test_demo_on_image_files(trained, tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    Image.fromarray(np.full((96, 128, 3), 120, dtype=np.uint8)).save(source / "gray.jpg")
    written = demo.main(
        [
            "--config-file",
            DEMO_CONFIG,
            "--input",
            str(source / "*.jpg"),
            "--output",
            str(tmp_path / "out"),
            *SHRINK,
            "OUTPUT_DIR",
            trained,
        ]
    )
    assert [os.path.basename(path) for path in written] == ["000_gray.png"]
    assert Image.open(written[0]).size == (256, 192)  # predictions only, drawn at twice the size


def test_objects_are_found_by_overlap_and_judged_by_the_top_detection():
    record = {
        "annotations": [
            {"bbox": [0, 0, 10, 10], "bbox_mode": BoxMode.XYWH_ABS, "category_id": 0},  # one right detection
            {"bbox": [20, 0, 40, 10], "bbox_mode": BoxMode.XYXY_ABS, "category_id": 1},  # the top one is wrong
            {"bbox": [0, 30, 10, 10], "bbox_mode": BoxMode.XYWH_ABS, "category_id": 2},  # only a far detection
        ]
    }
    instances = Instances((50, 50))
    instances.pred_boxes = Boxes(
        torch.tensor(
            [
                [1.0, 0, 10, 10],  # IoU 0.9 with object 0
                [20, 0, 38, 10],  # IoU 0.9 with object 1
                [22, 0, 40, 10],  # IoU 0.9 with object 1, higher score, class 2
                [0, 30, 10, 34],  # IoU 0.4 with object 2: not found
                [0, 0, 10, 10],  # exactly object 0's box, but the lowest score: not the top detection
            ]
        )
    )
    instances.scores = torch.tensor([0.6, 0.5, 0.7, 0.99, 0.3])
    instances.pred_classes = torch.tensor([0, 1, 2, 2, 4])
    outcomes = demo.object_classes(instances, record)
    assert outcomes == [(0, 0), (1, 2), (2, None)]
    counts = demo.confusion(outcomes + [(0, 0)], 5)
    assert counts[0, 0] == 2 and counts[1, 2] == 1 and counts[2, 5] == 1 and counts.sum() == 4
    report = demo.objects_report(counts, ["circle", "triangle", "rectangle", "star", "cross"], 0.25)
    assert "4 objects: 3 found (a detection's box at IoU >= 0.5 with theirs), 2 right" in report
    assert "| circle | 2 | 0 | 0 | 0 | 0 | 0 | 1.00 |" in report
    assert "| triangle | 0 | 0 | 1 | 0 | 0 | 0 | 0.00 |" in report
    assert "| rectangle | 0 | 0 | 0 | 0 | 0 | 1 | 0.00 |" in report
    assert "| star | 0 | 0 | 0 | 0 | 0 | 0 | – |" in report
    empty = Instances((50, 50), pred_boxes=Boxes(torch.zeros(0, 4)), scores=torch.zeros(0), pred_classes=torch.zeros(0))
    assert demo.object_classes(empty, record) == [(0, None), (1, None), (2, None)]


def test_class_agnostic_nms_keeps_the_top_detection_of_each_place():
    instances = Instances((50, 50))
    instances.pred_boxes = Boxes(
        torch.tensor(
            [
                [0.0, 0, 10, 10],  # a cross
                [0, 0, 10, 9],  # the same object called a star, at a higher score: IoU 0.9 with the first
                [0, 0, 10, 5],  # IoU 0.5 with the first, 0.56 with the second
                [30, 30, 40, 40],  # elsewhere
            ]
        )
    )
    instances.scores = torch.tensor([0.6, 0.7, 0.5, 0.3])
    instances.pred_classes = torch.tensor([4, 3, 4, 0])
    kept = demo.suppress_overlaps(instances, 0.7)
    assert kept.scores.tolist() == pytest.approx([0.7, 0.5, 0.3]) and kept.pred_classes.tolist() == [3, 4, 0]
    kept = demo.suppress_overlaps(instances, 0.5)
    assert kept.pred_classes.tolist() == [3, 0]
    assert len(demo.suppress_overlaps(instances[:0], 0.5)) == 0
    report = demo.objects_report(demo.confusion([(0, 0)], 5), ["a", "b", "c", "d", "e"], 0.25, 0.7)
    header = "# Objects in the drawn images (detections with score >= 0.25, NMS across classes at IoU 0.7)"
    assert report.startswith(header)
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            demo.parse_args(["--config-file", DEMO_CONFIG, "--class-agnostic-nms", bad])


def test_demo_refuses_a_confidence_threshold_outside_0_1(capsys):
    for bad in ("25", "-0.1"):  # 25: a percentage
        with pytest.raises(SystemExit):
            demo.parse_args(["--config-file", DEMO_CONFIG, "--confidence-threshold", bad])
        assert f"--confidence-threshold must be a score in [0, 1], got {float(bad)}" in capsys.readouterr().err
    assert demo.parse_args(["--config-file", DEMO_CONFIG, "--confidence-threshold", "1"]).confidence_threshold == 1


def test_demo_refuses_a_folder_as_input_before_loading_the_model(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    # OUTPUT_DIR holds no checkpoint: loading the model first would fail with "no trained model"
    arguments = [
        "--config-file",
        DEMO_CONFIG,
        "--input",
        str(folder),
        "--output",
        str(tmp_path / "out"),
        *SHRINK,
        "OUTPUT_DIR",
        str(tmp_path / "train"),
    ]
    with pytest.raises(IsADirectoryError, match=rf"--input '{folder}' is a folder; --input takes image files or glob"):
        demo.main(arguments)
    assert not (tmp_path / "out").exists()  # nothing drawn
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "a.jpg")
    with pytest.raises(IsADirectoryError, match=rf"--input '{folder}' is a folder"):
        demo.input_files([str(tmp_path / "*")])  # a glob that matches a folder beside the image
    assert demo.input_files([str(tmp_path / "*.jpg")]) == [str(tmp_path / "a.jpg")]


def test_demo_checks_the_dataset_files_before_loading_them(tmp_path):
    name, json_file = "sn_test_demo_coco_dataset", tmp_path / "instances.json"
    register_coco_instances(name, {}, str(json_file), str(tmp_path / "images"))  # as detectron2's COCO splits
    try:
        with pytest.raises(FileNotFoundError, match=f"dataset '{name}': its annotation file {json_file} does not"):
            demo.dataset_records(name, 1)
    finally:
        DatasetCatalog.remove(name)
        MetadataCatalog.remove(name)
    with pytest.raises(ValueError, match=f"dataset '{name}' is not registered; registered datasets: "):
        demo.dataset_records(name, 1)


def norm_entries(prefix, layer):
    return {f"{prefix}.{key}": value for key, value in layer.state_dict().items()}


def test_analyze_a_checkpoint_alone(tmp_path, capsys):
    sn = SwitchableNorm2d(8)
    with torch.no_grad():
        sn.mean_weight.copy_(torch.tensor([0.0, 0.0, 2.0]))
    state = {
        **norm_entries("backbone.bottom_up.res3.0.conv1.norm", sn),
        **norm_entries("roi_heads.box_head.conv1.norm", DynamicNorm2d(16, init_groups=1)),
        **norm_entries("roi_heads.mask_head.mask_fcn1.norm", ModeGroupNorm2d(8)),
    }
    path = tmp_path / "model_final.pth"
    torch.save({"model": state, "iteration": 3}, path)
    paths = analyze.main(["--checkpoint", str(path)])
    assert paths[0] == str(tmp_path / "norm_analysis" / "norm_analysis.md")
    text = open(paths[0], encoding="utf-8").read()
    in_, ln, bn = torch.softmax(torch.tensor([0.0, 0.0, 2.0]), 0).tolist()
    assert f"| res3 | 1 | {in_:.3f} | {ln:.3f} | {bn:.3f} | 0.333 | 0.333 | 0.333 |" in text
    assert "| box head | 1 | 0.000 | 0.000 | 1.000 | 0.000 | 0.000 | 1 |" in text
    assert "| mask head | MGN | 1 | not observed | – | – |" in text
    assert "use --config-file to observe them" in text
    assert "Norm analysis of 3 layers" in capsys.readouterr().out


def test_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trained model: .* has no checkpoint of this config"):
        analyze.main(["--config-file", DEMO_CONFIG, *SHRINK, "OUTPUT_DIR", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        analyze.main(["--checkpoint", str(tmp_path / "missing.pth")])
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a checkpoint torch.load"):
        analyze.main(["--checkpoint", str(tmp_path / "notes.txt")])
    torch.save([1, 2], tmp_path / "list.pth")
    with pytest.raises(ValueError, match="expected a state dict"):
        analyze.main(["--checkpoint", str(tmp_path / "list.pth")])
    with pytest.raises(SystemExit):
        analyze.parse_args(["--checkpoint", "x.pth", "MODEL.WEIGHTS", "y.pth"])
    with pytest.raises(FileNotFoundError, match="--input .*nothing-here.*matches no file"):
        demo.main(["--config-file", DEMO_CONFIG, "--input", str(tmp_path / "nothing-here*.jpg")])
