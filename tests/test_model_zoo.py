"""The model-zoo catalog: lookup, its README, and agreement with the configs and the paper's tables."""

import glob
import os
import re
import shlex
import subprocess

import pytest

from sn_detection import model_zoo
from sn_detection.model_zoo import CATALOG, PRETRAINED

# The paper's Tables 3-5, (backbone, head) -> box AP (and mask AP for Table 5), as printed.
TABLE_3 = {
    ("BN†", "BN†"): 29.6, ("BN", "BN"): 19.3, ("GN", "GN"): 32.7, ("SN", "SN"): 33.0,
    ("BN‡", "BN"): 20.0, ("GN‡", "GN"): 28.3, ("SN‡", "SN"): 29.5,
}  # fmt: skip
TABLE_4 = {("BN†", "–"): 36.7, ("BN†", "GN"): 37.2, ("BN†", "SN"): 38.0, ("GN", "GN"): 38.2, ("SN", "SN"): 39.3}
TABLE_5 = {
    ("BN†", "–"): (38.6, 34.2), ("BN†", "GN"): (39.5, 34.4), ("BN†", "SN"): (40.0, 34.8),
    ("GN", "GN"): (40.2, 35.7), ("GN", "SN"): (40.4, 36.0), ("SN", "SN"): (41.0, 36.5),
}  # fmt: skip
ITERATIONS = {"1x": 90000, "2x": 180000, "3x": 270000}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_names_on_disk():
    paths = glob.glob(os.path.join(model_zoo.CONFIG_DIR, "*.yaml"))
    return {os.path.basename(p)[: -len(".yaml")] for p in paths}


def test_lookup_by_name():
    path = model_zoo.get_config_file("mask_rcnn_sn_2x")
    assert path == os.path.join(model_zoo.CONFIG_DIR, "mask_rcnn_sn_2x.yaml") and os.path.isfile(path)
    cfg = model_zoo.get_config("mask_rcnn_sn_2x")
    assert cfg.MODEL.RESNETS.NORM == "SN" and cfg.MODEL.MASK_ON and cfg.TEST.BATCH_AVERAGE.ENABLED


def test_a_checkout_serves_its_top_level_configs_in_place():
    """In a checkout the configs are the repository's configs/ (a real folder; only a built package has a
    copy, as sn_detection/configs)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert model_zoo.CONFIG_DIR == os.path.join(repo, "configs") and not os.path.islink(model_zoo.CONFIG_DIR)
    assert not os.path.exists(os.path.join(repo, "sn_detection", "configs"))
    assert model_zoo.LAZY_CONFIG_DIR == os.path.join(repo, "configs", "lazy")


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown model zoo config 'mask_rcnn_sn_3x'.*mask_rcnn_sn_2x"):
        model_zoo.get_config_file("mask_rcnn_sn_3x")
    with pytest.raises(ValueError, match="faster_rcnn_c4_sn_1x"):
        model_zoo.get_config("configs/mask_rcnn_sn_2x.yaml")


def test_the_lazy_configs_are_found_by_name():
    assert model_zoo.lazy_names() == (
        "demo_mask_rcnn_sn",
        "mask_rcnn_dn_2x",
        "mask_rcnn_gn_lsj_100ep",
        "mask_rcnn_mgn_2x",
        "mask_rcnn_sn_2x",
        "mask_rcnn_sn_lsj_100ep",
        "mask_rcnn_ssn_2x",
    )
    path = model_zoo.get_lazy_config_file("mask_rcnn_sn_2x")
    assert path == os.path.join(model_zoo.LAZY_CONFIG_DIR, "mask_rcnn_sn_2x.py") and os.path.isfile(path)
    assert model_zoo.get_lazy_config("mask_rcnn_sn_2x").model.backbone.bottom_up.stages.norm.name == "SN"
    with pytest.raises(ValueError, match="unknown model zoo LazyConfig 'common'.*mask_rcnn_sn_2x"):
        model_zoo.get_lazy_config_file("common")


def test_the_repository_files_are_asked_for_by_name(tmp_path):
    """Rendering needs the repository's model_zoo/: without it, an error that says so."""
    with pytest.raises(FileNotFoundError, match="files of the repository"):
        model_zoo.load_measured(str(tmp_path / "measured.json"))
    with pytest.raises(FileNotFoundError, match="run this from a checkout"):
        model_zoo.update_readme(str(tmp_path / "README.md"))


def test_every_catalog_config_exists_and_every_config_is_in_the_catalog():
    on_disk = {name for name in config_names_on_disk() if not name.startswith("demo_")}
    assert set(model_zoo.names()) == on_disk
    assert len(model_zoo.names()) == len(CATALOG)  # no name twice


def test_readme_agrees_with_the_catalog():
    with open(model_zoo.README, encoding="utf-8") as f:
        readme = f.read()
    assert model_zoo.readme_table(readme) == model_zoo.catalog_table(), "run `python -m sn_detection.model_zoo`"


def test_update_readme_rewrites_only_the_table(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(f"intro\n{model_zoo.TABLE_START}\nstale\n{model_zoo.TABLE_END}\noutro\n", encoding="utf-8")
    model_zoo.update_readme(str(path))
    text = path.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith(f"{model_zoo.TABLE_END}\noutro\n")
    assert model_zoo.readme_table(text) == model_zoo.catalog_table()


def test_the_paper_rows_and_their_ap():
    reported = {1: {}, 2: {}, 3: {}}
    for entry in CATALOG:
        if entry.box_ap is not None:
            assert entry.labels() not in reported[entry.setting], entry.name
            ap = entry.box_ap if entry.setting != 3 else (entry.box_ap, entry.mask_ap)
            reported[entry.setting][entry.labels()] = ap
    assert reported == {1: TABLE_3, 2: TABLE_4, 3: TABLE_5}


@pytest.mark.parametrize("entry", CATALOG, ids=lambda entry: entry.name)
def test_config_matches_its_entry(entry):
    cfg = model_zoo.get_config(entry.name)
    assert cfg.MODEL.RESNETS.NORM == entry.backbone
    if entry.setting == 1:
        assert cfg.MODEL.ROI_HEADS.NAME == "Res5ROIHeads" and entry.head == entry.backbone
    else:
        assert cfg.MODEL.ROI_HEADS.NAME == "StandardROIHeads"
        head_norms = [cfg.MODEL.FPN.NORM, cfg.MODEL.ROI_BOX_HEAD.NORM]
        head_norms += [cfg.MODEL.ROI_MASK_HEAD.NORM] if entry.setting == 3 else []
        assert head_norms == [entry.head] * len(head_norms)
        # the normalized heads are the 4conv1fc box head; the "–" baselines, Detectron's 2fc head
        assert (cfg.MODEL.ROI_BOX_HEAD.NUM_CONV, cfg.MODEL.ROI_BOX_HEAD.NUM_FC) == ((4, 1) if entry.head else (0, 2))
    assert cfg.MODEL.MASK_ON == (entry.setting == 3)
    assert cfg.SOLVER.MAX_ITER == ITERATIONS[entry.schedule]
    assert cfg.OUTPUT_DIR == f"output/{entry.name}"


@pytest.mark.parametrize("entry", CATALOG, ids=lambda entry: entry.name)
def test_config_uses_the_weights_and_input_convention_of_its_backbone(entry):
    cfg = model_zoo.get_config(entry.name)
    source = PRETRAINED[entry.pretrained]
    assert cfg.MODEL.WEIGHTS == source.weights
    convention = source.convention
    assert tuple(cfg.MODEL.PIXEL_MEAN) == pytest.approx(convention.pixel_mean)
    assert tuple(cfg.MODEL.PIXEL_STD) == pytest.approx(convention.pixel_std)
    assert cfg.MODEL.RESNETS.STRIDE_IN_1X1 == convention.stride_in_1x1
    assert cfg.INPUT.FORMAT == convention.input_format
    assert cfg.MODEL.BACKBONE.FREEZE_AT == (0 if entry.scratch else 2)


def test_frozen_bn_rows_start_from_weights_with_bn_statistics_or_msra():
    """BN† settings 2-3: Detectron's MSRA R-50; setting 1's BN† and BN: the same torchvision weights."""
    for entry in CATALOG:
        if entry.backbone == "FrozenBN":
            assert entry.pretrained == ("torchvision" if entry.setting == 1 else "msra"), entry.name
        if entry.backbone == "BN" and not entry.scratch:
            assert entry.pretrained == "torchvision", entry.name


def test_measured_numbers_are_a_table_of_their_own():
    table = model_zoo.catalog_table()
    measured = table[table.index("### Measured here") :]
    assert "not the paper's" in measured
    assert (
        "| config | model | iterations | box AP | box AP50 | mask AP | mask AP50 | time | date | commit | notes |"
        in (measured)
    )
    sn = "[demo_mask_rcnn_sn](../configs/demo_mask_rcnn_sn.yaml) | R18, finetuned, 128 px"
    assert f"| {sn} | 1200 | 51.7 | 69.6 | 50.9 | 68.6 | 7 min 14 s | 2026-11-25 | `41dc15f` |" in measured
    assert f"| {sn} | 1200 | 45.4 | 61.5 | 45.0 | 60.5 | 47 min 23 s | 2026-11-26 | `0da9975` |" in measured
    assert {m.config for m in model_zoo.load_measured()} <= config_names_on_disk()


def test_every_measurement_says_where_when_and_on_what_it_ran():
    for m in model_zoo.load_measured():
        assert m.machine and m.date and m.commit and m.command and m.iterations > 0 and m.box_ap is not None, m
        assert m.depth is not None and m.pretrained is not None and m.input_size is not None, m
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", m.date) and re.fullmatch(r"[0-9a-f]{7,40}", m.commit), m


def command_config(command: str) -> tuple[str, list[str]]:
    """The config file and KEY VALUE overrides a measurement's command trains with: a ``tools/train_net.py``
    command line, or ``make demo``, whose training line the Makefile has (its backbone, the pretrained
    file that ``make demo`` passes as MODEL.WEIGHTS, as the value "pretrained")."""
    if command == "make demo":
        with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
            makefile = f.read()
        target = makefile.split("\ndemo:\n", 1)[1].split("\n\n", 1)[0]
        (line,) = [line for line in target.splitlines() if "tools/train_net.py" in line]
        command = line.replace("$$py ", "").replace("$$backbone", "pretrained").strip()
    words = shlex.split(command)
    assert words[0] == "tools/train_net.py" and words[1] == "--config-file", command
    return words[2], words[3:]


@pytest.mark.parametrize("m", model_zoo.load_measured(), ids=lambda m: f"{m.config}-{m.date}-{m.commit}")
def test_every_measured_row_is_a_run_of_its_config_as_it_is(m):
    """A row's model, input and schedule are its config's, with the overrides of its command: a config
    changed since makes its rows wrong (they then go to CHANGELOG.md, or are measured again)."""
    from detectron2.config import get_cfg

    from sn_detection.d2 import add_sn_config
    from sn_detection.pretraining.config import add_pretrain_config

    config, overrides = command_config(m.command)
    assert config == f"configs/{m.config}.yaml", (config, m.config)
    cfg = get_cfg()
    add_sn_config(cfg)
    add_pretrain_config(cfg)
    cfg.merge_from_file(os.path.join(REPO, config))
    cfg.merge_from_list(overrides)
    assert cfg.SOLVER.MAX_ITER == m.iterations
    assert cfg.MODEL.RESNETS.DEPTH == m.depth
    assert bool(cfg.MODEL.WEIGHTS) == m.pretrained
    assert tuple(cfg.INPUT.MIN_SIZE_TRAIN) == (m.input_size,)
    assert m.recipe() == f"R{m.depth}, {'finetuned' if m.pretrained else 'from scratch'}, {m.input_size} px"


def test_a_recipe_of_another_config_is_caught():
    """The check above on a row as the README had it: R50-FPN from scratch at 160 px, 560 iterations."""
    stale = model_zoo.Measurement(
        "demo_mask_rcnn_sn", 560, 9.2, depth=50, pretrained=False, input_size=160, command="make demo"
    )
    with pytest.raises(AssertionError):
        test_every_measured_row_is_a_run_of_its_config_as_it_is(stale)


@pytest.mark.parametrize("m", model_zoo.load_measured(), ids=lambda m: f"{m.config}-{m.date}-{m.commit}")
def test_a_measured_rows_commit_is_in_the_history_on_its_date(m):
    def git(*arguments):
        return subprocess.run(["git", *arguments], cwd=REPO, capture_output=True, text=True)

    checkout = git("rev-parse", "--git-dir")
    if checkout.returncode != 0:
        pytest.skip(f"not a git checkout: {checkout.stderr.strip()}")
    shown = git("show", "-s", "--format=%cd", "--date=format:%Y-%m-%d", f"{m.commit}^{{commit}}")
    if shown.returncode != 0 and git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip(f"a shallow clone, without the history of {m.commit}")
    assert shown.returncode == 0, f"commit {m.commit} of {m.config}'s {m.date} row: {shown.stderr.strip()}"
    assert shown.stdout.strip() == m.date


def test_a_measured_catalog_config_shows_its_longest_run_as_our_ap():
    runs = (
        model_zoo.Measurement("mask_rcnn_sn_2x", 2000, 20.0, 18.5),
        model_zoo.Measurement("mask_rcnn_sn_2x", 1000, 12.3, 11.1),
        model_zoo.Measurement("faster_rcnn_sn_1x", 500, 7.5),
    )
    table = model_zoo.catalog_table(measured=runs)
    assert "| [mask_rcnn_sn_2x](../configs/mask_rcnn_sn_2x.yaml) | SN | SN | sn | 41.0 | 36.5 | 20.0 / 18.5 |" in table
    assert "| [faster_rcnn_sn_1x](../configs/faster_rcnn_sn_1x.yaml) | SN | SN | sn | 39.3 | 7.5 |" in table
    assert "| [mask_rcnn_gn_2x](../configs/mask_rcnn_gn_2x.yaml) | GN | GN | gn | 40.2 | 35.7 | – |" in table


def test_markdown_sections_are_included_in_name_order(tmp_path):
    without = model_zoo.catalog_table(str(tmp_path / "missing"))
    (tmp_path / "b_sweep.md").write_text("### Sweep\n\n| a |\n|---|\n", encoding="utf-8")
    (tmp_path / "a_first.md").write_text("\n### First\n\n", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("not markdown", encoding="utf-8")
    assert model_zoo.catalog_table(str(tmp_path)) == without + "\n### First\n\n### Sweep\n\n| a |\n|---|\n"
