"""The card's own word on its health (text in, a verdict out).

- xe's `gpu_health` attribute, in the card's PCI device directory (the one
  `/sys/class/drm/cardN/device` and `/sys/bus/pci/devices/<bdf>` lead to): `ok`, `warning` or
  `critical` (issue 37; the attribute is newer than most kernels: a missing file says
  nothing). A text without one of those words is `unknown`.
- Level Zero Sysman's health extension (`zesDeviceGetHealthStatusExt`): OK, WARNING,
  CRITICAL or FAILED, kept across resets (a FAILED card stays FAILED: a reset or a rebind
  cannot bring it back). The Sysman probe child prints the name
  (xpuctl/probes/children/sysman.py).

One scale for both, worst last: ok < warning < critical < failed.
"""

from __future__ import annotations

import re

OK, WARNING, CRITICAL, FAILED = "ok", "warning", "critical", "failed"
UNKNOWN = "unknown"
#: gpu_health's values; Sysman's are these and FAILED, upper case
GPU_HEALTH = (OK, WARNING, CRITICAL)
SYSMAN = ("OK", "WARNING", "CRITICAL", "FAILED")
RANK = {OK: 0, WARNING: 1, CRITICAL: 2, FAILED: 3}

_WORD = re.compile(r"\b(ok|warning|critical)\b", re.IGNORECASE)


def gpu_health(text: str) -> str:
    """`ok`, `warning`, `critical`, or `unknown` for a text that names none (the first of
    its first lines that does)."""
    for line in text.splitlines()[:4]:
        m = _WORD.search(line)
        if m:
            return m.group(1).lower()
    return UNKNOWN


def sysman_health(value: object) -> str | None:
    """A Sysman health name (`OK` … `FAILED`, or the enum's full name
    `ZES_DEVICE_HEALTH_STATUS_EXT_FAILED`) on the one scale; None for anything else."""
    if not isinstance(value, str):
        return None
    name = value.strip().upper().rsplit("_", 1)[-1]
    return name.lower() if name in SYSMAN else None


def worst(*levels: str | None) -> str | None:
    """The worst known level of those given (None and `unknown` count for nothing)."""
    known = [lv for lv in levels if lv in RANK]
    return max(known, key=RANK.__getitem__) if known else None
