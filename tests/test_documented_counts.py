"""The launch and allocation counts the docs state are ``launch_counts.KERNEL_PATH_COUNTS``, which
tests/kernels/test_launches.py holds the code to: the README's "six Triton kernel launches (DN seven, PONO
three)", docs/layers.md's counts of the fused path, and the table of docs/benchmarks.md."""

import os
import re

from sn_detection.benchmarks.launch_counts import KERNEL_PATH_COUNTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}


def read(page: str) -> str:
    """The page as one line of prose (markdown emphasis dropped)."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return " ".join(f.read().replace("**", "").split())


def counts(field: str) -> dict[str, int]:
    return {name: getattr(documented, field) for name, documented in KERNEL_PATH_COUNTS.items()}


def most_and_exceptions(numbers: dict[str, int], exceptions: tuple[str, ...]) -> tuple[int, dict[str, int]]:
    """The count every layer but ``exceptions`` shares (there must be one), and the exceptions' counts."""
    (most,) = {number for name, number in numbers.items() if name not in exceptions}
    return most, {name: numbers[name] for name in exceptions}


def test_the_readme_states_the_training_launches():
    readme = read("README.md")
    match = re.search(
        r"runs its training forward \+ backward in (\w+) Triton kernel launches \(DN (\w+), PONO (\w+)\)", readme
    )
    assert match, "README.md: the launch count sentence is gone or reworded"
    stated = [WORDS[word] for word in match.groups()]
    most, exceptions = most_and_exceptions(counts("training"), ("DN", "PONO"))
    assert stated == [most, exceptions["DN"], exceptions["PONO"]]


def test_the_layers_page_states_the_training_and_inference_launches():
    page = read("docs/layers.md")
    training, inference, pono = (
        re.search(pattern, page)
        for pattern in (
            r"(\d+) launches per training forward \+ backward \(DN (\d+);",
            r"(\d+) per inference \(BNSR (\d+)\)",
            r"PONO, whose statistics are per pixel over the channels, is (\d+) kernels \((\d+) per inference",
        )
    )
    assert training and inference and pono, "docs/layers.md: a count sentence is gone or reworded"
    most, exceptions = most_and_exceptions(
        {name: n for name, n in counts("training").items() if name != "PONO"}, ("DN",)
    )
    assert [int(n) for n in training.groups()] == [most, exceptions["DN"]]
    most, exceptions = most_and_exceptions(
        {name: n for name, n in counts("inference").items() if name != "PONO"}, ("BNSR",)
    )
    assert [int(n) for n in inference.groups()] == [most, exceptions["BNSR"]]
    assert [int(n) for n in pono.groups()] == [
        KERNEL_PATH_COUNTS["PONO"].training,
        KERNEL_PATH_COUNTS["PONO"].inference,
    ]


def test_the_benchmarks_table_states_every_count():
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        section = f.read().split("## Launches per training step", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip().strip("*") for cell in line.strip().strip("|").split("|")] for line in section.splitlines()]
    rows = [row for row in rows if len(row) > 2]
    header = rows[0]
    table = {row[0]: dict(zip(header[1:], row[1:])) for row in rows[2:]}
    for label, field in (
        ("training step: launches (CPU, interpreter)", "training"),
        ("training step: allocations", "allocations"),
        ("inference: launches", "inference"),
    ):
        assert {name: int(table[label][name]) for name in KERNEL_PATH_COUNTS} == counts(field), label
