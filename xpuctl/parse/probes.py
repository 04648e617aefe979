"""What a deep probe reports, as records: parsed from the JSON a probe child prints (text in).

One probe's JSON (the sysman and torch children print exactly this; the CLI adds `seconds`
and `live`; `xpuctl.parse.kmd` and `xpuctl.parse.xpusmi` build the same shape):

    {"name": "sysman", "available": true, "reason": null, "version": "0.1.3",
     "notes": ["..."],
     "devices": [{"bdf": "0000:03:00.0", "index": null, "name": "Intel(R) Arc(TM) B580",
                  "state": "ok", "reason": null,
                  "memory_total_bytes": 12884901888, "memory_used_bytes": 2147483648,
                  "health": "OK",
                  "processes": [{"pid": 4242, "memory_bytes": 1048576, "shared_bytes": 0}]}]}

`processes` is null when the source could not list them (and `reason` says why); `state` is
"ok", "lost", or "survivability" (firmware in survivability mode, `reason` quotes it); `health`
(Sysman's health extension: OK, WARNING, CRITICAL, FAILED) is optional. Every
parser raises `ProbeOutputError` (a ValueError), nothing else.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NamedTuple

SCHEMA = "xpuctl.probes/1"  # every probe's result in one document (`results_to_json`)
STATES = ("ok", "lost", "survivability")  # survivability: xpu-smi v2 device_state
_BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
MAX_TEXT = 400


class ProbeOutputError(ValueError):
    """Probe output that is not the documented JSON."""


class ProbeProcess(NamedTuple):
    pid: int
    memory_bytes: int | None
    shared_bytes: int | None = None


class ProbeDevice(NamedTuple):
    bdf: str | None  # PCI address when the source gives one
    index: int | None  # type: ignore[assignment]  # shadows tuple.index, never called on a record; position among Intel GPUs in PCI order (torch)
    name: str | None
    state: str  # ok | lost | survivability
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    processes: tuple[ProbeProcess, ...] | None  # None: the source could not list them
    reason: str | None = None  # why something is missing, or why the device is lost
    # Sysman's health extension: ok | warning | critical | failed (parse/health.py)
    health: str | None = None


class ProbeResult(NamedTuple):
    name: str
    available: bool
    reason: str | None
    version: str | None
    seconds: float | None
    live: bool
    devices: tuple[ProbeDevice, ...] = ()
    notes: tuple[str, ...] = ()
    timed_out: bool = False


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**64:
        raise ProbeOutputError(f"{key} is not a byte count or index: {str(value)[:40]!r}")
    return value


def _opt_str(d: dict[str, Any], key: str) -> str | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProbeOutputError(f"{key} is not a string")
    return value[:MAX_TEXT]


def _opt_float(d: dict[str, Any], key: str) -> float | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ProbeOutputError(f"{key} is not a number")
    return float(value)


def _process(p: Any) -> ProbeProcess:
    if not isinstance(p, dict):
        raise ProbeOutputError("process entry is not an object")
    pid = p.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**32:
        raise ProbeOutputError(f"bad pid {str(pid)[:20]!r}")
    return ProbeProcess(pid, _opt_int(p, "memory_bytes"), _opt_int(p, "shared_bytes"))


def _device(d: Any) -> ProbeDevice:
    if not isinstance(d, dict):
        raise ProbeOutputError("device entry is not an object")
    bdf = _opt_str(d, "bdf")
    if bdf is not None:
        bdf = bdf.lower()
        if not _BDF_RE.match(bdf):
            raise ProbeOutputError(f"bad PCI address {bdf[:20]!r}")
    state = d.get("state", "ok")
    if state not in STATES:
        raise ProbeOutputError(f"bad device state {str(state)[:20]!r}")
    procs = d.get("processes")
    if procs is not None and not isinstance(procs, list):
        raise ProbeOutputError("processes is not a list")
    return ProbeDevice(
        bdf=bdf,
        index=_opt_int(d, "index"),
        name=_opt_str(d, "name"),
        state=state,
        memory_total_bytes=_opt_int(d, "memory_total_bytes"),
        memory_used_bytes=_opt_int(d, "memory_used_bytes"),
        processes=tuple(_process(p) for p in procs) if procs is not None else None,
        reason=_opt_str(d, "reason"),
        health=_health(d),
    )


def _health(d: dict[str, Any]) -> str | None:
    from xpuctl.parse.health import sysman_health

    value = d.get("health")
    if value is None:
        return None
    got = sysman_health(value)
    if got is None:
        raise ProbeOutputError(f"bad health {str(value)[:20]!r}")
    return got


def result_from_dict(data: Any, name: str | None = None, seconds: float | None = None,
                     live: bool | None = None) -> ProbeResult:
    """A probe's JSON object → ProbeResult. `name`, `seconds`, `live` override the object's."""
    if not isinstance(data, dict):
        raise ProbeOutputError("probe output is not a JSON object")
    got = data.get("name")
    if name is None:
        if not isinstance(got, str) or not got:
            raise ProbeOutputError("probe output has no name")
        name = got
    elif got is not None and got != name:
        raise ProbeOutputError(f"output of probe {str(got)[:20]!r}, expected {name!r}")
    available = data.get("available")
    if not isinstance(available, bool):
        raise ProbeOutputError("'available' is not true or false")
    devices = data.get("devices", [])
    notes = data.get("notes", [])
    if not isinstance(devices, list) or not isinstance(notes, list):
        raise ProbeOutputError("devices or notes is not a list")
    if not all(isinstance(n, str) for n in notes):
        raise ProbeOutputError("a note is not a string")
    live_v = data.get("live", True) if live is None else live
    timed_out = data.get("timed_out", False)
    if not isinstance(live_v, bool) or not isinstance(timed_out, bool):
        raise ProbeOutputError("'live' or 'timed_out' is not true or false")
    return ProbeResult(
        name=name,
        available=available,
        reason=_opt_str(data, "reason"),
        version=_opt_str(data, "version"),
        seconds=_opt_float(data, "seconds") if seconds is None else seconds,
        live=live_v,
        devices=tuple(_device(d) for d in devices),
        notes=tuple(n[:MAX_TEXT] for n in notes),
        timed_out=timed_out,
    )


def parse_probe_output(text: str, name: str | None = None, seconds: float | None = None,
                       live: bool = True) -> ProbeResult:
    """The last non-empty line of a probe's stdout (libraries may print before it) → result."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ProbeOutputError("no output")
    try:
        data = json.loads(lines[-1])
    except (ValueError, RecursionError) as exc:
        raise ProbeOutputError(f"not JSON: {str(exc)[:80]}") from None
    return result_from_dict(data, name, seconds, live)


def result_to_dict(r: ProbeResult) -> dict[str, Any]:
    """The JSON shape `result_from_dict` reads back."""
    return {
        "name": r.name,
        "available": r.available,
        "reason": r.reason,
        "version": r.version,
        "seconds": r.seconds,
        "live": r.live,
        "timed_out": r.timed_out,
        "notes": list(r.notes),
        "devices": [
            {
                "bdf": d.bdf,
                "index": d.index,
                "name": d.name,
                "state": d.state,
                "reason": d.reason,
                "memory_total_bytes": d.memory_total_bytes,
                "memory_used_bytes": d.memory_used_bytes,
                "health": d.health.upper() if d.health else None,
                "processes": None
                if d.processes is None
                else [{"pid": p.pid, "memory_bytes": p.memory_bytes, "shared_bytes": p.shared_bytes}
                      for p in d.processes],
            }
            for d in r.devices
        ],
    }


# -- all the probes' results in one document, for storing and replaying -------------------


def results_to_json(results: tuple[ProbeResult, ...] | list[ProbeResult],
                    probe_pids: frozenset[int] | tuple[int, ...] = ()) -> dict[str, Any]:
    return {"schema": SCHEMA, "probe_pids": sorted(probe_pids),
            "probes": [result_to_dict(r) for r in results]}


def results_from_json(doc: Any) -> tuple[ProbeResult, ...]:
    """The document `results_to_json` made (a dict, or its JSON text) → results."""
    if isinstance(doc, (str, bytes)):
        try:
            doc = json.loads(doc)
        except (ValueError, RecursionError) as exc:
            raise ProbeOutputError(f"probe document is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("probes"), list):
        raise ProbeOutputError(f"not a {SCHEMA} document")
    return tuple(result_from_dict(p) for p in doc["probes"])


def probe_pids_from_json(doc: dict[str, Any]) -> tuple[int, ...]:
    pids = doc.get("probe_pids", [])
    return tuple(p for p in pids if isinstance(p, int) and not isinstance(p, bool)) if isinstance(pids, list) else ()
