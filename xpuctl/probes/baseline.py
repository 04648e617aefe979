"""The idle baseline: each device's used memory when nothing holds it, kept in the state
directory (baseline.json, xpuctl.baseline/1) and subtracted from what is unattributed."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from xpuctl.core.model import Issue, Scan
from xpuctl.state import atomic
from xpuctl.state.regular import read_regular
from xpuctl.state.runs import ensure_state_dir

BASELINE_FILE = "baseline.json"
BASELINE_SCHEMA = "xpuctl.baseline/1"
BASELINE_MAX_BYTES = 1 << 20  # a few hundred bytes per device


def _baseline_records(state_dir: str) -> tuple[dict[str, Any], Issue | None]:
    """The baseline file's per-device records as stored ({} when none is recorded), and why
    it could not be used, if so."""
    path = os.path.join(state_dir, BASELINE_FILE)
    try:  # a regular file of at most BASELINE_MAX_BYTES: a FIFO there must not block doctor
        data = json.loads(read_regular(path, BASELINE_MAX_BYTES).decode("utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError, RecursionError) as exc:
        return {}, Issue(path, f"baseline unreadable, taken as 0: {exc}")
    devices = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(devices, dict):
        return {}, Issue(path, "baseline is not a xpuctl.baseline/1 document, taken as 0")
    return devices, None


def _used_bytes(devices: dict[str, Any]) -> dict[str, int]:
    out = {}
    for bdf, rec in devices.items():
        value = rec.get("memory_used_bytes") if isinstance(rec, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[bdf] = value
    return out


def load_baseline(state_dir: str | None) -> tuple[dict[str, int], Issue | None]:
    """{bdf: bytes} from the state directory; none recorded is {} (a baseline of 0)."""
    if not state_dir:
        return {}, None
    devices, problem = _baseline_records(state_dir)
    return _used_bytes(devices), problem


def record_baseline(state_dir: str, scan: Scan) -> list[tuple[str, int | None, str]]:
    """Record the used memory of every device nothing holds. [(bdf, bytes or None, note)]."""
    assert scan.deep is not None
    state_dir = ensure_state_dir(state_dir)
    path = os.path.join(state_dir, BASELINE_FILE)
    devices, _ = _baseline_records(state_dir)  # one read: kept records and the current figures
    current = _used_bytes(devices)
    out: list[tuple[str, int | None, str]] = []
    for v in scan.deep.devices:
        holders = set(scan.holders(v.bdf)) | {p.pid for p in v.processes}
        used = v.memory_used_bytes
        if holders:
            out.append((v.bdf, None, f"not recorded: held by pid(s) {', '.join(map(str, sorted(holders)))}"))
        elif used is None:
            out.append((v.bdf, None, "not recorded: no probe reports its used memory"))
        elif v.state != "ok":
            out.append((v.bdf, None, f"not recorded: the device is {v.state}"))
        else:
            devices[v.bdf] = {"memory_used_bytes": used, "source": v.source, "recorded_at": time.time()}
            out.append((v.bdf, used, f"recorded from {v.source}"
                        + (f" (was {current[v.bdf]})" if v.bdf in current else "")))
    atomic.replace(path, json.dumps({"schema": BASELINE_SCHEMA, "devices": devices}, indent=2).encode())
    return out
