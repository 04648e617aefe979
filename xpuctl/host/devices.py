"""DRM devices from sysfs: /sys/class/drm/{cardN,renderDN}/{dev,device→PCI dir}.

Source: `/sys/class/drm/renderD128/device` links to the PCI function (`0000:03:00.0`), which
holds `vendor`, `device` and `driver` (a link to `…/drivers/xe`); `dev` holds `226:128`.
Equivalent: `intel_gpu_top -L`, `xpu-smi discovery`.

A card xe holds in survivability mode has `survivability_mode` in its PCI directory
(parse/survivability.py); in boot survivability xe makes no DRM node for it, so the cards xe
is bound to (`/sys/bus/pci/drivers/xe/<bdf>`) are looked at too: such a card is listed without
nodes and without a Level Zero index (Level Zero does not see it).

xe's `gpu_health` in the same PCI directory is the card's own verdict (ok, warning, critical:
parse/health.py); a kernel without it has no file, and the device's `health` is None.
"""

from __future__ import annotations

import re
from typing import Any

from xpuctl.core.model import Device, Issue
from xpuctl.host.seam import Host

DRM_MAJOR = 226
_NODE_RE = re.compile(r"^(card|renderD)(\d+)$")
_BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
SYS_DRM = "/sys/class/drm"
XE_BOUND = "/sys/bus/pci/drivers/xe"
SURVIVABILITY = "survivability_mode"
GPU_HEALTH = "gpu_health"


def _read_strip(host: Host, path: str) -> str | None:
    try:
        return host.read_text(path, 4096).strip() or None
    except OSError:
        return None


def _minor_of(host: Host, name: str, number: int) -> int | None:
    dev = _read_strip(host, f"{SYS_DRM}/{name}/dev")
    if dev:
        major, _, minor = dev.partition(":")
        if major.strip().isascii() and major.strip().isdigit() and minor.strip().isascii() and minor.strip().isdigit():
            return int(minor) if int(major) == DRM_MAJOR else None
    # no `dev` file: the node name carries the minor (renderD128 -> 128, card0 -> 0)
    return number


def _survivability(host: Host, pci: str) -> str | None:
    """The card's survivability mode type, None when it is not in survivability mode. The
    file is root-only: one that exists but cannot be read is `unknown`."""
    path = f"{pci}/{SURVIVABILITY}"
    if not host.exists(path):
        return None
    from xpuctl.parse.survivability import UNKNOWN, survivability_type

    try:
        return survivability_type(host.read_text(path, 4096))
    except OSError:
        return UNKNOWN


def _health(host: Host, pci: str) -> str | None:
    """The card's gpu_health (ok | warning | critical | unknown), None without the file."""
    path = f"{pci}/{GPU_HEALTH}"
    if not host.exists(path):
        return None
    from xpuctl.parse.health import UNKNOWN as NOT_SAID
    from xpuctl.parse.health import gpu_health

    try:
        return gpu_health(host.read_text(path, 4096))
    except OSError:
        return NOT_SAID


def _nodeless(host: Host, known: set[str]) -> list[Device]:
    """Cards xe is bound to that have no DRM node and are in (boot) survivability mode."""
    try:
        names = host.listdir(XE_BOUND)
    except OSError:
        return []
    out = []
    for bdf in sorted(n for n in names if _BDF_RE.match(n) and n not in known):
        try:
            pci = host.resolve(f"{XE_BOUND}/{bdf}")
        except OSError:
            continue
        mode = _survivability(host, pci)
        if mode is None:
            continue
        out.append(Device(bdf=bdf, vendor_id=_norm_id(_read_strip(host, f"{pci}/vendor")),
                          device_id=_norm_id(_read_strip(host, f"{pci}/device")), driver="xe",
                          render_node=None, card_node=None, minors=(), memory_total_bytes=None,
                          survivability=mode, health=_health(host, pci)))
    return out


def _memory_total(host: Host, pci: str, card: str | None, driver: str | None) -> int | None:
    total = 0
    found = False
    try:
        entries = host.listdir(pci)
    except OSError:
        entries = []
    for entry in sorted(entries):
        if entry.startswith("tile") and entry[4:].isascii() and entry[4:].isdigit():
            value = _read_strip(host, f"{pci}/{entry}/physical_vram_size_bytes")
            if value and value.isascii() and value.isdigit():
                total += int(value)
                found = True
    if found:
        return total
    if card:
        value = _read_strip(host, f"{SYS_DRM}/{card}/lmem_total_bytes")
        if value and value.isascii() and value.isdigit():
            return int(value)
    return None


def scan_devices(host: Host) -> tuple[list[Device], list[Issue]]:
    """All DRM devices, Intel ones numbered in Level Zero order (by PCI BDF). Each read is
    bounded (host/reads/): an attribute that did not answer (a device in reset) is
    unknown, and named in the issues."""
    if host.reader is not None:
        found: tuple[list[Device], list[Issue]] = host.reader.call(scan_devices, host)
        return found
    devices, issues = _scan_devices(host)
    issues.extend(Issue(b.path, b.reason) for b in host.blocked_reads() if b.pid is None)
    return devices, issues


def _scan_devices(host: Host) -> tuple[list[Device], list[Issue]]:
    issues: list[Issue] = []
    try:
        names = host.listdir(SYS_DRM)
    except OSError as exc:
        return [], [Issue(SYS_DRM, f"no DRM devices visible ({exc.strerror or exc})")]
    by_bdf: dict[str, dict[str, Any]] = {}
    for name in sorted(names):
        m = _NODE_RE.match(name)
        if not m:
            continue  # connectors (card0-DP-1), version
        minor = _minor_of(host, name, int(m.group(2)))
        if minor is None:
            continue
        try:
            pci = host.resolve(f"{SYS_DRM}/{name}/device")
        except OSError as exc:
            issues.append(Issue(f"{SYS_DRM}/{name}", f"unreadable: {exc}"))
            continue
        if not host.exists(pci):
            issues.append(Issue(f"{SYS_DRM}/{name}/device", "missing PCI device link"))
            continue
        bdf = pci.rstrip("/").rsplit("/", 1)[-1]
        rec = by_bdf.setdefault(bdf, {"pci": pci, "minors": [], "render": None, "card": None})
        rec["minors"].append(minor)
        if m.group(1) == "renderD":
            rec["render"] = name
        else:
            rec["card"] = name
    devices: list[Device] = []
    for bdf, rec in by_bdf.items():
        pci = rec["pci"]
        driver = None
        try:
            driver = host.readlink(f"{pci}/driver").rstrip("/").rsplit("/", 1)[-1] or None
        except OSError:
            pass
        devices.append(
            Device(
                bdf=bdf,
                vendor_id=_norm_id(_read_strip(host, f"{pci}/vendor")),
                device_id=_norm_id(_read_strip(host, f"{pci}/device")),
                driver=driver,
                render_node=f"/dev/dri/{rec['render']}" if rec["render"] else None,
                card_node=f"/dev/dri/{rec['card']}" if rec["card"] else None,
                minors=tuple(sorted(rec["minors"])),
                memory_total_bytes=_memory_total(host, pci, rec["card"], driver),
                survivability=_survivability(host, pci) if driver == "xe" else None,
                health=_health(host, pci),
            )
        )
    devices.extend(_nodeless(host, set(by_bdf)))
    return number_devices(devices), issues


def _norm_id(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return f"0x{int(value, 16):04x}"
    except ValueError:
        return value


def number_devices(devices: list[Device]) -> list[Device]:
    """Intel devices first, in BDF order with their Level Zero index; then the others. A
    card without a DRM node (boot survivability) is invisible to Level Zero: no index."""
    intel = sorted((d for d in devices if d.is_intel and d.nodes), key=lambda d: d.bdf)
    other = sorted((d for d in devices if not (d.is_intel and d.nodes)), key=lambda d: d.bdf)
    return [d._replace(index=i) for i, d in enumerate(intel)] + [
        d._replace(index=None) for d in other
    ]


def select_devices(devices: list[Device] | tuple[Device, ...], specs: list[str]) -> list[Device]:
    """Resolve `--device` values (index, BDF, node name or path) to devices.

    Raises UsageError naming the devices that exist.
    """
    from xpuctl.errors import UsageError

    chosen: list[Device] = []
    for spec in specs:
        dev = find_device(devices, spec)
        if dev is None:
            known = ", ".join(
                f"{d.index if d.index is not None else '-'}={d.bdf}"
                f"({(d.render_node or d.card_node or '?').rsplit('/', 1)[-1]})"
                for d in devices
            )
            raise UsageError(f"unknown device {spec!r}; devices here: {known or 'none'}")
        if dev not in chosen:
            chosen.append(dev)
    return chosen


def find_device(devices: list[Device] | tuple[Device, ...], spec: str) -> Device | None:
    s = spec.strip()
    if s.isascii() and s.isdigit():
        return next((d for d in devices if d.index == int(s)), None)
    low = s.lower()
    name = low.rsplit("/", 1)[-1]
    for d in devices:
        if d.bdf.lower() == low or (d.bdf.lower().endswith(":" + low) and low.count(":") == 1):
            return d
        for node in d.nodes:
            if node.lower() == low or node.rsplit("/", 1)[-1].lower() == name:
                return d
    return None


def device_specs(values: list[str]) -> list[str]:
    """The specs of `--device`/`--devices` values (parse/devspec.py, the one parser);
    UsageError (exit 2) for a bad list."""
    from xpuctl.errors import UsageError
    from xpuctl.parse.devspec import split_devices

    try:
        return split_devices(values)
    except ValueError as exc:
        raise UsageError(f"devices: {exc}") from None


def resolve_device_specs(host: Host, values: list[str]) -> tuple[str, ...]:
    """BDFs for `--device` values (each may be a comma list, as for serve --devices);
    UsageError (exit 2) for a bad list or an unknown device."""
    if not values:
        return ()
    specs = device_specs(values)
    devices, _ = scan_devices(host)
    return tuple(d.bdf for d in select_devices(devices, specs))
