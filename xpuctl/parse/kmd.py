"""The kernel's own memory query: ioctl numbers, request layouts, reply parsers (bytes in).

Layouts from the uapi headers (`include/uapi/drm/xe_drm.h`, `include/uapi/drm/i915_drm.h`):

- xe: `DRM_IOCTL_XE_DEVICE_QUERY` = DRM_IOWR(0x40 + 0x00, struct drm_xe_device_query), the
  struct being {u64 extensions; u32 query; u32 size; u64 data; u64 reserved[2]} (40 bytes).
  `query = DRM_XE_DEVICE_QUERY_MEM_REGIONS (1)`; the reply is struct drm_xe_query_mem_regions
  {u32 num_mem_regions; u32 pad; struct drm_xe_mem_region mem_regions[]}, each region
  {u16 mem_class; u16 instance; u32 min_page_size; u64 total_size; u64 used;
  u64 cpu_visible_size; u64 cpu_visible_used; u64 reserved[6]} (88 bytes). `used` is 0
  without CAP_PERFMON or CAP_SYS_ADMIN.
- i915: `DRM_IOCTL_I915_QUERY` = DRM_IOWR(0x40 + 0x39, struct drm_i915_query {u32 num_items;
  u32 flags; u64 items_ptr}), one struct drm_i915_query_item {u64 query_id; s32 length;
  u32 flags; u64 data_ptr} with `query_id = DRM_I915_QUERY_MEMORY_REGIONS (4)`; the reply is
  {u32 num_regions; u32 rsvd[3]; struct drm_i915_memory_region_info regions[]}, each
  {u16 memory_class; u16 memory_instance; u32 rsvd0; u64 probed_size; u64 unallocated_size;
  u64 rsvd1[8]} (88 bytes). `unallocated_size` equals `probed_size` without CAP_PERFMON.

Both are asked twice: with size/length 0 the kernel writes the size it needs.
Every parser raises `KmdReplyError` (a ValueError) for a reply it cannot read, nothing else.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any, NamedTuple

from xpuctl.parse.probes import ProbeDevice, ProbeResult

# _IOC(dir, type, nr, size) on x86/arm64: dir << 30 | size << 16 | type << 8 | nr
_IOC_READ_WRITE = 3
DRM_IOCTL_BASE = ord("d")
DRM_COMMAND_BASE = 0x40


def drm_iowr(nr: int, size: int) -> int:
    return (_IOC_READ_WRITE << 30) | (size << 16) | (DRM_IOCTL_BASE << 8) | nr


XE_QUERY = struct.Struct("=QIIQ2Q")  # drm_xe_device_query
XE_QUERY_HEADER = struct.Struct("=II")  # drm_xe_query_mem_regions
XE_REGION = struct.Struct("=HHIQQQQ6Q")  # drm_xe_mem_region
DRM_IOCTL_XE_DEVICE_QUERY = drm_iowr(DRM_COMMAND_BASE + 0x00, XE_QUERY.size)
DRM_XE_DEVICE_QUERY_MEM_REGIONS = 1

I915_QUERY = struct.Struct("=IIQ")  # drm_i915_query
I915_QUERY_ITEM = struct.Struct("=QiIQ")  # drm_i915_query_item
I915_REGIONS_HEADER = struct.Struct("=I3I")  # drm_i915_query_memory_regions
I915_REGION = struct.Struct("=HHIQQ8Q")  # drm_i915_memory_region_info
DRM_IOCTL_I915_QUERY = drm_iowr(DRM_COMMAND_BASE + 0x39, I915_QUERY.size)
DRM_I915_QUERY_MEMORY_REGIONS = 4

MEM_CLASS_SYSTEM = 0
MEM_CLASS_DEVICE = 1  # xe: VRAM; i915: LOCAL
MAX_REGIONS = 64
_BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")  # a device has a handful; more is a corrupt reply


class KmdReplyError(ValueError):
    """A query reply too short, or whose counts do not fit its length."""


class MemRegion(NamedTuple):
    mem_class: int  # 0 system, 1 device-local
    instance: int
    total_bytes: int
    used_bytes: int  # 0 (xe) or total - unallocated (i915) without CAP_PERFMON

    @property
    def is_device(self) -> bool:
        return self.mem_class == MEM_CLASS_DEVICE


class KmdMemory(NamedTuple):
    """Device-local memory of one device: the sum over its VRAM/LOCAL regions."""

    total_bytes: int | None
    used_bytes: int | None  # None when the kernel would not say (no CAP_PERFMON)
    regions: int


def xe_query(size: int = 0, data: int = 0) -> bytes:
    """A drm_xe_device_query asking for the memory regions."""
    return XE_QUERY.pack(0, DRM_XE_DEVICE_QUERY_MEM_REGIONS, size, data, 0, 0)


def xe_query_size(request: bytes) -> int:
    """The size the kernel wrote back into a drm_xe_device_query."""
    if len(request) < XE_QUERY.size:
        raise KmdReplyError(f"xe query struct is {len(request)} bytes, expected {XE_QUERY.size}")
    size: int = XE_QUERY.unpack_from(request)[2]
    return size


def i915_item(length: int = 0, data: int = 0) -> bytes:
    return I915_QUERY_ITEM.pack(DRM_I915_QUERY_MEMORY_REGIONS, length, 0, data)


def i915_query(items_ptr: int) -> bytes:
    return I915_QUERY.pack(1, 0, items_ptr)


def i915_item_length(item: bytes) -> int:
    """The length the kernel wrote back into a query item (negative: -errno)."""
    if len(item) < I915_QUERY_ITEM.size:
        raise KmdReplyError(f"i915 query item is {len(item)} bytes, expected {I915_QUERY_ITEM.size}")
    length: int = I915_QUERY_ITEM.unpack_from(item)[1]
    return length


def _regions(data: bytes, header: struct.Struct, region: struct.Struct, what: str) -> list[tuple[Any, ...]]:
    if len(data) < header.size:
        raise KmdReplyError(f"{what} reply is {len(data)} bytes, shorter than its header")
    count = header.unpack_from(data)[0]
    if count > MAX_REGIONS:
        raise KmdReplyError(f"{what} reply claims {count} regions")
    need = header.size + count * region.size
    if len(data) < need:
        raise KmdReplyError(f"{what} reply is {len(data)} bytes, {count} regions need {need}")
    return [region.unpack_from(data, header.size + i * region.size) for i in range(count)]


def parse_xe_mem_regions(data: bytes) -> tuple[MemRegion, ...]:
    """struct drm_xe_query_mem_regions → regions."""
    return tuple(
        MemRegion(f[0], f[1], f[3], f[4])
        for f in _regions(data, XE_QUERY_HEADER, XE_REGION, "xe mem_regions")
    )


def parse_i915_memory_regions(data: bytes) -> tuple[MemRegion, ...]:
    """struct drm_i915_query_memory_regions → regions (used = probed − unallocated)."""
    out = []
    for f in _regions(data, I915_REGIONS_HEADER, I915_REGION, "i915 memory_regions"):
        probed, unallocated = f[3], f[4]
        if probed == 2**64 - 1:  # -1: unknown
            continue
        used = probed - unallocated if unallocated != 2**64 - 1 and unallocated <= probed else 0
        out.append(MemRegion(f[0], f[1], probed, used))
    return tuple(out)


def device_memory(regions: tuple[MemRegion, ...], privileged: bool) -> KmdMemory:
    """Sum the device-local regions; `used` only when the kernel gave real figures."""
    local = [r for r in regions if r.is_device]
    if not local:
        return KmdMemory(None, None, 0)
    total = sum(r.total_bytes for r in local)
    used = sum(r.used_bytes for r in local) if privileged else None
    return KmdMemory(total, used, len(local))


LOST_ERRNOS = (125, 19)  # ECANCELED: xe blocks every ioctl of a wedged device; ENODEV: gone


def probe_result(text: str, seconds: float | None = None, live: bool = True) -> ProbeResult:
    """The kmd child's JSON line (`xpuctl.probes.children.kmd`) → a ProbeResult, replies parsed here."""
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        data = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise KmdReplyError("kmd probe output is not the documented JSON")
    if data.get("error"):
        return ProbeResult("kmd", False, str(data["error"])[:400], None, seconds, live)
    priv = data.get("privileged") is True
    notes: tuple[str, ...] = () if priv else (
        "the kernel reports used memory only to CAP_PERFMON or CAP_SYS_ADMIN (run as root for it)",
    )
    devices = []
    for entry in data["devices"]:
        if not isinstance(entry, dict):
            raise KmdReplyError("kmd device entry is not an object")
        bdf, driver, reply = entry.get("bdf"), entry.get("driver"), entry.get("reply")
        if not isinstance(bdf, str) or not _BDF_RE.match(bdf) or driver not in ("xe", "i915"):
            raise KmdReplyError("kmd device entry without a PCI address or driver")
        if not isinstance(reply, str):
            err = entry.get("errno")
            lost = isinstance(err, int) and err in LOST_ERRNOS
            why = str(entry.get("error") or "no reply")[:400]
            devices.append(ProbeDevice(bdf, None, None, "lost" if lost else "ok", None, None, None, why))
            notes += (f"{bdf}: {why}",)
            continue
        try:
            raw = bytes.fromhex(reply)
        except ValueError:
            raise KmdReplyError("kmd reply is not hex") from None
        regions = parse_xe_mem_regions(raw) if driver == "xe" else parse_i915_memory_regions(raw)
        mem = device_memory(regions, priv)
        devices.append(ProbeDevice(
            bdf, None, None, "ok", mem.total_bytes, mem.used_bytes, None,
            None if priv else "used memory needs CAP_PERFMON (the kernel reports 0 without it)",
        ))
    if not devices:
        return ProbeResult("kmd", False, "no xe or i915 render node on this machine", None, seconds, live)
    return ProbeResult("kmd", True, None, None, seconds, live, tuple(devices), notes)
