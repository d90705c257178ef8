"""The docs hold: the worked example of docs/adding_a_normalizer.md runs as written (its layer matches the
equation and passes its own tests, so the page cannot drift from the base classes it teaches), every
relative link and anchor of the README and the docs leads somewhere, and none passes through a symbolic link:
the tree holds none (GitHub shows a symbolic link as a file, a checkout without links loses it)."""

import os
import re
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "adding_a_normalizer.md")


def python_blocks(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.MULTILINE | re.DOTALL)


@pytest.mark.usefixtures("one_thread")
def test_adding_a_normalizer_runs_as_written():
    blocks = python_blocks(DOC)
    assert len(blocks) == 2  # the module, then its tests (which the second block calls)
    namespace = {"__name__": "adding_a_normalizer"}
    for block in blocks:
        exec(compile(block, DOC, "exec"), namespace)
    layer = namespace["InstanceNorm2d"](8)
    assert layer.norm_identity() == "InstanceNorm2d(eps=1e-05)"
    with pytest.raises(ValueError, match="eps=-1 is invalid"):
        namespace["InstanceNorm2d"](8, eps=-1)


PAGES = ["README.md", "CHANGELOG.md", "model_zoo/README.md", "configs/README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _through_a_link(path: str, root: str) -> bool:
    """Whether ``path`` or a folder between ``root`` and it is a symbolic link."""
    parts = os.path.relpath(path, root).split(os.sep)
    return any(os.path.islink(os.path.join(root, *parts[: i + 1])) for i in range(len(parts)))


def broken_links(path: str, root: str = ROOT) -> list[str]:
    """The relative links and anchors of the markdown file ``path`` that lead nowhere, or only through a
    symbolic link under ``root`` (on GitHub such a link leads nowhere)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img src="([^"]+)"', text)
    broken = []
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(linked) or _through_a_link(linked, root):
            broken.append(target)
        elif anchor and linked.endswith(".md"):
            with open(linked, encoding="utf-8") as f:
                headings = re.findall(r"^#+ (.+)$", f.read(), flags=re.MULTILINE)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    broken = broken_links(os.path.join(ROOT, page))
    assert not broken, f"{page}: links that lead nowhere (or through a symbolic link): {broken}"


def test_a_link_through_a_symbolic_link_is_broken(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "page.md").write_text("# Title\n", encoding="utf-8")
    (tmp_path / "linked").symlink_to("real", target_is_directory=True)
    index = tmp_path / "index.md"
    index.write_text("[a](real/page.md#title) [b](linked/page.md#title) [c](linked)", encoding="utf-8")
    assert broken_links(str(index), str(tmp_path)) == ["linked/page.md#title", "linked"]


def test_the_tree_holds_no_symbolic_links():
    """Every file of the checkout that git tracks or would add is a real file or folder."""
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    links = [name for name in listed.stdout.split("\0") if name and os.path.islink(os.path.join(ROOT, name))]
    assert not links, f"symbolic links in the tree (GitHub shows them as files): {links}"


STOCK_CONFIG = os.path.join(ROOT, "docs", "detectron2.md")
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def test_the_stock_config_snippet_is_written_once():
    """docs/detectron2.md holds it; every other page links there rather than keeping a copy that drifts."""
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            copies = f.read().count('cfg.MODEL.META_ARCHITECTURE = "SNMetaArch"')
        assert copies == (1 if os.path.join(ROOT, page) == STOCK_CONFIG else 0), page
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    with open(STOCK_CONFIG, encoding="utf-8") as f:
        page = " ".join(f.read().split())
    assert "(docs/detectron2.md#a-stock-detectron2-config" in readme
    lines = r"takes our norms with (\w+) lines"
    assert re.findall(lines, readme) == re.findall(lines, page) and len(re.findall(lines, page)) == 1


@pytest.mark.usefixtures("one_thread")
def test_the_stock_config_snippet_predicts_with_the_trained_model_it_names(tmp_path, monkeypatch):
    """The block of docs/detectron2.md as written, with a model saved where its MODEL.WEIGHTS says (trained
    nowhere: the weights only need to be the file's); on the CPU here, at a small input size."""
    import torch
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.modeling import build_model

    from sn_detection.layers import SwitchableNorm2d

    with open(STOCK_CONFIG, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## A stock detectron2 config", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    lines = block.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("cfg = model_zoo.get_config("))
    weights = next(i for i, line in enumerate(lines) if line.startswith("cfg.MODEL.WEIGHTS = "))
    # "takes our norms with N lines": the lines between the stock config and its weights
    (stated,) = re.findall(r"takes our norms with (\w+) lines", " ".join(section.split()))
    assert NUMBERS[stated] == weights - first - 1, lines[first + 1 : weights]
    *setup, last = lines
    assert last == "predictor = DefaultPredictor(cfg)"

    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile("\n".join(setup), STOCK_CONFIG, "exec"), namespace)
    cfg = namespace["cfg"]
    path = cfg.MODEL.WEIGHTS
    assert path.endswith("model_final.pth") and not path.startswith(("detectron2://", "catalog://"))
    cfg.MODEL.DEVICE = "cpu"
    cfg.INPUT.MIN_SIZE_TEST, cfg.INPUT.MAX_SIZE_TEST = 64, 96
    trained = build_model(cfg)
    for module in trained.modules():
        if isinstance(module, SwitchableNorm2d):
            torch.nn.init.normal_(module.mean_weight)  # not the initial, equal logits: weights of the file
    os.makedirs(os.path.dirname(path))
    DetectionCheckpointer(trained, save_dir=os.path.dirname(path)).save("model_final")
    exec(compile(last, STOCK_CONFIG, "exec"), namespace)
    predictor = namespace["predictor"]
    norms = [m for m in predictor.model.backbone.modules() if isinstance(m, SwitchableNorm2d)]
    assert len(norms) == 53 + 4 + 4  # the ResNet-50's, and the FPN's lateral and output convolutions'
    expected = dict(trained.named_parameters())
    for name, parameter in predictor.model.named_parameters():
        torch.testing.assert_close(parameter, expected[name], rtol=0, atol=0, msg=name)
    predictor(np.zeros((48, 64, 3), dtype=np.uint8))  # predicts


def _constants(path: str) -> dict:
    """The module-level constants and the functions' keyword defaults of the test file ``path`` (read, not
    imported: the CUDA tests skip at import without a GPU)."""
    import ast

    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:  # not a literal: no constant of the test's
                pass
        elif isinstance(node, ast.FunctionDef) and node.args.defaults:
            names = [argument.arg for argument in node.args.args][-len(node.args.defaults) :]
            for name, default in zip(names, node.args.defaults):
                if isinstance(default, ast.Constant):
                    found[f"{node.name}.{name}"] = default.value
    return found


def _tolerance(value: float) -> str:
    """1e-4 as the docs write it."""
    return re.sub(r"e-0*", "e-", f"{value:.0e}")


def _prose(page: str) -> str:
    with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as f:
        return " ".join(f.read().split())


def test_the_cuda_graph_agreement_the_docs_state_is_their_tests_tolerance():
    """docs/pretraining.md and docs/training.md give the tolerances of the CUDA tests of the two CUDA-graph
    features as such, with the tests' values, and say that those tests have not run on a GPU."""
    pretraining = _constants("tests/pretraining/test_graphed_pretraining_cuda.py")
    fp32, amp = pretraining["TOLERANCE"][False], pretraining["TOLERANCE"][True]
    assert (
        f"requires the losses of {pretraining['ITERATIONS']} iterations and the backbone after them to equal "
        f"eager training's within a tolerance of rtol {_tolerance(fp32['rtol'])}, atol {_tolerance(fp32['atol'])} "
        f"(rtol {_tolerance(amp['rtol'])}, atol {_tolerance(amp['atol'])} with `PRETRAIN.AMP`): a test's "
        "tolerance, not a measured agreement, and that test has not run on a GPU yet"
    ) in _prose("pretraining.md")
    backbone = _constants("tests/d2/test_graphed_backbone.py")
    assert (
        f"within a tolerance of {_tolerance(backbone['assert_same.tolerance'])} of each tensor's largest "
        "magnitude (outputs, gradients and weights; running statistics 1e-5), also under autocast and in DDP: "
        "a test's tolerance, not a measured agreement, and those tests have not run on a GPU yet"
    ) in _prose("training.md")
    with open(os.path.join(ROOT, "tests", "d2", "test_graphed_backbone.py"), encoding="utf-8") as f:
        assert "assert_close(buffer.double(), buffers[name].double(), 1e-5)" in f.read()
    with open(os.path.join(ROOT, "docs", "compatibility.md"), encoding="utf-8") as f:
        (not_run,) = [line for line in f if line.startswith("| [GPU](#gpus), the code since")]
    assert "not run on a GPU" in not_run and "`PRETRAIN.CUDA_GRAPH` and the graphed backbone" in not_run


def test_the_readmes_first_screen_says_what_ran_where():
    """Before its first section the README says where its results were measured, that no COCO-trained model
    ships (the model zoo measured no COCO config), and what of the GPU path ran on a GPU, as the table of
    docs/compatibility.md it links has it."""
    from sn_detection import model_zoo

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        first_screen = " ".join(f.read().split("\n## ", 1)[0].split())
    assert "(docs/compatibility.md#what-ran-where)" in first_screen
    assert "Every AP this project measured comes from a 2-core CPU at small scale" in first_screen
    assert "on the embedded synthetic shapes" in first_screen
    assert "no COCO-trained model ships yet" in first_screen
    assert not {m.config for m in model_zoo.load_measured()} & set(model_zoo.names())  # the catalog is COCO's
    with open(os.path.join(ROOT, "docs", "compatibility.md"), encoding="utf-8") as f:
        table = f.read()
    (ran,) = re.findall(r"^\| \[GPU\]\(#gpus\), at commit (\w+) \|", table, flags=re.MULTILINE)
    assert f"the Triton kernels passed their tests at commit {ran}" in first_screen
    (not_run,) = [line for line in table.splitlines() if line.startswith("| [GPU](#gpus), the code since")]
    for feature in ("call plans", "statistics blocks", "direct launch"):
        assert f"[{feature}]" in not_run and f"[{feature}]" in first_screen, feature
    assert "`PRETRAIN.CUDA_GRAPH` and the graphed backbone" in not_run
    assert "both CUDA-graph features have not run on a GPU yet" in first_screen
