"""xe's `survivability_mode` attribute (text in, the mode out).

Source: Linux drivers/gpu/drm/xe/xe_survivability_mode.c. The file
`/sys/bus/pci/devices/<bdf>/survivability_mode` exists only while the card is in survivability
mode (admin-only readable, 0400). `survivability_mode_show` prints
`Survivability mode type: Boot` or `... Runtime`, then for a boot failure one
`<name>: 0x<reg> - 0x<value>` line per scratch register (`Capability Info`, `Postcode Info`,
`Overflow Info`, `Auxiliary Info N`). Boot survivability loads the driver without a DRM card
(only the firmware can be flashed); runtime survivability declares the card wedged with the
vendor recovery method (DRM_WEDGE_RECOVERY_VENDOR). Either way only a firmware flash helps.
"""

from __future__ import annotations

import re

BOOT = "Boot"
RUNTIME = "Runtime"
UNKNOWN = "unknown"  # the file exists (the card is in survivability mode) but says nothing known

_TYPE = re.compile(r"^Survivability mode type:\s*(Boot|Runtime)\s*$")


def survivability_type(text: str) -> str:
    """`Boot`, `Runtime`, or `unknown` for a text without the type line (an older kernel
    printed only the scratch registers)."""
    for line in text.splitlines()[:16]:
        m = _TYPE.match(line.strip())
        if m:
            return m.group(1)
    return UNKNOWN
