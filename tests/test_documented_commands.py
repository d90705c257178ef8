"""Every ``tools/*.py`` command written in the docs runs as written, as far as its command line goes: the tool
exists, its parser (``build_parser()`` of the module whose ``main`` the tool runs) takes every flag and value
written, a ``configs/`` file named exists, and the trailing overrides are the config's: KEY VALUE pairs of
keys the config has, with values of their type, or a LazyConfig's key=value. Nothing is run.

Written means every ``tools/NAME.py`` in a fenced code block (a line and its continuations, lines ending in a
backslash) or in inline code (which may wrap) of README.md, docs/*.md, model_zoo/README.md and
configs/README.md, up to the end of its shell command (``;``, ``&&``, ``|``, a ``#`` comment). Placeholders:
``[...]`` marks an optional part, parsed as written (its flags must exist); ``{a,b}`` is one of its choices,
each parsed; ``...``, ``KEY VALUE`` and ``key=value`` stand for more and are dropped (``A,B,...`` keeps A,B);
``<text>`` is a value; an upper-case word as a flag's value that the flag's type refuses (``N``, ``IOU``) is
read as 1. Inline code names a tool with some of its flags, so what it leaves out (required arguments, the
last flag's value) is filled in; a code block's command must be complete unless it elides with ``...``.
"""

import argparse
import contextlib
import functools
import importlib.util
import io
import itertools
import os
import re
import shlex
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "model_zoo/README.md", "configs/README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)
TOOL = re.compile(r"(?<![\w/.-])tools/(\w+)\.py(?![\w.])")
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", flags=re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"(`+)(.+?)\1", flags=re.DOTALL)
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")  # N, FILE, IMAGE_OR_GLOB; never a config key (those have a dot)
DROPPED = {"...", "KEY", "VALUE", "key=value"}
NUMBER = re.compile(r"-?\d+(\.\d*)?(e-?\d+)?")
# the config whose keys a command's KEY VALUE overrides are checked against when it names none we can read
DEFAULT_CONFIG = "configs/demo_mask_rcnn_gn.yaml"


@dataclass(frozen=True)
class Written:
    page: str
    line: int
    words: tuple  # the shell words from the tool's path to the end of its command
    complete: bool  # a code block's command that elides nothing: it must hold every required argument

    @property
    def tool(self) -> str:
        return TOOL.match(self.words[0]).group(1)

    def __str__(self):
        return f"{self.page}:{self.line}: `{' '.join(self.words)}`"


def _shell_words(text: str) -> tuple:
    """The words of ``text`` (which starts at a tool's path) up to the end of its shell command."""
    # a <placeholder> is one word, not two redirections
    text = re.sub(r"<[^<>\n]+>", lambda placeholder: re.sub(r"\s+", "_", placeholder.group(0)), text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    words = []
    try:
        for word in lexer:
            if set(word) <= set(";&|()") or re.match(r"\d?>", word):
                break
            words.append(word)
    except ValueError:  # an unclosed quote: the words up to it
        pass
    return tuple(words)


def _elides(words) -> bool:
    return "..." in (word.strip("[]") for word in words)


def written_commands(page: str, text: str) -> list[Written]:
    """Every tools/*.py command of the markdown ``text`` of ``page``."""
    commands = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        index = 0
        while index < len(lines):
            start, logical = index, lines[index]
            while logical.rstrip().endswith("\\") and index + 1 < len(lines):
                index += 1
                logical = logical.rstrip()[:-1] + " " + lines[index]
            for match in TOOL.finditer(logical):
                words = _shell_words(logical[match.start() :])
                commands.append(Written(page, first + start, words, not _elides(words)))
            index += 1
    # the prose: code blocks blanked, so that line numbers hold and no inline span starts inside a block
    prose = FENCE.sub(lambda block: re.sub(r"[^\n]", " ", block.group(0)), text)
    for span in INLINE.finditer(prose):
        code = span.group(2)
        if re.search(r"\n[ \t]*\n", code):  # a lone backtick: inline code ends with its paragraph
            continue
        line = prose.count("\n", 0, span.start()) + 1
        for match in TOOL.finditer(code):
            words = _shell_words(re.sub(r"\s+", " ", code[match.start() :]))
            commands.append(Written(page, line + code.count("\n", 0, match.start()), words, False))
    return sorted(commands, key=lambda command: command.line)


@functools.cache
def tool_parser(name: str) -> argparse.ArgumentParser:
    """The parser of tools/NAME.py: ``build_parser()`` of the module of the ``main`` it runs."""
    spec = importlib.util.spec_from_file_location(f"documented_tool_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)  # not as __main__: the tool's main does not run
    return sys.modules[tool.main.__module__].build_parser()


def _arguments_written(command: Written) -> list[str]:
    """The arguments of a written command, placeholders read as the module docstring says."""
    words = []
    for word in command.words[1:]:
        word = word.lstrip("[").rstrip("]")
        word = word[:-4] if word.endswith(",...") else word
        if word and word not in DROPPED:
            words.append(word)
    return words


def _variants(words: list[str]) -> list[list[str]]:
    """One argument list per combination of the ``{a,b}`` choices written."""
    options = [word[1:-1].split(",") if re.fullmatch(r"\{[^{}]+\}", word) else [word] for word in words]
    return [list(variant) for variant in itertools.product(*options)]


def _is_flag(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not NUMBER.fullmatch(word)


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    """The action a flag names: its option string, or an unambiguous prefix of one (argparse takes both)."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    if flag in actions:
        return actions[flag]
    prefixed = {action for option, action in actions.items() if option.startswith(flag)}
    return prefixed.pop() if parser.allow_abbrev and flag.startswith("--") and len(prefixed) == 1 else None


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and action.nargs != "?"


def _sample(action: argparse.Action) -> str:
    """A value ``action`` accepts, for a placeholder or a value that inline code leaves out."""
    if action.choices:
        return str(list(action.choices)[0])
    return "1"


def _read_placeholder(action: argparse.Action, word: str) -> str:
    if not PLACEHOLDER.fullmatch(word) or action.type is None or action.choices:
        return word
    try:
        action.type(word)
        return word
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return _sample(action)


def _arguments(parser, words: list[str], complete: bool) -> tuple[list[str], list[str]]:
    """The argument list to parse (placeholders read; what inline code leaves out filled in), and the flags
    that the parser does not know."""
    arguments, unknown, given, bare = [], [], set(), 0
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if not _is_flag(word):
            arguments.append(word)
            bare += 1
            continue
        flag, attached, value = word.partition("=")
        action = _action(parser, flag)
        if action is None:
            unknown.append(flag)
            continue
        given.add(action)
        arguments.append(word)
        if attached or action.nargs == 0:
            continue
        count = action.nargs if isinstance(action.nargs, int) else 1 if action.nargs in (None, "?") else len(words)
        taken = 0
        while taken < count and index < len(words) and not _is_flag(words[index]):
            arguments.append(_read_placeholder(action, words[index]))
            index, taken = index + 1, taken + 1
        if taken == 0 and _takes_value(action) and not complete and index == len(words):
            arguments.append(_sample(action))  # inline code naming a flag without its value
    if not complete:
        required = [a for a in parser._actions if a.required and a.option_strings and a not in given]
        required += [
            group._group_actions[0]
            for group in parser._mutually_exclusive_groups
            if group.required and not given & set(group._group_actions)
        ]
        positional = [a for a in parser._actions if not a.option_strings and a.nargs not in ("?", "*", "...")]
        filled = [word for action in required for word in (action.option_strings[0], _sample(action))]
        arguments = ["x"] * max(0, len(positional) - bare) + filled + arguments
    return arguments, unknown


def _parse(parser: argparse.ArgumentParser, arguments: list[str]):
    """The namespace, or argparse's error message."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return parser.parse_args(arguments), None
        except SystemExit:
            return None, stderr.getvalue().strip().splitlines()[-1].partition("error: ")[2]


def _override_problem(namespace: argparse.Namespace) -> str | None:
    """Whether the trailing overrides are flags put too late, or not of the config."""
    opts = list(getattr(namespace, "opts", None) or [])
    late = [word for word in opts if word.startswith("--")]
    if late:
        return f"{late} after the config overrides would be read as overrides: put the flags before them"
    config = getattr(namespace, "config_file", None) or ""
    lazy = config.endswith(".py") or any("=" in word for word in opts)
    if lazy:
        pairs = [word for word in opts if not re.fullmatch(r"[\w.\[\]]+=.*", word)]
        return f"a LazyConfig takes key=value overrides, not {pairs}" if pairs else None
    if not opts:
        return None
    from sn_detection.engine.launch import load_cfg

    readable = config if os.path.isfile(os.path.join(ROOT, config)) and config.endswith(".yaml") else DEFAULT_CONFIG
    try:
        load_cfg(os.path.join(ROOT, readable), opts)
    except Exception as error:  # yacs' own errors: a key it lacks, a value of another type, an odd count
        return f"KEY VALUE overrides {opts} on {readable}: {type(error).__name__}: {error}"
    return None


def problems(command: Written) -> list[str]:
    """What in ``command`` would not run as written; empty where it would."""
    name = command.tool
    if not os.path.isfile(os.path.join(ROOT, "tools", f"{name}.py")):
        tools = sorted(file for file in os.listdir(os.path.join(ROOT, "tools")) if file.endswith(".py"))
        return [f"tools/{name}.py does not exist; the tools are {tools}"]
    parser = tool_parser(name)
    words = _arguments_written(command)
    files = [path for word in words for path in re.findall(r"(?:^|=)(configs/\S+)", word)]
    found = [f"{path} does not exist" for path in files if not os.path.exists(os.path.join(ROOT, path))]
    if not words and not command.complete:
        return found  # inline code naming the tool alone
    flags = sorted(option for action in parser._actions for option in action.option_strings)
    for variant in _variants(words):
        arguments, unknown = _arguments(parser, variant, command.complete)
        if unknown:
            found.append(f"tools/{name}.py has no flag {', '.join(unknown)}; its flags are {', '.join(flags)}")
            continue
        namespace, error = _parse(parser, arguments)
        problem = error or _override_problem(namespace)
        if problem:
            found.append(problem if arguments == words else f"read as `{shlex.join(arguments)}`: {problem}")
    return list(dict.fromkeys(found))


def page_problems(page: str, text: str) -> list[str]:
    return [f"{command}: {problem}" for command in written_commands(page, text) for problem in problems(command)]


@pytest.mark.parametrize("page", PAGES)
def test_every_written_command_parses(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        found = page_problems(page, f.read())
    assert not found, "commands that do not run as written:\n" + "\n".join(found)


def test_every_tool_is_written_somewhere():
    """Every tool has a documented command, so the search above does find them (and a tool nobody can
    learn about from the docs fails here)."""
    written = set()
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            written |= {command.tool for command in written_commands(page, f.read())}
    tools = {file[:-3] for file in os.listdir(os.path.join(ROOT, "tools")) if file.endswith(".py")}
    assert tools <= written, f"tools no page shows: {sorted(tools - written)}"


SELF_TEST_PAGE = """\
A good command, over two lines:

```bash
tools/train_net.py --config-file configs/demo_mask_rcnn_gn.yaml --num-gpus 2 \\
    SOLVER.MAX_ITER 10   # a comment
tools/no_such_tool.py --config-file CONFIG
tools/train_net.py --config-file CONFIG --num-gpu 2 --no-such-flag
```

Inline code that wraps, with placeholders: `tools/convert_pretrained.py SRC DST --source {sn,torchvision,gn}
[--norm {BN,SN,GN}]`, and `tools/benchmark_norms.py --device cpu,cuda`; `tools/demo.py --num-images N` (its
required --config-file left out); `tools/convert_pretrained.py x.pth y.pkl --source {sn,caffe}`.

```bash
tools/train_net.py --config-file configs/no_such_config.yaml SOLVER.MAX_ITER 10 --resume
tools/train_net.py --config-file CONFIG SOLVER.NO_SUCH_KEY 10 && tools/demo.py --config-file CONFIG
tools/benchmark_train.py --config-file configs/lazy/demo_mask_rcnn_sn.py SOLVER.MAX_ITER 10
tools/demo.py --num-images 8
```
"""


def test_the_check_finds_what_would_not_run():
    found = page_problems("self_test.md", SELF_TEST_PAGE)
    expected = [
        ("self_test.md:6: `tools/no_such_tool.py --config-file CONFIG`", "tools/no_such_tool.py does not exist"),
        ("self_test.md:7: `tools/train_net.py", "has no flag --no-such-flag"),
        (
            "self_test.md:11: `tools/benchmark_norms.py --device cpu,cuda`",
            "argument --device: invalid choice: 'cpu,cuda' (choose from 'cpu', 'cuda')",
        ),
        (
            "self_test.md:12: `tools/convert_pretrained.py x.pth y.pkl --source {sn,caffe}`",
            "argument --source: invalid choice: 'caffe'",
        ),
        ("self_test.md:15: `tools/train_net.py", "configs/no_such_config.yaml does not exist"),
        ("self_test.md:15: `tools/train_net.py", "['--resume'] after the config overrides"),
        (
            "self_test.md:16: `tools/train_net.py --config-file CONFIG SOLVER.NO_SUCH_KEY 10`",
            "Non-existent key: SOLVER.NO_SUCH_KEY",
        ),
        ("self_test.md:17: `tools/benchmark_train.py", "a LazyConfig takes key=value overrides"),
        ("self_test.md:18: `tools/demo.py --num-images 8`", "the following arguments are required: --config-file"),
    ]
    for where, what in expected:
        assert [line for line in found if line.startswith(where) and what in line], (where, what, found)
    assert len(found) == len(expected), "\n".join(found)
