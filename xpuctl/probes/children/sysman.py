"""Deep probe (child process only): Level Zero Sysman through pyzes.

Run as `python -m xpuctl.probes.children.sysman`; prints one JSON line (`xpuctl.parse.probes`) and
exits 0. Never imported by the CLI process. Per device: the PCI address, the name, the
device-located memory modules (`zesMemoryGetState`: size and free), the process list
(`zesDeviceProcessesGetState`: pid, memSize, sharedSize) and, where the runtime has it, the
health extension (`zesDeviceGetHealthStatusExt(hDevice, &health)`, Level Zero 1.18: the enum
zes_device_health_status_ext_t, OK 0, WARNING 1, CRITICAL 2, FAILED 3, stored in the card's
non-volatile memory and kept across resets). Equivalent: `xpu-smi ps`. This probe runs
`zesDeviceProcessesGetState` once per device per run, never in a loop, and leaves its own pid
out of the list (a Sysman client of the card is itself a process of it: xpumanager #116 saw
`xpu-smi ps` list itself with about 211 MB).

pyzes 0.1.3 loads `/usr/lib/x86_64-linux-gnu/libze_loader.so.1` at import and raises OSError
when it is missing; every call returns a `ze_result_t` int and fills structures through
pointers.
"""

from __future__ import annotations

import os
from typing import Any

from xpuctl.probes.children.common import run

DEVICE_LOST = 0x70000001
DEVICE_REQUIRES_RESET = 0x70000006
INSUFFICIENT_PERMISSIONS = 0x70010000
UNSUPPORTED_FEATURE = 0x78000003
INVALID_SIZE = 0x78000008
MEM_LOC_DEVICE = 1
HEALTH = {0: "OK", 1: "WARNING", 2: "CRITICAL", 3: "FAILED"}  # zes_device_health_status_ext_t

_NAMES = {
    DEVICE_LOST: "ZE_RESULT_ERROR_DEVICE_LOST",
    DEVICE_REQUIRES_RESET: "ZE_RESULT_ERROR_DEVICE_REQUIRES_RESET",
    INSUFFICIENT_PERMISSIONS: "ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS",
    UNSUPPORTED_FEATURE: "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE",
    INVALID_SIZE: "ZE_RESULT_ERROR_INVALID_SIZE",
    0x78000001: "ZE_RESULT_ERROR_UNINITIALIZED",
    0x70020000: "ZE_RESULT_ERROR_DEPENDENCY_UNAVAILABLE",
}


def result_name(rc: int) -> str:
    return _NAMES.get(rc, f"0x{rc & 0xFFFFFFFF:08x}")


class Lost(Exception):
    def __init__(self, call: str, rc: int) -> None:
        super().__init__(f"{call} returned {result_name(rc)}: the device is lost or needs a reset")


def _text(raw: Any) -> str | None:
    if isinstance(raw, bytes):
        raw = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
    return raw.strip() or None if isinstance(raw, str) else None


def _call(pyzes: Any, name: str, *args: Any) -> int:
    rc = int(getattr(pyzes, name)(*args))
    if rc in (DEVICE_LOST, DEVICE_REQUIRES_RESET):
        raise Lost(name, rc)
    return rc


def _handles(pyzes: Any, fn: str, handle_type: Any, *head: Any) -> tuple[int, list[Any]]:
    """The two-call enumeration: count first, then the array."""
    from ctypes import byref, c_uint32

    count = c_uint32(0)
    rc = _call(pyzes, fn, *head, byref(count), None)
    if rc != 0 or count.value == 0:
        return rc, []
    arr = (handle_type * count.value)()
    rc = _call(pyzes, fn, *head, byref(count), arr)
    return rc, list(arr)[: count.value] if rc == 0 else []


def _memory(pyzes: Any, dev: Any) -> tuple[int | None, int | None]:
    from ctypes import byref

    _, mems = _handles(pyzes, "zesDeviceEnumMemoryModules", pyzes.zes_mem_handle_t, dev)
    total = used = 0
    found = False
    for m in mems:
        props = pyzes.zes_mem_properties_t()
        props.stype = getattr(pyzes, "ZES_STRUCTURE_TYPE_MEM_PROPERTIES", 0xB)
        if _call(pyzes, "zesMemoryGetProperties", m, byref(props)) != 0:
            continue
        if props.location != getattr(pyzes, "ZES_MEM_LOC_DEVICE", MEM_LOC_DEVICE):
            continue
        state = pyzes.zes_mem_state_t()
        state.stype = getattr(pyzes, "ZES_STRUCTURE_TYPE_MEM_STATE", 0x1E)
        if _call(pyzes, "zesMemoryGetState", m, byref(state)) != 0:
            continue
        total += int(state.size)
        used += max(0, int(state.size) - int(state.free))
        found = True
    return (total, used) if found else (None, None)


def _processes(pyzes: Any, dev: Any, me: int) -> tuple[list[dict[str, Any]] | None, str | None]:
    from ctypes import byref, c_uint32

    count = c_uint32(0)
    for _ in range(3):  # the list can grow between the two calls (INVALID_SIZE)
        rc = _call(pyzes, "zesDeviceProcessesGetState", dev, byref(count), None)
        if rc == 0:
            arr = (pyzes.zes_process_state_t * max(count.value, 1))()
            for p in arr:
                p.stype = getattr(pyzes, "ZES_STRUCTURE_TYPE_PROCESS_STATE", 0x16)
            rc = _call(pyzes, "zesDeviceProcessesGetState", dev, byref(count), arr)
            if rc == INVALID_SIZE:
                continue
        if rc == UNSUPPORTED_FEATURE:
            return None, "the driver does not list processes (ZE_RESULT_ERROR_UNSUPPORTED_FEATURE): memory only"
        if rc == INSUFFICIENT_PERMISSIONS:
            return None, "listing the device's processes needs root (ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS)"
        if rc != 0:
            return None, f"zesDeviceProcessesGetState returned {result_name(rc)}"
        procs = [
            {"pid": int(p.processId), "memory_bytes": int(p.memSize), "shared_bytes": int(p.sharedSize)}
            for p in list(arr)[: count.value]
            if int(p.processId) not in (0, me)
        ]
        return procs, None
    return None, "the process list kept changing size"


def _health(pyzes: Any, dev: Any) -> str | None:
    """OK | WARNING | CRITICAL | FAILED, or None when the runtime has no health extension."""
    from ctypes import byref, c_int32

    if not hasattr(pyzes, "zesDeviceGetHealthStatusExt"):
        return None
    status = c_int32(-1)
    if _call(pyzes, "zesDeviceGetHealthStatusExt", dev, byref(status)) != 0:
        return None  # unsupported, or not permitted
    return HEALTH.get(status.value)


def _device(pyzes: Any, dev: Any, me: int) -> dict[str, Any]:
    from ctypes import byref

    out: dict[str, Any] = {"bdf": None, "index": None, "name": None, "state": "ok", "reason": None,
                           "memory_total_bytes": None, "memory_used_bytes": None, "processes": None,
                           "health": None}
    try:
        pci = pyzes.zes_pci_properties_t()
        pci.stype = getattr(pyzes, "ZES_STRUCTURE_TYPE_PCI_PROPERTIES", 0x2)
        if _call(pyzes, "zesDevicePciGetProperties", dev, byref(pci)) == 0:
            a = pci.address
            out["bdf"] = f"{a.domain:04x}:{a.bus:02x}:{a.device:02x}.{a.function:x}"
        props = pyzes.zes_device_properties_t()
        props.stype = getattr(pyzes, "ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES", 0x1)
        if _call(pyzes, "zesDeviceGetProperties", dev, byref(props)) == 0:
            out["name"] = _text(props.modelName) or _text(props.core.name)
        out["memory_total_bytes"], out["memory_used_bytes"] = _memory(pyzes, dev)
        out["processes"], out["reason"] = _processes(pyzes, dev, me)
        out["health"] = _health(pyzes, dev)
    except Lost as exc:
        out["state"] = "lost"
        out["reason"] = str(exc)
    return out


def probe() -> dict[str, Any]:
    result: dict[str, Any] = {"name": "sysman", "available": False, "reason": None, "version": None,
                              "notes": [], "devices": []}
    try:
        import pyzes  # OSError when the loader is missing from pyzes's hard-coded path
    except OSError as exc:
        result["reason"] = f"Level Zero loader not found: {exc}"
        return result
    except ImportError:
        result["reason"] = "pyzes is not installed (pip install 'xpuctl[sysman]')"
        return result
    try:
        from importlib.metadata import version

        result["version"] = version("pyzes")
    except Exception:
        result["version"] = getattr(pyzes, "__version__", None)
    rc = int(pyzes.zesInit(0))
    if rc != 0:
        result["reason"] = f"zesInit failed: {result_name(rc)}"
        return result
    me = os.getpid()
    try:
        rc, drivers = _handles(pyzes, "zesDriverGet", pyzes.zes_driver_handle_t)
        if rc != 0:
            result["reason"] = f"zesDriverGet failed: {result_name(rc)}"
            return result
        for drv in drivers:
            _, devs = _handles(pyzes, "zesDeviceGet", pyzes.zes_device_handle_t, drv)
            result["devices"].extend(_device(pyzes, d, me) for d in devs)
    except Lost as exc:
        result["reason"] = str(exc)
        return result
    for d in result["devices"]:
        if d["reason"]:
            result["notes"].append(f"{d['bdf'] or 'a device'}: {d['reason']}")
    result["available"] = True
    return result


def main() -> None:
    run(probe, lambda why: {"name": "sysman", "available": False, "reason": why})


if __name__ == "__main__":
    main()
