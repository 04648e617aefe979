"""output/jsontext.py writes what `json.dumps(data, indent=2, ensure_ascii=True)` writes
(the README's "JSON output": printable ASCII only, a lone surrogate from a byte that was not
UTF-8 as \\udcXX), for any value, and leaves what it cannot write the same way to json."""

from __future__ import annotations

import enum
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xpuctl.output import jsontext

#: every kind of character: lone surrogates (Cs) included, which st.text leaves out by default
text = st.text(alphabet=st.characters() | st.characters(categories=["Cs", "Cc", "Co"]))
leaves = st.none() | st.booleans() | st.integers() | st.floats() | text
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=5)
                      | st.lists(inner, max_size=3).map(tuple)
                      | st.dictionaries(text, inner, max_size=5), max_leaves=40)


def same(data: object) -> None:
    assert jsontext.dumps(data) == json.dumps(data, indent=2, ensure_ascii=True)


@given(values)
def test_the_text_is_jsons(data):
    same(data)


class Kind(enum.StrEnum):
    A = "a"


class Level(enum.IntEnum):
    HIGH = 3


def test_what_json_converts_or_refuses_is_jsons():
    same({"nan": float("nan"), "inf": [float("inf"), -float("inf")], "e": 1e300, "t": -0.0})
    same({"kind": Kind.A, "level": Level.HIGH, Kind.A: "a str key, subclassed"})
    same({1: "int key", None: "none key", 2.5: "float key", False: [{}, [], ""]})  # json converts
    same("/models/\udcff\udcfe-x")  # surrogateescape: \udcXX, as json writes it
    with pytest.raises(TypeError):
        jsontext.dumps({"a": {1, 2}})  # json refuses a set: so does this
