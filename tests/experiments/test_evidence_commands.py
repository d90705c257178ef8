"""The command sequences of docs/evidence.md hold together: in each code block, the settings file a
``compare_norms.py --backbones`` command reads is one that the ``pretrain_grid.py --publish`` command before
it writes, and the sequence of "Each norm's own pretraining recipe" runs as written on a tiny plan (one
norm, one learning rate, a few iterations, the published files under a temporary folder): the grid
publishes, and the finetune sweep reads what it published and plans its runs from the grid's backbone."""

import os
import re
import shlex

from tiny_pretraining import tiny_pretrain_keys

from sn_detection.engine.launch import load_cfg
from sn_detection.experiments.compare_norms import cli as compare_norms
from sn_detection.experiments.compare_norms.runs import initial_weights
from sn_detection.experiments.pretrain_grid import cli as pretrain_grid
from sn_detection.experiments.pretrain_grid import plan as grid_plan
from sn_detection.experiments.pretrain_grid.plan import Cell, cell_cfg
from sn_detection.experiments.pretrain_grid.publish import published_settings
from sn_detection.pretraining.cache import cached_backbone_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "evidence.md")
FENCE = re.compile(r"^[ \t]*```bash\n(.*?)^[ \t]*```", flags=re.MULTILINE | re.DOTALL)
SECTIONS = "model_zoo/sections/"


def blocks() -> list[list[list[str]]]:
    """Each bash block of the page as its commands, each the shell words of one logical line (continuation
    lines joined, the comment dropped)."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    found = []
    for block in FENCE.finditer(text):
        logical = re.sub(r"\\\n", " ", block.group(1))
        found.append([shlex.split(line, comments=True) for line in logical.splitlines() if line.strip()])
    return found


def flag(words: list[str], name: str) -> str | None:
    """The value of ``name`` in ``words``, brackets of an optional part stripped; None without it."""
    words = [word.strip("[]") for word in words]
    return words[words.index(name) + 1] if name in words else None


def sequences() -> list[tuple[list[str], list[str]]]:
    """(grid command, sweep command) of every ``compare_norms.py --backbones`` command, with the nearest
    ``pretrain_grid.py`` command before it in its block (None where there is none)."""
    pairs = []
    for commands in blocks():
        grid = None
        for words in commands:
            if words[0] == "tools/pretrain_grid.py":
                grid = words
            elif words[0] == "tools/compare_norms.py" and flag(words, "--backbones"):
                pairs.append((grid, words))
    return pairs


def without_optional_parts(words: list[str]) -> list[str]:
    """``words`` without the ``[...]`` parts (optional flags and their values)."""
    kept, depth = [], 0
    for word in words:
        depth += word.count("[")
        if not depth:
            kept.append(word)
        depth -= word.count("]")
    return kept


def test_every_settings_file_a_sweep_reads_is_one_the_grid_before_it_publishes():
    pairs = sequences()
    assert len(pairs) == 3, pairs  # the grid's best, then best and equal top-1
    for grid, sweep in pairs:
        assert grid is not None, f"no pretrain_grid.py command before {' '.join(sweep)}"
        published = flag(grid, "--publish")
        assert published and "[--publish" not in grid, f"{' '.join(grid)}: publishes nothing for the sweep after it"
        files = published_settings(published)
        readable = {files["best.json"]} | ({files["equal_top1.json"]} if "--equal-top1" in grid else set())
        assert flag(sweep, "--backbones") in readable, (grid, sweep)


def test_the_documented_settings_files_are_the_repositorys():
    """What the sweeps read on a machine without the grid's output: the published files exist."""
    for _, sweep in sequences():
        assert os.path.isfile(os.path.join(ROOT, flag(sweep, "--backbones"))), sweep


def test_the_grid_then_the_sweep_run_as_written_on_a_tiny_plan(tmp_path, monkeypatch, tiny_classification_set):
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    grid, sweep = sequences()[0]
    assert "--equal-top1" not in grid

    def here(words):
        # the tool's arguments as written, less optional parts, the published files under tmp_path
        return [word.replace(SECTIONS, f"{tmp_path}/sections/") for word in without_optional_parts(words[1:])]

    tiny = tiny_pretrain_keys(tiny_classification_set)
    grid_args = [*here(grid), "--norms", "BN", "--lrs", "0.1", "--estimate-steps", "0"]
    grid_args += ["--output-dir", str(tmp_path / "grid"), *tiny]
    assert pretrain_grid.main(grid_args) == 0
    published = flag(here(grid), "--publish")
    assert os.path.isfile(published) and os.path.isfile(published_settings(published)["best.json"])

    sweep_args = [*here(sweep), "--settings", "FrozenBN/GN", "--seeds", "1", "--output-dir", str(tmp_path / "sweep")]
    assert compare_norms.main(["--plan-only", *sweep_args, *tiny]) == 0
    _, _, _, runs = compare_norms.plan_sweep(compare_norms.parse_args([*sweep_args, *tiny]))
    (run,) = runs
    cfg = load_cfg(grid_plan.DEFAULT_CONFIG, tiny)
    assert initial_weights(run.train_args) == cached_backbone_path(
        cell_cfg(cfg, Cell("BN", (("PRETRAIN.BASE_LR", 0.1),)))
    )
    assert os.path.isfile(initial_weights(run.train_args))  # the grid's cell: in the cache, nothing to pretrain
