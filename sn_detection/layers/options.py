"""The rules a layer's keyword options must follow, stated once by the layer that owns them.

Each layer class lists its options' rules in ``option_rules`` (option name -> ``Rule``) and checks its
constructor's arguments with ``check_options``. Everything else that validates option values (the
factory, detectron2 config validation) asks the layer classes, so a rule is written in one place. Rules
here do not know the channel count: whether a group count suits a layer's channels is checked by the
layer's constructor.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import NamedTuple


class Rule(NamedTuple):
    """What an option's value must be: a predicate and its wording for error messages."""

    holds: Callable[[object], bool]
    text: str


def is_number(value) -> bool:
    """A finite real that is not a bool (yaml reads 1e999 as inf)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


POSITIVE = Rule(lambda v: is_number(v) and v > 0, "a number > 0")
NON_NEGATIVE = Rule(lambda v: is_number(v) and v >= 0, "a number >= 0")
MOMENTUM = Rule(
    lambda v: v is None or (is_number(v) and 0 <= v <= 1),
    "a number in [0, 1] (PyTorch's momentum convention), or None (a cumulative average, as PyTorch's BatchNorm)",
)
BOOLEAN = Rule(lambda v: isinstance(v, bool), "True or False")
POSITIVE_INT = Rule(lambda v: is_int(v) and v >= 1, "an int >= 1")
RADIUS_RANGE = Rule(
    lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(is_number(r) and r >= 0 for r in v),
    "(start, end): SSN's radius before the first iteration and after the last, numbers >= 0",
)


def check_options(owner: Callable, rules: Mapping[str, Rule], **options) -> None:
    """Raise a ValueError naming ``owner`` (a class or function), the option and its valid values for the
    first of ``options`` that breaks its rule in ``rules``."""
    for name, value in options.items():
        rule = rules[name]
        if not rule.holds(value):
            raise ValueError(f"{owner.__name__}: {name}={value!r} is invalid: it must be {rule.text}")


def check_num_channels(owner: type, num_channels) -> None:
    """A layer's channel count must be a positive int (not a float, a bool or a string)."""
    if not POSITIVE_INT.holds(num_channels):
        raise ValueError(f"{owner.__name__}: num_channels must be a positive int, got {num_channels!r}")
