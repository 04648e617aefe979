"""Deep probe (child process only): the kernel driver's memory query on each render node.

Run as `python -m xpuctl.probes.children.kmd`; prints one JSON line with the raw reply bytes (hex)
per device, which `xpuctl.parse.kmd.probe_result` turns into records in the CLI process:

    {"name": "kmd", "privileged": false,
     "devices": [{"bdf": "0000:03:00.0", "driver": "xe", "node": "/dev/dri/renderD128",
                  "reply": "<hex>", "errno": null, "error": null}]}

xe: DRM_IOCTL_XE_DEVICE_QUERY / DRM_XE_DEVICE_QUERY_MEM_REGIONS; i915:
DRM_IOCTL_I915_QUERY / DRM_I915_QUERY_MEMORY_REGIONS (layouts in `xpuctl.parse.kmd`). Opening
the render node makes this process a DRM client for a moment; the parent leaves it out by pid.
Always the live machine (`/`), whatever --root the parent has.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from typing import Any

from xpuctl.host.devices import scan_devices
from xpuctl.host.seam import Host
from xpuctl.parse import kmd
from xpuctl.probes.children.common import run

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38


def privileged(status_text: str) -> bool:
    """CAP_PERFMON or CAP_SYS_ADMIN in CapEff: the kernel then reports real usage."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            try:
                caps = int(line.split(":", 1)[1].strip(), 16)
            except ValueError:
                return False
            return bool(caps & (1 << CAP_PERFMON) or caps & (1 << CAP_SYS_ADMIN))
    return False


def _xe(fd: int) -> bytes:
    q = bytearray(kmd.xe_query())
    fcntl.ioctl(fd, kmd.DRM_IOCTL_XE_DEVICE_QUERY, q, True)
    size = kmd.xe_query_size(bytes(q))
    buf = ctypes.create_string_buffer(max(size, 1))
    q = bytearray(kmd.xe_query(size, ctypes.addressof(buf)))
    fcntl.ioctl(fd, kmd.DRM_IOCTL_XE_DEVICE_QUERY, q, True)
    return buf.raw[: kmd.xe_query_size(bytes(q))]


def _i915(fd: int) -> bytes:
    item = ctypes.create_string_buffer(kmd.i915_item(), kmd.I915_QUERY_ITEM.size)
    q = bytearray(kmd.i915_query(ctypes.addressof(item)))
    fcntl.ioctl(fd, kmd.DRM_IOCTL_I915_QUERY, q, True)
    length = kmd.i915_item_length(item.raw)
    if length <= 0:
        raise OSError(-length or errno.EINVAL, os.strerror(-length or errno.EINVAL))
    buf = ctypes.create_string_buffer(length)
    ctypes.memmove(item, kmd.i915_item(length, ctypes.addressof(buf)), kmd.I915_QUERY_ITEM.size)
    fcntl.ioctl(fd, kmd.DRM_IOCTL_I915_QUERY, q, True)
    length = kmd.i915_item_length(item.raw)
    if length <= 0:
        raise OSError(-length or errno.EINVAL, os.strerror(-length or errno.EINVAL))
    return buf.raw[:length]


def probe() -> dict[str, Any]:
    host = Host("/")
    try:
        status = host.read_text("/proc/self/status", 1 << 16)
    except OSError:
        status = ""
    out: dict[str, Any] = {"name": "kmd", "privileged": privileged(status), "devices": []}
    devices, _ = scan_devices(host)
    for d in devices:
        if not d.is_intel or d.driver not in ("xe", "i915") or not d.render_node:
            continue
        entry: dict[str, Any] = {"bdf": d.bdf, "driver": d.driver, "node": d.render_node,
                                 "reply": None, "errno": None, "error": None}
        try:
            fd = os.open(d.render_node, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            entry["errno"], entry["error"] = exc.errno, f"open {d.render_node}: {exc.strerror}"
            out["devices"].append(entry)
            continue
        try:
            entry["reply"] = (_xe(fd) if d.driver == "xe" else _i915(fd)).hex()
        except (OSError, kmd.KmdReplyError) as exc:
            entry["errno"] = getattr(exc, "errno", None)
            entry["error"] = f"query on {d.render_node}: {getattr(exc, 'strerror', None) or exc}"
        finally:
            os.close(fd)
        out["devices"].append(entry)
    return out


def main() -> None:
    run(probe, lambda why: {"name": "kmd", "privileged": False, "devices": [], "error": why})


if __name__ == "__main__":
    main()
