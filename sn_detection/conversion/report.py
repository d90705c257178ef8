"""What a conversion did to every key, and the error it raises when the input is not what it expects."""

from collections import defaultdict
from dataclasses import dataclass, field

from .conventions import INPUT_CONVENTIONS

# How many lines of a list the short report shows; the verbose one shows all.
_SHOWN_CONVERTED = 6
_SHOWN_PROBLEMS = 20


@dataclass
class ConversionReport:
    """Per key: converted (source -> detectron2 name), initialised (detectron2 keys the source has no
    value for, filled from the target layer's own initialisation), skipped (source keys dropped, with
    why), mismatched (source keys whose shape does not fit the architecture) and missing (source keys
    the layout requires but the file lacks)."""

    source: str
    norm: str = ""
    architecture: str = ""
    converted: list[tuple[str, str]] = field(default_factory=list)
    initialised: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    mismatched: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing)

    def format(self, verbose: bool = False) -> str:
        title = f"source {self.source!r}"
        if self.architecture:
            title += f": {self.architecture}"
        if self.norm:
            title += f" -> detectron2 ResNet keys for norm {self.norm}"
        lines = [title, f"  converted: {len(self.converted)}"]
        lines += _capped([f"    {src} -> {dst}" for src, dst in self.converted], verbose, _SHOWN_CONVERTED)
        lines.append(f"  initialised from the layer's init: {len(self.initialised)}")
        lines += _grouped(self.initialised, verbose)
        lines.append(f"  skipped: {len(self.skipped)}")
        lines += _grouped(self.skipped, verbose)
        lines.append(f"  mismatched: {len(self.mismatched)}")
        lines += _capped([f"    {key}: {problem}" for key, problem in self.mismatched], verbose)
        lines.append(f"  missing: {len(self.missing)}")
        lines += _capped([f"    {key}" for key in self.missing], verbose)
        lines += [f"  note: {note}" for note in self.notes]
        convention = INPUT_CONVENTIONS[self.source]
        lines += [
            "  input convention of this source (set in the config):",
            f"    MODEL.PIXEL_MEAN {list(convention.pixel_mean)}",
            f"    MODEL.PIXEL_STD {list(convention.pixel_std)}",
            f"    MODEL.RESNETS.STRIDE_IN_1X1 {convention.stride_in_1x1}",
            f"    INPUT.FORMAT {convention.input_format}",
        ]
        return "\n".join(lines)

    def format_problems(self, verbose: bool = False) -> str:
        """What a refused conversion found wrong: the mismatched and missing keys (and, when verbose, the
        skipped ones); none of the converted keys or the input convention, which only a written file has."""
        lines = []
        if self.mismatched:
            lines.append(f"  mismatched: {len(self.mismatched)}")
            lines += _capped([f"    {key}: {problem}" for key, problem in self.mismatched], verbose)
        if self.missing:
            lines.append(f"  missing: {len(self.missing)}")
            lines += _capped([f"    {key}" for key in self.missing], verbose)
        if verbose and self.skipped:
            lines.append(f"  skipped: {len(self.skipped)}")
            lines += _grouped(self.skipped, verbose)
        return "\n".join(lines)


def _capped(lines: list[str], verbose: bool, limit: int = _SHOWN_PROBLEMS) -> list[str]:
    if verbose or len(lines) <= limit:
        return lines
    return lines[:limit] + [f"    ... ({len(lines) - limit} more; --verbose lists all)"]


def _grouped(entries: list[tuple[str, str]], verbose: bool) -> list[str]:
    """One line per key when verbose; otherwise one line per reason with a count and an example."""
    if verbose:
        return [f"    {key} ({reason})" for key, reason in entries]
    by_reason = defaultdict(list)
    for key, reason in entries:
        by_reason[reason].append(key)
    lines = []
    for reason, keys in by_reason.items():
        example = keys[0] if len(keys) == 1 else f"{len(keys)} keys, e.g. {keys[0]}"
        lines.append(f"    {example}: {reason}")
    return lines


class ConversionError(ValueError):
    """The input is not a checkpoint of the requested source's layout (or cannot become the target);
    ``report`` holds what was found when the problem is per-key."""

    def __init__(self, message: str, report: ConversionReport | None = None):
        super().__init__(message)
        self.report = report
