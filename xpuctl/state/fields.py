"""Typed reading of a JSON object into a dataclass: every field's value checked against the
field's own annotation, so a record on disk is either whole and well typed or refused with
the field and what was wrong.

The annotations are the schema: `int | None`, `list[str]`, `dict[str, Any]`, `float` ... are
read from the dataclass (`typing.get_type_hints`), so a field added to a record with a
default is read and checked with nothing else to change. Supported: None, bool, int (not a
bool), float (an int too; finite only: a `nan` budget would wait for ever), str, Any, unions
of these, `list[X]` and `dict[str, X]`. `supported` says whether a dataclass uses only
these (a test holds every record type to it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any


class FieldError(ValueError):
    """One line: which field, what it held, what it must be."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _spelled(cls: type) -> dict[str, str]:
    """Each field's annotation as written (`int | None`), for the messages."""
    return {f.name: str(f.type) for f in dataclasses.fields(cls)}


def conforms(value: object, tp: Any) -> bool:
    """Does the JSON `value` have the type `tp` (an annotation, see the module doc)?"""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in typing.get_args(tp))
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(conforms(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(tp)
        return (isinstance(value, dict) and all(conforms(k, key) for k in value)
                and all(conforms(v, item) for v in value.values()))
    raise TypeError(f"no typed reading for the annotation {tp!r}")


def _known(tp: Any) -> bool:
    if tp is Any or tp in (type(None), None, bool, int, float, str):
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType, list):
        return all(_known(a) for a in typing.get_args(tp))
    if origin is dict:
        key, item = typing.get_args(tp)
        return key is str and _known(item)
    return False


def supported(cls: type) -> list[str]:
    """The fields of dataclass `cls` whose annotation `conforms` cannot check and that have no
    reader of their own in `cls.FIELD_READERS` (none, for a record read from disk)."""
    readers = getattr(cls, "FIELD_READERS", {})
    return [f.name for f in dataclasses.fields(cls)
            if f.name not in readers and not _known(_hints(cls)[f.name])]


def _what(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def typed_fields(cls: type, data: object,
                 readers: Mapping[str, Callable[[object], object]] | None = None) -> dict[str, Any]:
    """The fields of dataclass `cls` found in the JSON `data`, each checked against its
    annotation, or read by its own reader in `readers` (which never raises: it returns what
    the field means, e.g. None for a malformed value): FieldError when `data` is not an
    object, a field without a default is missing, or a value has the wrong type. Keys `cls`
    does not know are left out (a newer xpuctl's record is read by an older one)."""
    if not isinstance(data, dict):
        raise FieldError(f"not a JSON object but {_what(data)}")
    hints = _hints(cls)
    spelled = _spelled(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise FieldError(f"field {f.name!r} is missing")
            continue
        value = data[f.name]
        if readers and f.name in readers:
            out[f.name] = readers[f.name](value)
            continue
        try:
            ok = conforms(value, hints[f.name])
        except TypeError:  # an annotation `supported` would have refused: never exit 70
            raise FieldError(f"field {f.name!r} has a type this reader cannot check") from None
        if not ok:
            raise FieldError(f"field {f.name!r} is {_what(value)}, not {spelled[f.name]}")
        out[f.name] = value
    return out
