"""A number of seconds as an operator types it: text in, a finite float in a range out.

Every seconds option of every command, and every environment value that feeds one
(`XPUCTL_READ_TIMEOUT`), goes through `parse_seconds` (`cli/options.Seconds` is its click
type). Python's float() takes `nan`, `inf`, `1e308`, `1_0` and surrounding spaces; a
deadline of `nan` never passes and one of `inf` or `1e308` overflows a timer, so only plain
decimal numbers are taken, and only within the option's span.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

HOUR = 3600.0
DAY = 24 * HOUR
WEEK = 7 * DAY

# ASCII digits only (float() takes other scripts' digits too), an optional exponent
_NUMBER = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?\Z")


class Span(NamedTuple):
    """The seconds an option takes: from `low` (or above it, when `low_open`) to `high`."""

    low: float
    high: float = WEEK
    low_open: bool = False

    def describe(self) -> str:
        if self.low_open:
            return f"above {self.low:g} and at most {self.high:g}"
        return f"from {self.low:g} to {self.high:g}"

    def holds(self, value: float) -> bool:
        return math.isfinite(value) and (self.low < value if self.low_open else self.low <= value) \
            and value <= self.high


#: What `--read-timeout` (and XPUCTL_READ_TIMEOUT) takes: above 0, at most an hour (a read
#: bound longer than that is a hang by another name).
READ_BOUND_SPAN = Span(0.0, HOUR, low_open=True)


def parse_seconds(text: str, span: Span) -> float:
    """The seconds `text` says, when they are within `span`; ValueError naming the span
    otherwise (`nan`, `inf`, `1e308`, negatives, `0x10`, empty text, ...)."""
    value = float(text) if _NUMBER.match(text) else math.nan
    if not span.holds(value):
        raise ValueError(f"{text!r} is not a number of seconds {span.describe()}")
    return value
