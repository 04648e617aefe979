"""The kernel log as /dev/kmsg gives it, and the GPU driver records xpuctl acts on.

Format (Linux Documentation/ABI/testing/dev-kmsg): one record per read(2) of /dev/kmsg,
`PRI,SEQ,USEC,FLAGS;TEXT\\n`, PRI = facility * 8 + level, USEC = microseconds since boot,
FLAGS `-` (or `c` for a continuation on old kernels); bytes below 0x20 (an embedded newline),
0x7f and above, and the backslash itself are escaped as `\\xNN` in TEXT; the record may be
followed by dictionary lines that start with a space (` SUBSYSTEM=pci`, ` DEVICE=+pci:BDF`).
Under `--root` the file is these records one after the other.

The driver records (see docs/kernel.md for each message's source):

- wedged: xe_device_declare_wedged (Linux drivers/gpu/drm/xe/xe_device.c) "CRITICAL: Xe has
  declared device BDF as wedged."; i915 (Linux drivers/gpu/drm/i915/i915_gem.c, i915_gem_pm.c,
  intel_reset.c) "Failed to initialize GPU, declaring it wedged!", "Failed to re-initialize
  GPU, declaring it wedged!", "Failed to idle engines, declaring wedged!", "Failed to reset chip";
- hang or reset (a warning): i915's "GPU HANG: ecode …" (i915_gpu_error.c) and "Resetting chip
  for …" / "Resetting ENGINE for …" (intel_reset.c, intel_engine_heartbeat.c); xe's "Timedout
  job: …", "Engine reset: engine_class=…" (xe_guc_submit.c), "GT0: reset started", "GT0: reset
  failed", "GuC engine reset request failed", "Xe device coredump has been created" (xe_gt.c,
  xe_guc_submit.c, xe_devcoredump.c);
- the recovery the driver asks for: drm_dev_wedged_event (Linux drivers/gpu/drm/drm_drv.c)
  sends the uevent `WEDGED=<method>[,<method>]` (rebind, bus-reset, vendor-specific since
  DRM_WEDGE_RECOVERY_VENDOR; none: recovered) and logs "device wedged, needs recovery" (or
  "but recovered through reset"); a line that quotes `WEDGED=…` (a udev monitor's, a
  driver's) is taken with its method; xe's runtime survivability mode
  (xe_survivability_mode.c, which sets DRM_WEDGE_RECOVERY_VENDOR) logs "Firmware update
  required" (later "Firmware flash required"): wedged, method vendor-specific;
- initialised: drm_dev_register's "[drm] Initialized DRIVER X.Y.Z [DATE] for BDF on minor N"
  (Linux drivers/gpu/drm/drm_drv.c): the device came back (a rebind, a module reload).

The device of a record is the BDF in its dev_printk prefix (`xe 0000:03:00.0: [drm] …`), else
its DEVICE=+pci:BDF dictionary line, else a BDF named in the text.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

_BDF = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
#: Texts that mark a record the drivers care about: records without one are dropped early
#: (a kernel log holds thousands of other records).
DRIVERS = ("xe", "i915")
_RELEVANT = ("xe ", "i915 ", "[drm]", "Xe ", "GPU HANG", "WEDGED=")


class KmsgRecord(NamedTuple):
    """One record of the kernel log."""

    level: int  # 0 emerg .. 7 debug
    facility: int  # 0 kernel
    seq: int
    usec: int  # since boot
    text: str  # unescaped: an embedded newline is a newline again
    device: str | None  # DEVICE=+pci:BDF of its dictionary, when there is one

    @property
    def seconds(self) -> float:
        return self.usec / 1e6

    def line(self) -> str:
        """Its first line, as `dmesg` shows it (without the time)."""
        return self.text.split("\n", 1)[0]


#: What a driver record says about its device.
WEDGED = "wedged"
HANG = "hang"
INITIALIZED = "initialized"


class GpuEvent(NamedTuple):
    kind: str  # wedged | hang | initialized
    bdf: str
    driver: str | None
    record: KmsgRecord
    # a wedged record's recovery method(s) as the uevent names them ("rebind,bus-reset",
    # "vendor-specific"), when the record tells
    method: str | None = None


VENDOR = "vendor-specific"
#: the uevent's methods (drm_get_wedge_recovery), and "unknown" (no method given)
METHODS = ("none", "rebind", "bus-reset", VENDOR, "unknown")
class _Patterns:
    """The patterns of the records, compiled on first use (`_rx`): compiling them all took
    each doctor run 3 ms, and a log without a GPU driver's record (most hosts, most of the
    time) needs none of them."""

    def __init__(self) -> None:
        c = re.compile
        self.header = c(r"^(\d+),(\d+),(\d+),([^;,]*)[^;]*;")
        self.escape = c(r"\\x([0-9a-fA-F]{2})")
        self.prefix = c(rf"^(xe|i915) ({_BDF}): ")
        self.device = c(rf"^DEVICE=\+pci:({_BDF})$")
        self.any_bdf = c(_BDF)
        self.method = c(r"\bWEDGED=([a-z-]{1,20}(?:,[a-z-]{1,20}){0,4})")
        self.vendor_said = c(r"Firmware (?:update|flash) required")
        self.initialized = c(
            rf"\[drm\] Initialized (xe|i915) \S+(?: \d+)? for ({_BDF}) on minor (\d+)")
        self.wedged = (
            c(rf"CRITICAL: Xe has declared device ({_BDF}) as wedged"),
            c(r"Failed to (?:re-)?initialize GPU, declaring it wedged"),
            c(r"Failed to idle engines, declaring wedged"),
            c(r"Failed to reset chip"),
            c(r"device wedged, needs recovery"),
        )
        self.hangs = (
            c(r"GPU HANG: ecode"),
            c(r"Resetting chip for "),
            c(r"Resetting \w+ for "),
            c(r"Timedout job: "),
            # xe_guc_submit.c xe_guc_exec_queue_reset_handler: xe_gt_info "Engine reset:
            # engine_class=%s, logical_mask: 0x%x, guc_id=%d" (the GuC reset an engine)
            c(r"Engine reset: engine_class="),
            # xe_gt.c gt_reset: xe_gt_info "reset started" (printed "GT0: reset started",
            # "Tile0: GT0: reset started" on newer kernels); drm_info "GT reset started"
            # before the GT prefix
            c(r"\bGT\d+: reset started|\bGT reset started"),
            c(r"GT\d+: reset failed"),
            c(r"GuC engine reset request failed"),
            c(r"Xe device coredump has been created"),
            c(r"device wedged, but recovered through reset"),
        )


@functools.cache
def _rx() -> _Patterns:
    return _Patterns()


def _unescape(text: str) -> str:
    return _rx().escape.sub(lambda m: chr(int(m.group(1), 16)), text) if "\\x" in text else text


def parse_kmsg(text: str, relevant_only: bool = False) -> list[KmsgRecord]:
    """Every well-formed record, in order; a malformed line is skipped. `relevant_only`:
    only the records that may concern a GPU driver (cheaper on a long log)."""
    out: list[KmsgRecord] = []
    current: KmsgRecord | None = None
    for line in text.split("\n"):
        if line.startswith(" "):
            if current is not None:
                m = _rx().device.match(line[1:])
                if m and current.device is None:
                    current = current._replace(device=m.group(1).lower())
            continue
        if current is not None:
            out.append(current)
            current = None
        if relevant_only and not any(word in line for word in _RELEVANT):
            continue  # the common case on a long log: no regex for it
        m = _rx().header.match(line)
        if m is None:
            continue
        body = line[m.end():]
        if relevant_only and not any(word in body for word in _RELEVANT):
            continue
        pri = int(m.group(1))
        current = KmsgRecord(pri & 7, pri >> 3, int(m.group(2)), int(m.group(3)),
                             _unescape(body), None)
    if current is not None:
        out.append(current)
    return out


def relevant_text(text: str) -> str:
    """The records of `text` that may concern a GPU driver, in kmsg format again: what a
    snapshot keeps of the kernel log (never the rest of it)."""
    keep: list[str] = []
    taking = False
    for line in text.split("\n"):
        if line.startswith(" "):
            if taking:
                keep.append(line)
            continue
        m = _rx().header.match(line)
        taking = m is not None and any(word in line[m.end():] for word in _RELEVANT)
        if taking:
            keep.append(line)
    return "".join(f"{line}\n" for line in keep)


def _device_of(rec: KmsgRecord) -> tuple[str | None, str | None]:
    m = _rx().prefix.match(rec.text)
    if m:
        return m.group(2).lower(), m.group(1)
    if rec.device:
        return rec.device, None
    found = _rx().any_bdf.search(rec.text)
    return (found.group(0).lower() if found else None), None


def _kind(text: str, method: str | None) -> tuple[str | None, str | None]:
    """(wedged | hang | None, the BDF the text names when it says so)."""
    if method is not None and method != "none":
        return WEDGED, None
    for pattern in _rx().wedged:
        m = pattern.search(text)
        if m:
            return WEDGED, m.group(1).lower() if m.groups() else None
    if any(p.search(text) for p in _rx().hangs):
        return HANG, None
    return None, None


def gpu_events(records: list[KmsgRecord]) -> list[GpuEvent]:
    """The records that say a GPU was declared wedged, hung or was reset, or initialised,
    with the device they name, in log order. A record without a device is left out."""
    out: list[GpuEvent] = []
    for rec in records:
        text = rec.text
        init = _rx().initialized.search(text)
        if init:
            out.append(GpuEvent(INITIALIZED, init.group(2).lower(), init.group(1), rec))
            continue
        method = wedge_method(text)
        kind, named = _kind(text, method)
        if kind is None:
            continue
        bdf, driver = _device_of(rec)
        bdf = named or bdf
        if bdf is None:
            continue
        if driver is None and "Xe " in text:
            driver = "xe"
        out.append(GpuEvent(kind, bdf, driver, rec, method if kind == WEDGED else None))
    return out


def wedge_method(text: str) -> str | None:
    """The recovery a record names: the uevent's `WEDGED=` methods as given (known ones
    only, in their order), vendor-specific for xe's "Firmware update required"; else None."""
    m = _rx().method.search(text)
    if m:
        known = [w for w in m.group(1).split(",") if w in METHODS]
        return ",".join(dict.fromkeys(known)) or None
    return VENDOR if _rx().vendor_said.search(text) else None
