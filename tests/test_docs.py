"""The docs hold: the worked example of docs/adding_a_normalizer.md runs as written (its layer matches the
equation and passes its own tests, so the page cannot drift from the base classes it teaches), every
relative link and anchor of the README and the docs leads somewhere, and none passes through a symbolic link:
the tree holds none (GitHub shows a symbolic link as a file, a checkout without links loses it)."""

import os
import re
import subprocess

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
