"""Parse DRM fdinfo and dma-buf fdinfo text (Documentation/gpu/drm-usage-stats.rst).

Lenient by design: any key order, units none/B/KiB/MiB/GiB, garbage lines ignored, a bad
value never raises. Memory of a client is the sum of its `drm-total-vram<N>` (xe) and
`drm-total-local<N>` (i915) regions; stolen, system and gtt regions are not device memory
allocated by the client. As the kernel document defines them, `drm-total-<region>` is the
client's private plus shared buffers, `drm-shared-<region>` the shared part (buffers shared
with another file: another client may count the same buffer) and `drm-resident-<region>` what
is resident in the region; shared and resident are summed over the same device regions.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
# ASCII digits only, at most 24 of them (int() rejects '²' and very long numbers)
_SIZE_RE = re.compile(r"^\s*([0-9]{1,24})\s*([A-Za-z]*)\s*$", re.ASCII)
_DEVICE_REGION_RE = re.compile(r"^(?:vram|local)\d+$")


def parse_size(value: str) -> int | None:
    """`23992 KiB` -> bytes; None for anything that is not a size."""
    m = _SIZE_RE.match(value)
    if not m:
        return None
    mult = _UNITS.get(m.group(2).lower())
    if mult is None:
        return None
    return int(m.group(1)) * mult


def _pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if not key or " " in key:
            continue
        out.setdefault(key, value.strip())
    return out


class Fdinfo(NamedTuple):
    """The DRM part of one fdinfo file."""

    driver: str | None
    pdev: str | None
    client_id: int | None
    memory_bytes: int | None
    regions: dict[str, int]  # drm-total-<region> sizes
    keys: dict[str, str]  # every drm-* key
    shared_bytes: int | None = None  # drm-shared-<device region>: part of memory_bytes
    resident_bytes: int | None = None  # drm-resident-<device region>


def parse_fdinfo(text: str) -> Fdinfo:
    pairs = _pairs(text)
    keys = {k: v for k, v in pairs.items() if k.startswith("drm-")}
    regions: dict[str, int] = {}
    for key, value in keys.items():
        if not key.startswith("drm-total-") or key.startswith("drm-total-cycles-"):
            continue
        size = parse_size(value)
        if size is not None:
            regions[key[len("drm-total-") :]] = size
    device = [size for region, size in regions.items() if _DEVICE_REGION_RE.match(region)]
    cid = keys.get("drm-client-id", "")

    def device_sum(prefix: str) -> int | None:
        sizes = [parse_size(v) for k, v in keys.items()
                 if k.startswith(prefix) and _DEVICE_REGION_RE.match(k[len(prefix):])]
        known = [s for s in sizes if s is not None]
        return sum(known) if known else None

    return Fdinfo(
        driver=keys.get("drm-driver") or None,
        pdev=keys.get("drm-pdev") or None,
        client_id=int(cid) if cid.isascii() and cid.isdigit() and len(cid) <= 24 else None,
        memory_bytes=sum(device) if device else None,
        regions=regions,
        keys=keys,
        shared_bytes=device_sum("drm-shared-"),
        resident_bytes=device_sum("drm-resident-"),
    )


class Dmabuf(NamedTuple):
    """A dma-buf fd: a buffer exported by a driver, alive while any fd on it is open."""

    size_bytes: int | None
    exporter: str | None
    inode: int | None


def parse_dmabuf(text: str) -> Dmabuf | None:
    pairs = _pairs(text)
    exporter = pairs.get("exp_name") or None
    size = parse_size(pairs.get("size", ""))
    if exporter is None and size is None:
        return None
    ino = pairs.get("ino", "")
    inode = int(ino) if ino.isascii() and ino.isdigit() and len(ino) <= 24 else None
    return Dmabuf(size_bytes=size, exporter=exporter, inode=inode)
