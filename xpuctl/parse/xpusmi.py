"""xpu-smi JSON (`discovery -j`, `ps -j`), v1 (xpumanager ≤ 1.3) and v2 shapes (text in).

`discovery -j`: {"device_list": [{"device_id": 0, "pci_bdf_address": "0000:03:00.0",
"device_name": ..., ...}]}; v2 may add "device_state" and promotes a few values to ints.
`ps -j`: {"device_util_by_proc_list": [{"process_id", "process_name", "device_id",
"mem_size", "shared_mem_size", ["engines"]}]}; sizes are kB (bytes / 1024). An error reply is
{"error": "...", "errno": N}. Every parser raises `XpuSmiError` (a ValueError), nothing else.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from xpuctl.parse.probes import ProbeDevice, ProbeProcess, ProbeResult

_BDF_RE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


class XpuSmiError(ValueError):
    """Output that is not the JSON xpu-smi documents."""


class SmiDevice(NamedTuple):
    device_id: int
    bdf: str | None
    name: str | None
    state: str | None  # v2 "device_state" when present


class SmiProcess(NamedTuple):
    pid: int
    device_id: int | None
    memory_bytes: int | None
    shared_bytes: int | None
    name: str | None


def _load(text: str, key: str) -> list[Any]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise XpuSmiError(f"not JSON: {str(exc)[:80]}") from None
    if not isinstance(data, dict):
        raise XpuSmiError("not a JSON object")
    if "error" in data and key not in data:
        raise XpuSmiError(f"xpu-smi error: {str(data.get('error'))[:120]}")
    items = data.get(key, [])
    if not isinstance(items, list):
        raise XpuSmiError(f"{key} is not a list")
    return items


def _int(value: Any) -> int | None:
    """xpu-smi prints ints, or (v1, some fields) strings of digits."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value.strip())
    return None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def parse_discovery(text: str) -> tuple[SmiDevice, ...]:
    out = []
    for item in _load(text, "device_list"):
        if not isinstance(item, dict):
            raise XpuSmiError("device_list entry is not an object")
        dev_id = _int(item.get("device_id"))
        if dev_id is None:
            raise XpuSmiError("device_list entry without a device_id")
        bdf = _str(item.get("pci_bdf_address")) or _str(item.get("pci_bdf"))
        out.append(
            SmiDevice(
                dev_id,
                bdf.lower() if bdf and _BDF_RE.match(bdf) else None,
                _str(item.get("device_name")),
                _str(item.get("device_state")),
            )
        )
    return tuple(out)


def parse_ps(text: str) -> tuple[SmiProcess, ...]:
    out = []
    for item in _load(text, "device_util_by_proc_list"):
        if not isinstance(item, dict):
            raise XpuSmiError("process entry is not an object")
        pid = _int(item.get("process_id"))
        if pid is None or pid == 0:
            raise XpuSmiError("process entry without a process_id")
        mem = _int(item.get("mem_size"))
        shared = _int(item.get("shared_mem_size"))
        out.append(
            SmiProcess(
                pid,
                _int(item.get("device_id")),
                mem * 1024 if mem is not None else None,
                shared * 1024 if shared is not None else None,
                _str(item.get("process_name")),
            )
        )
    return tuple(out)


def probe_result(discovery: tuple[int | None, str], ps: tuple[int | None, str],
                 seconds: float | None = None, live: bool = True) -> ProbeResult:
    """(exit code, stdout) of `xpu-smi discovery -j` and `xpu-smi ps -j` → one ProbeResult.

    Garbage or a non-zero exit makes the probe unavailable, with the reason. Never raises.
    """
    def fail(what: str, rc: int | None, text: str, exc: Exception | None) -> ProbeResult:
        why = str(exc) if exc else f"exited with {rc}"
        first = text.strip().splitlines()[0][:120] if text.strip() and not exc else ""
        return ProbeResult("xpu-smi", False, f"xpu-smi {what} -j {why}" + (f": {first}" if first else ""),
                           None, seconds, live)

    try:
        if discovery[0] != 0:
            return fail("discovery", discovery[0], discovery[1], None)
        devs = parse_discovery(discovery[1])
    except XpuSmiError as exc:
        return fail("discovery", discovery[0], discovery[1], exc)
    try:
        if ps[0] != 0:
            return fail("ps", ps[0], ps[1], None)
        procs = parse_ps(ps[1])
    except XpuSmiError as exc:
        return fail("ps", ps[0], ps[1], exc)
    notes = []
    by_id: dict[int, list[ProbeProcess]] = {d.device_id: [] for d in devs}
    for p in procs:
        dev_id = p.device_id if p.device_id is not None else (devs[0].device_id if len(devs) == 1 else None)
        if dev_id not in by_id:
            notes.append(f"pid {p.pid}: device {p.device_id} is not in `xpu-smi discovery`")
            continue
        by_id[dev_id].append(ProbeProcess(p.pid, p.memory_bytes, p.shared_bytes))
    devices = tuple(
        ProbeDevice(d.bdf, None, d.name, "ok", None, None, tuple(by_id[d.device_id]))
        for d in devs
    )
    return ProbeResult("xpu-smi", True, None, None, seconds, live, devices, tuple(notes))
