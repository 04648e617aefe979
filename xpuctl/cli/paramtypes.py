"""The value types of xpuctl's options, one per kind of value, for every command.

`Seconds(low, high)` is the type of every option that takes seconds (and of the
environment variables that feed one): `typer.Option("--x-timeout", click_type=Seconds(0))`.
Its values go through `parse.seconds.parse_seconds`, so `nan`, `inf`, `1e308`, negatives,
`0x10` and empty text are a usage error (exit 2) naming the option and its range, and
`--help` shows `SECONDS` and the range. A float option of any other type is a bug: a test
walks every command's options and fails on one.

This module stays cheap to import (the group's own `--read-timeout` uses it on every run).
"""

from __future__ import annotations

from typing import Any

from typer._click import types

from xpuctl.parse.devspec import split_devices
from xpuctl.parse.seconds import WEEK, Span, parse_seconds


class Seconds(types.FloatRange):
    """A finite number of seconds from `low` (above it, with `low_open`) to `high`."""

    name = "seconds"

    def __init__(self, low: float, high: float = WEEK, low_open: bool = False) -> None:
        super().__init__(min=low, max=high, min_open=low_open)
        self.span = Span(float(low), float(high), low_open)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.span.holds(float(value)):  # a default, or a value given in code
                return float(value)
            value = repr(value)
        try:
            return parse_seconds(value if isinstance(value, str) else repr(value), self.span)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)

    def get_metavar(self, param: Any, ctx: Any) -> str:
        return "SECONDS"

    def _describe_range(self) -> str:
        """`0<=x<=604800` in help (click's would print the floats' `.0`)."""
        low = "<" if self.span.low_open else "<="
        return f"{self.span.low:g}{low}x<={self.span.high:g}"

    def __repr__(self) -> str:
        return f"Seconds({self.span.describe()})"


class SnapshotFile(types.StringParamType):
    """`--from FILE`: a snapshot archive's name; an empty one is a usage error (it would
    name no file, or the current directory)."""

    name = "file"

    def get_metavar(self, param: Any, ctx: Any) -> str:
        return "FILE"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        text = super().convert(value, param, ctx)
        if not text:
            self.fail("an empty name is not a snapshot file", param, ctx)
        return text


class DeviceList(types.StringParamType):
    """`--device`/`--devices DEVICE[,DEVICE]`: the one device list of every command (parse/
    devspec.py); a bad list is a usage error naming the option. The value stays the text
    given, checked (the specs are resolved against sysfs later, by the same parser)."""

    name = "device"

    def get_metavar(self, param: Any, ctx: Any) -> str:
        return "DEVICE[,DEVICE]"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        text = super().convert(value, param, ctx)
        try:
            split_devices([text])
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return text
