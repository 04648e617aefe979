"""A device list as an operator types it: `--device 0 --device 1`, `--device 0,1`, `serve
--devices 0,1`: text in, the device specs out, in order.

One parser for every command's device options (`cli/paramtypes.DeviceList` at the command
line, `host/devices.resolve_device_specs` and serve's device selection after it), so every
command takes and refuses the same lists. A spec is a Level Zero index (`0`), a PCI address
(`0000:03:00.0`, or `03:00.0`), a node name or path (`renderD128`, `/dev/dri/card1`); which
device it names is decided against sysfs later (`host/devices.find_device`: an unknown one is
a usage error listing the devices). Refused here: an empty item (`0,,1`, `,0`, `0,`, ` `), a
spec named twice (`0,0`: a typo for `0,1` more often than not), and characters no spec has.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_SPEC = re.compile(r"[A-Za-z0-9:._/-]+\Z")


def split_devices(values: Iterable[str]) -> list[str]:
    """The specs `values` name (each value one spec or a comma list, spaces around an item
    ignored); ValueError naming the value and the fault."""
    out: list[str] = []
    for value in values:
        for item in value.split(","):
            spec = item.strip()
            if not spec:
                raise ValueError(f"{value!r} has an empty item: name devices as 0 or 0,1")
            if not _SPEC.match(spec):
                raise ValueError(f"{spec!r} is not a device: an index (0), a PCI address "
                                 "(0000:03:00.0) or a node (renderD128)")
            if spec in out:
                raise ValueError(f"device {spec!r} is named twice")
            out.append(spec)
    return out
