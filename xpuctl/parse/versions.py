"""Versions of the software stack, read without loading it (text in, versions out).

- a shared library's version from its file name: `libze_loader.so.1.21.9` is 1.21.9,
  `libze_intel_gpu.so.1.6.31294` is 1.6.31294 (the soname link `.so.1` alone says only the
  major, and is not taken);
- a kernel module's `/sys/module/<name>/version` (out-of-tree and backport modules have one;
  an in-tree module has none: its version is the kernel's);
- the package versions the versions child prints (xpuctl/probes/children/versions.py), one
  JSON line: {"python": "3.11.7", "packages": {"torch": "2.8.0+xpu", "ray": null, ...}}.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import NamedTuple

_VERSION = re.compile(r"^\d{1,9}(?:\.\d{1,12}){2,5}$")
_TEXT = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_~-]{0,63}$")


class Packages(NamedTuple):
    python: str | None  # the probe Python's version
    found: dict[str, str | None]  # distribution name -> version, None: not installed


def lib_version(name: str, stem: str) -> str | None:
    """The version in a library file name `stem.so.X.Y.Z`, else None."""
    prefix = f"{stem}.so."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    return rest if _VERSION.match(rest) else None


def newest_lib(names: Iterable[str], stem: str) -> tuple[str, str] | None:
    """(file name, version) of the newest `stem.so.X.Y.Z` among names, else None."""
    best: tuple[tuple[int, ...], str, str] | None = None
    for name in names:
        v = lib_version(name, stem)
        if v is None:
            continue
        key = tuple(int(x) for x in v.split("."))
        if best is None or key > best[0]:
            best = (key, name, v)
    return (best[1], best[2]) if best else None


def module_version(text: str) -> str | None:
    """`/sys/module/<name>/version`: one word, else None."""
    word = text.strip()
    return word if _TEXT.match(word) else None


def parse_packages(text: str) -> Packages | None:
    """The versions child's JSON line; None when there is none (garbage, a traceback)."""
    for line in reversed(text.strip().splitlines()[-5:]):
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("packages"), dict):
            continue
        found: dict[str, str | None] = {}
        for name, version in data["packages"].items():
            if isinstance(name, str) and _TEXT.match(name):
                found[name] = version if isinstance(version, str) and _TEXT.match(version) else None
        python = data.get("python")
        return Packages(python if isinstance(python, str) and _TEXT.match(python) else None,
                        found)
    return None


def version_records(value: object) -> list[tuple[str, str | None, str | None, str | None]]:
    """A snapshot manifest's `versions` ([{name, version, source, why}]) as (name, version,
    source, why); an entry of another shape is left out (an archive comes from elsewhere)."""
    out: list[tuple[str, str | None, str | None, str | None]] = []
    for item in value if isinstance(value, list) else []:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        fields = [item.get(k) for k in ("version", "source", "why")]
        if all(f is None or isinstance(f, str) for f in fields):
            out.append((item["name"][:64], *(f[:400] if f else f for f in fields)))
    return out
