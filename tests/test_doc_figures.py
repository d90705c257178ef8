"""One place per figure: every measured figure the README's results and speed parts quote is on the page
each part cites (docs/evidence.md or model_zoo/README.md for results, docs/benchmarks.md for speed).

A part is a paragraph of a README section about results, speed or benchmarks that opens with a bold
lead, with what follows it up to the next such paragraph; it cites the repository's markdown pages it
links to, but for the glossary, which defines terms and holds no measurement. A figure is a number with a
unit (%, x, ms, s, min, px, points, iterations, box AP, ...), a difference (+1.3, −4.2), a mean ± spread,
or a tensor shape (2x256x100x168). It is found on a cited page when the page has it verbatim (whitespace
and emphasis aside); a single number with a unit also when a table cell of the page holds the number,
since tables carry the unit in their header; a range a-b also when both its ends are found, since it may
sum up a table's column.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
GLOSSARY = os.path.join("docs", "glossary.md")

_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
_SIGN = r"(?:[+−]|(?<=[\s(])-)"
_UNIT = r"(?:%|x(?!\w)|(?:ms|µs|s|min|h|px|MiB|MB|GB|points|iterations|box AP|mask AP|AP)(?!\w))"
_SHAPE = r"\d+(?:x\d+){3}(?!\w)"
# sign, number, range end, spread, unit; which of them make a figure is decided in `figures`
_MEASURE = (
    rf"(?P<sign>{_SIGN})?(?P<low>{_NUMBER})(?:\s?[-–]\s?(?P<high>{_NUMBER}))?"
    rf"(?P<spread>\s?±\s?{_NUMBER})?(?:\s?(?P<unit>{_UNIT}))?"
)
FIGURE = re.compile(rf"(?<![\w.,-])(?:(?P<shape>{_SHAPE})|{_MEASURE})")
# "0.090 against 0.204 ms": the first number takes the unit of the second
AGAINST = re.compile(rf"(?<![\w.,-])(?P<first>{_NUMBER}) against {_MEASURE}")


def plain(text: str) -> str:
    """Markdown as prose: emphasis marks dropped and every run of whitespace one space."""
    return re.sub(r"\s+", " ", text.replace("*", ""))


def figures(text: str) -> list[str]:
    """The figures of ``text`` in order, each once, read from its prose and tables, not from code spans or
    link targets."""
    text = plain(re.sub(r"`[^`]*`", " ", re.sub(r"\]\([^)]*\)", "]", text)))
    found = []
    for match in FIGURE.finditer(text):
        if match["shape"] or match["unit"] or match["spread"] or match["sign"]:
            found.append(match.group(0).strip())
    for match in AGAINST.finditer(text):
        if match["unit"]:
            found.append(f"{match['first']}{' ' if match['unit'] != 'x' else ''}{match['unit']}")
    return list(dict.fromkeys(found))


def _verbatim(figure: str, page: str) -> bool:
    return re.search(rf"(?<![\w.,]){re.escape(figure)}(?![\d\w])", page) is not None


def found_on(figure: str, page: str) -> bool:
    """Whether ``figure`` is on ``page`` (plain text): verbatim, as a table cell under a header that
    carries its unit, or, for a range, as both its ends."""
    if _verbatim(figure, page):
        return True
    match = FIGURE.fullmatch(figure)
    if not match or match["shape"] or match["spread"] or not match["unit"]:
        return False
    sign, unit = match["sign"] or "", match["unit"]
    space = "" if unit == "x" else " "
    if match["high"]:
        ends = (f"{sign}{match['low']}{space}{unit}", f"{match['high']}{space}{unit}")
        return all(found_on(end, page) for end in ends)
    return re.search(rf"\| {re.escape(sign + match['low'])} \|", page) is not None


def parts(readme: str) -> list[tuple[str, str]]:
    """(lead, text) of each part of the README's sections on results, speed or benchmarks."""
    sections = re.split(r"^## ", readme, flags=re.MULTILINE)[1:]
    found = []
    for section in sections:
        title = section.splitlines()[0]
        if not re.search(r"result|speed|benchmark", title, flags=re.IGNORECASE):
            continue
        for chunk in re.split(r"^(?=\*\*)", section, flags=re.MULTILINE):
            lead = re.match(r"\*\*(.+?)\*\*", chunk)
            found.append((lead[1] if lead else title, chunk))
    return found


def cited_pages(text: str, base: str) -> list[str]:
    """The markdown files of the repository that ``text`` (a file in folder ``base``) links to, but for the
    glossary."""
    pages = []
    for target in re.findall(r"\]\(([^)\s#]+\.md)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            path = os.path.normpath(os.path.join(base, target))
            if os.path.isfile(path) and path not in pages and not path.endswith(GLOSSARY):
                pages.append(path)
    return pages


def figures_not_on_cited_pages(readme_path: str) -> list[str]:
    """One line per part of the README whose figures its cited pages lack, or that cites none."""
    with open(readme_path, encoding="utf-8") as f:
        readme = f.read()
    base = os.path.dirname(readme_path)
    problems = []
    for lead, text in parts(readme):
        quoted = figures(text)
        if not quoted:
            continue
        pages = cited_pages(text, base)
        if not pages:
            problems.append(f"'{lead}' quotes {quoted} but links to no page that holds them")
            continue
        texts = []
        for page in pages:
            with open(page, encoding="utf-8") as f:
                texts.append(plain(f.read()))
        missing = [figure for figure in quoted if not any(found_on(figure, page) for page in texts)]
        if missing:
            names = ", ".join(os.path.relpath(page, base) for page in pages)
            problems.append(f"'{lead}' quotes figures that {names} do not have: {missing}")
    return problems


def test_the_readme_figures_are_on_the_pages_it_cites():
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    quoting = [lead for lead, text in parts(readme) if figures(text)]
    assert len(quoting) >= 2, f"README.md: expected a results and a speed part with figures, found {quoting}"
    problems = figures_not_on_cited_pages(README)
    assert not problems, "README.md and the pages it cites disagree:\n" + "\n".join(problems)


def test_figures_are_read_from_prose_and_tables_not_from_code():
    text = (
        "SN reaches 83.2-84.8 % top-1 against 48.7-68.9 % in 840 iterations, +1.3 ± 0.6 box AP, a third draw\n"
        "(+11.4); kernels 0.090 against 0.204 ms at 2x256x100x168, `--rounds 30` [b](docs/b.md), R18-FPN,\n"
        "| SN layer | 1.10-1.31x | 1.09x | 160 px | 7 of 10 | 2026-11-28 | top-1 against 45 % |"
    )
    assert figures(text) == [
        "83.2-84.8 %",
        "48.7-68.9 %",
        "840 iterations",
        "+1.3 ± 0.6 box AP",
        "+11.4",
        "0.204 ms",
        "2x256x100x168",
        "1.10-1.31x",
        "1.09x",
        "160 px",
        "45 %",
        "0.090 ms",
    ]


def test_a_figure_is_found_verbatim_in_a_table_cell_or_by_its_range_ends():
    page = plain("a ratio of 1.18x, **0.090 ms** | GN | **1.40** | 1.27-1.50 |\n| SN | 1.10x / 1.11x | 1.31x |")
    assert found_on("1.18x", page) and found_on("0.090 ms", page) and found_on("1.40x", page)
    assert found_on("1.10-1.31x", page) and found_on("1.27-1.50", page)
    assert not found_on("18x", page)  # the end of 1.18x is not a figure of its own
    assert not found_on("1.10-1.32x", page) and not found_on("0.09 ms", page) and not found_on("1.27 %", page)


def test_a_mismatch_is_reported_with_its_part_and_page(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text("| SN | 1.29x | 2.22x | **0.090 ms** | 0.204 ms |\n", "utf-8")
    (tmp_path / "docs" / "evidence.md").write_text("SN 83.2-84.8 %, GN 48.7-64.8 %\n", encoding="utf-8")
    (tmp_path / "docs" / "glossary.md").write_text("Not a source: 0.21 ms, 0.09 ms, 83-85 %\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n## Results\n\n**Finetuning** ([evidence](docs/evidence.md)): SN 83-85 % against 48.7-64.8 %.\n\n"
        "**Speed** ([benchmarks](docs/benchmarks.md#one-layer), [terms](docs/glossary.md#gate)): 1.29-2.22x; 0.09 "
        "against 0.21 ms.\n\n"
        "**Unsourced**: 3.5x.\n\n## Citing\n\n1.5x\n",
        encoding="utf-8",
    )
    assert figures_not_on_cited_pages(str(readme)) == [
        "'Finetuning' quotes figures that docs/evidence.md do not have: ['83-85 %']",
        "'Speed' quotes figures that docs/benchmarks.md do not have: ['0.21 ms', '0.09 ms']",
        "'Unsourced' quotes ['3.5x'] but links to no page that holds them",
    ]
    fixed = readme.read_text("utf-8").replace("83-85", "83.2-84.8").replace("**Unsourced**: 3.5x.", "")
    readme.write_text(fixed.replace("0.09 against 0.21", "0.090 against 0.204"), encoding="utf-8")
    assert figures_not_on_cited_pages(str(readme)) == []
