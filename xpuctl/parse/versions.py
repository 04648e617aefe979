"""Versions of the software stack, read without loading it (text in, versions out).

- a shared library's version from its file name: `libze_loader.so.1.21.9` is 1.21.9,
  `libze_intel_gpu.so.1.6.31294` is 1.6.31294 (the soname link `.so.1` alone says only the
  major, and is not taken);
- a kernel module's `/sys/module/<name>/version` (out-of-tree and backport modules have one;
  an in-tree module has none: its version is the kernel's);
- the GuC firmware a card runs: debugfs's `gt0/uc/guc_info` (Linux xe_uc_fw.c
  xe_uc_fw_print: `GuC firmware: xe/bmg_guc_70.bin`, `\tstatus: RUNNING`, then `\tversion:
  wanted 70.44.1, found 70.44.1` or, newer, `\trelease version: wanted …, found …` and a
  `compatibility version` line, which is not the firmware's), else the kernel log's line at
  load (xe: `xe 0000:03:00.0: [drm] Using GuC firmware from xe/bmg_guc_70.bin version
  70.44.1`; i915: `i915 0000:00:02.0: [drm] GT0: GuC firmware i915/tgl_guc_70.bin version
  70.29.2`, as compute-runtime #809 and vLLM #55425 quote them);
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


_GUC_INFO = re.compile(r"^\s*(?:release )?version:\s*wanted[^,\n]*,\s*found\s+"
                       r"(\d{1,4}(?:\.\d{1,6}){1,3})\b")
_GUC_LOG = re.compile(r"GuC firmware (?:from )?\S+ version (\d{1,4}(?:\.\d{1,6}){1,3})\b")
_GUC_DEVICE = re.compile(r"^(?:xe|i915) ([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]): ")


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


def guc_info_version(text: str) -> str | None:
    """The GuC firmware version found (running) in debugfs's guc_info, else None."""
    lines = text.splitlines()[:64]
    if not any(line.lstrip().startswith("GuC firmware") for line in lines):
        return None
    for line in lines:
        m = _GUC_INFO.match(line)
        if m:
            return m.group(1)
    return None


def guc_log_versions(texts: Iterable[str]) -> list[tuple[str | None, str]]:
    """(BDF or None, version) for each kernel log record that says which GuC firmware a
    device loaded, in log order."""
    out: list[tuple[str | None, str]] = []
    for text in texts:
        m = _GUC_LOG.search(text)
        if m:
            dev = _GUC_DEVICE.match(text)
            out.append((dev.group(1) if dev else None, m.group(1)))
    return out
