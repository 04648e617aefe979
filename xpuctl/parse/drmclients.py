"""The i915 backport's per-client sysfs directory (text in, records out).

intel-i915-dkms (the driver Data Center GPU Max hosts run) may print no memory keys in fdinfo;
it keeps per-client figures in `/sys/class/drm/cardN/clients/<id>/`: `pid`, `name`, and
`total_device_memory_buffer_objects/created_bytes` and `.../imported_bytes`. Level Zero Sysman
reads them there as numbers (compute-runtime level_zero/sysman/source/api/global_operations/
linux/sysman_os_global_operations_imp.cpp: `pid`, then created_bytes as the process's memory
and imported_bytes as its shared memory). A value that is not a decimal number is None.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_NUMBER_RE = re.compile(r"^\s*<?\s*([0-9]{1,20})\s*>?\s*$", re.ASCII)
MEMORY_DIR = "total_device_memory_buffer_objects"


class SysfsClient(NamedTuple):
    client_id: str
    pid: int | None
    name: str | None
    created_bytes: int | None
    imported_bytes: int | None


def _number(text: str | None) -> int | None:
    m = _NUMBER_RE.match(text) if text is not None else None
    return int(m.group(1)) if m else None


def parse_client(client_id: str, pid: str | None, name: str | None, created: str | None,
                 imported: str | None) -> SysfsClient:
    """One client directory's files (None: the file could not be read)."""
    clean = name.strip()[:64] if name is not None else ""
    return SysfsClient(client_id, _number(pid) or None, clean or None, _number(created), _number(imported))
