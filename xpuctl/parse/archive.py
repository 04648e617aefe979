"""The two JSON files of a snapshot archive: text in, typed records out.

`manifest.json` (schema `xpuctl.snapshot/1`) says where and when the snapshot was taken and
what could not be read. `index.json` holds the scan's answers that are not file contents:
directory listings, link texts, lstat results, resolved sysfs paths, existence checks,
char-device numbers, fd link texts, read errors and the lengths of files read through. An
archive comes from elsewhere, so every field is checked here; anything malformed is a
ValueError naming the field.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

SCHEMA = "xpuctl.snapshot/1"


class Manifest(NamedTuple):
    host: str | None
    time: float
    kernel: str | None
    version: str
    uid: int | None
    root: str
    clk_tck: int
    comm_trusted: bool
    rdev_checked: bool
    caller_env: dict[str, str]
    unreadable: list[dict[str, Any]]
    data: dict[str, Any]  # the whole document, for display


class Index(NamedTuple):
    lists: dict[str, Any]
    links: dict[str, Any]
    resolved: dict[str, Any]
    lstat: dict[str, Any]
    exists: dict[str, bool]
    rdev: dict[str, Any]
    fds: dict[int, Any]
    read_errors: dict[str, list[Any]]
    sizes: dict[str, Any]  # lengths of files read through (absent before: {})


def _load(text: str | bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{what}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: not a JSON object")
    return data


def _want(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"malformed {what}")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_manifest(text: str | bytes) -> Manifest:
    d = _load(text, "manifest.json")
    if d.get("schema") != SCHEMA:
        raise ValueError(f"manifest.json: schema is {d.get('schema')!r}, not {SCHEMA!r}")
    _want(_num(d.get("time")) and math.isfinite(d["time"]) and abs(d["time"]) < 1e11,
          "manifest time")
    _want(isinstance(d.get("xpuctl_version"), str), "manifest xpuctl_version")
    _want(isinstance(d.get("root"), str), "manifest root")
    _want(_int(d.get("clk_tck")) and d["clk_tck"] > 0, "manifest clk_tck")
    for key in ("comm_trusted", "rdev_checked"):
        _want(isinstance(d.get(key), bool), f"manifest {key}")
    env = d.get("caller_env", {})
    _want(isinstance(env, dict) and all(isinstance(v, str) for v in env.values()),
          "manifest caller_env")
    unreadable = d.get("unreadable", [])
    _want(isinstance(unreadable, list) and all(isinstance(u, dict) for u in unreadable),
          "manifest unreadable")
    for key in ("host", "kernel"):
        _want(d.get(key) is None or isinstance(d[key], str), f"manifest {key}")
    _want(d.get("uid") is None or _int(d["uid"]), "manifest uid")
    return Manifest(d.get("host"), float(d["time"]), d.get("kernel"), d["xpuctl_version"],
                    d.get("uid"), d["root"], d["clk_tck"], d["comm_trusted"],
                    d["rdev_checked"], env, unreadable, d)


def _error(v: Any) -> bool:
    """A recorded OSError: [errno, text, filename] or [null, text, null]."""
    return (isinstance(v, list) and len(v) == 3 and (v[0] is None or (_int(v[0]) and 0 < v[0] < 4096))
            and isinstance(v[1], str) and (v[2] is None or isinstance(v[2], str)))


def _answer(v: Any, ok: Any) -> bool:
    """A recorded answer: a value `ok` accepts, or {"error": <error>}."""
    if isinstance(v, dict):
        return set(v) == {"error"} and _error(v["error"])
    return bool(ok(v))


def _table(d: dict[str, Any], key: str, ok: Any) -> dict[str, Any]:
    t = d.get(key, {})
    _want(isinstance(t, dict), f"index {key}")
    for path, v in t.items():
        _want(path.startswith("/") and _answer(v, ok), f"index {key} entry {path!r}")
    table: dict[str, Any] = t
    return table


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _lstat(v: Any) -> bool:
    return (isinstance(v, list) and len(v) == 6 and all(_num(x) for x in v)
            and all(_int(x) for x in (v[0], v[1], v[2], v[4], v[5])))


def _fd_list(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x) for x in v
    )


def parse_index(text: str | bytes) -> Index:
    d = _load(text, "index.json")
    fds_raw = d.get("fds", {})
    _want(isinstance(fds_raw, dict), "index fds")
    fds: dict[int, Any] = {}
    for pid, v in fds_raw.items():
        _want(pid.isascii() and pid.isdigit() and _answer(v, _fd_list), f"index fds entry {pid!r}")
        fds[int(pid)] = v if isinstance(v, dict) else [tuple(x) for x in v]
    rdev = _table(d, "rdev", lambda v: v is None or (
        isinstance(v, list) and len(v) == 2 and all(_int(x) for x in v)))
    errors = d.get("read_errors", {})
    _want(isinstance(errors, dict) and all(p.startswith("/") and _error(v)
                                           for p, v in errors.items()), "index read_errors")
    return Index(
        lists=_table(d, "lists", _strs),
        links=_table(d, "links", lambda v: isinstance(v, str)),
        resolved=_table(d, "resolved", lambda v: isinstance(v, str) and v.startswith("/")),
        lstat=_table(d, "lstat", _lstat),
        exists=_table(d, "exists", lambda v: isinstance(v, bool)),
        rdev=rdev,
        fds=fds,
        read_errors=errors,
        sizes=_table(d, "sizes", lambda v: _int(v) and 0 <= v < 1 << 40),
    )
