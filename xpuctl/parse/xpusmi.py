"""xpu-smi's output (`--version`, `discovery -j`, `ps -j`), v1 (xpumanager 1.x) and v2 (text in).

`--version` (xpumanager cli/src/comlet_version.cpp, v2 xpumanager ial/cli/cli.cpp) prints
`CLI:` then `    Version: 1.2.39.20240813`, `    Build ID: ...`, then `Service:` and the same
lines; with `-j` v1 prints {"cli_version": ..., "xpum_version": ...}.
`discovery -j`: {"device_list": [{"device_id": 0, "pci_bdf_address": "0000:03:00.0",
"device_name": ..., ...}]}; v2 adds "device_state" ("normal", or "survivability mode (firmware
update and cold reset are recommended for device recovery)": xpumanager ial/cmn/cmd_discovery.h) and
prints {"device_list": null} when it finds no device (xpumanager ial/cmn/cmd_discovery.cpp),
and then `ps -j` prints nothing (or fails: no device handle; ial/cmn/cmd_ps.cpp): no device.
`ps -j`: {"device_util_by_proc_list": [{"process_id", "process_name", "device_id",
"mem_size", "shared_mem_size", ["engines"]}]}; sizes are kB, and which kB depends on the
version: xpumanager before 1.3.1 divides bytes by 1000 (xpumanager cli/src/core_stub/lib_core_stub.cpp
and grpc_stub, changed to 1024 by the commit of 2025-03-06 "ps: Use sysman interface..."),
1.3.1 and later and v2 (xpumanager ial/cmn/cmd_ps.cpp) by 1024. An unknown version leaves the sizes
unknown. An error reply is {"error": "...", "errno": N}. Every parser raises `XpuSmiError`
(a ValueError), nothing else.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from xpuctl.parse.probes import ProbeDevice, ProbeProcess, ProbeResult

_BDF_RE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_VERSION_RE = re.compile(r"^\s*Version:\s*v?([0-9]{1,6}(?:\.[0-9]{1,12}){1,4})\s*$", re.ASCII)
_NUMBERS_RE = re.compile(r"^v?([0-9]{1,6}(?:\.[0-9]{1,12}){1,4})$", re.ASCII)
KB_1000_BEFORE = (1, 3, 1)  # xpumanager 1.3.1 moved `ps` to bytes / 1024
NORMAL_STATE = "normal"


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


class SmiVersion(NamedTuple):
    text: str  # as xpu-smi prints it, e.g. 1.2.39.20240813
    numbers: tuple[int, ...]  # (1, 2, 39, 20240813)

    @property
    def kb(self) -> int:
        """The bytes in one kB of `ps -j`'s sizes."""
        return 1000 if self.numbers[:3] < KB_1000_BEFORE else 1024


def parse_version(text: str) -> SmiVersion | None:
    """The CLI version `xpu-smi --version` prints (text or JSON); None when there is none."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except (ValueError, RecursionError):
            return None
        value = data.get("cli_version") if isinstance(data, dict) else None
        m = _NUMBERS_RE.match(value.strip()) if isinstance(value, str) else None
    else:
        m = None
        in_cli = False
        for line in text.splitlines()[:50]:
            if line.strip() in ("CLI:", "Service:"):  # v2 may indent the titles
                in_cli = line.strip() == "CLI:"
            elif in_cli and (m := _VERSION_RE.match(line)):
                break
    if not m:
        return None
    return SmiVersion(m.group(1), tuple(int(n) for n in m.group(1).split(".")))


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
    if key == "device_list" and (items is None or items == "No device discovered"):
        return []  # v2: no device found (null with -j, this sentence without)
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


def parse_ps(text: str, kb: int | None = 1024) -> tuple[SmiProcess, ...]:
    """`kb`: the bytes in one of its kB (`SmiVersion.kb`); None: unknown, sizes left None."""
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
                mem * kb if mem is not None and kb else None,
                shared * kb if shared is not None and kb else None,
                _str(item.get("process_name")),
            )
        )
    return tuple(out)


def _device_state(d: SmiDevice) -> tuple[str, str | None]:
    """(probe state, reason) of a v2 device_state; v1 has none (ok)."""
    if d.state is None or d.state.strip().lower() == NORMAL_STATE:
        return "ok", None
    if "survivability" in d.state.lower():
        return "survivability", f"xpu-smi device_state: {d.state[:200]}"
    return "ok", None


def probe_result(discovery: tuple[int | None, str], ps: tuple[int | None, str],
                 seconds: float | None = None, live: bool = True,
                 version: tuple[int | None, str] | None = None) -> ProbeResult:
    """(exit code, stdout) of `xpu-smi discovery -j`, `xpu-smi ps -j` and `xpu-smi --version`
    → one ProbeResult. Without a version the process sizes stay unknown (a note says so).

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
    notes = []
    ver = parse_version(version[1]) if version is not None and version[0] == 0 else None
    if ver is None:
        notes.append("xpu-smi --version gave no version: the unit of `ps -j` sizes (kB of 1000 "
                     "bytes before xpumanager 1.3.1, 1024 since) is unknown, its sizes are not used")
    procs: tuple[SmiProcess, ...] = ()
    if devs:
        try:
            if ps[0] != 0:
                return fail("ps", ps[0], ps[1], None)
            procs = parse_ps(ps[1], ver.kb if ver else None)
        except XpuSmiError as exc:
            return fail("ps", ps[0], ps[1], exc)
    else:
        # v2 with no device: discovery prints {"device_list": null}, and `ps -j` has no device
        # to print a process of (an empty reply, or "Device handle not found" and a non-zero
        # exit: xpumanager ial/cmn/cmd_ps.cpp); the answer is "no device", not a failed call
        notes.append("xpu-smi sees no device")
    for d in devs:
        if d.state is not None and _device_state(d)[0] == "ok" and d.state.strip().lower() != NORMAL_STATE:
            notes.append(f"device {d.device_id}: device_state {d.state[:120]!r} is not one xpuctl knows")
    by_id: dict[int, list[ProbeProcess]] = {d.device_id: [] for d in devs}
    for p in procs:
        dev_id = p.device_id if p.device_id is not None else (devs[0].device_id if len(devs) == 1 else None)
        if dev_id not in by_id:
            notes.append(f"pid {p.pid}: device {p.device_id} is not in `xpu-smi discovery`")
            continue
        by_id[dev_id].append(ProbeProcess(p.pid, p.memory_bytes, p.shared_bytes))
    devices = tuple(
        ProbeDevice(d.bdf, None, d.name, _device_state(d)[0], None, None, tuple(by_id[d.device_id]),
                    _device_state(d)[1])
        for d in devs
    )
    return ProbeResult("xpu-smi", True, None, ver.text if ver else None, seconds, live, devices,
                       tuple(notes))
