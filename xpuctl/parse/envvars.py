"""Validate the device-selection variables Level Zero and SYCL read.

Returns a problem description (str) or None when the value is well formed. Rules from
compute-runtime (ZE_AFFINITY_MASK, ZE_FLAT_DEVICE_HIERARCHY) and intel/llvm
(ONEAPI_DEVICE_SELECTOR); see docs/intel.md, "Device-selection variables".
"""

from __future__ import annotations

import re

_MASK_ENTRY = re.compile(r"^\d+(\.\d+)?$")
_SELECTOR_TERM = re.compile(
    r"^!?(level_zero|opencl|cuda|hip|native_cpu|\*)"
    r":(\*|gpu|cpu|fpga|acc|\d+(\.(\d+|\*))?)(,(\*|gpu|cpu|fpga|acc|\d+(\.(\d+|\*))?))*$",
    re.IGNORECASE,
)
HIERARCHIES = ("COMPOSITE", "FLAT", "COMBINED")


def mask_indices(value: str) -> list[int] | None:
    """Root-device indices named by ZE_AFFINITY_MASK (`0,1`, `0.1` -> 0); None if malformed."""
    if value.strip() in ("", "default"):
        return []
    out: list[int] = []
    for entry in value.split(","):
        entry = entry.strip()
        if not _MASK_ENTRY.match(entry):
            return None
        idx = int(entry.split(".")[0])
        if idx not in out:
            out.append(idx)
    return out


def check_affinity_mask(value: str, device_count: int | None) -> str | None:
    indices = mask_indices(value)
    if indices is None:
        return (
            f"ZE_AFFINITY_MASK='{value}' is malformed: expected a comma list of device "
            "indices such as 0,1 or tiles such as 0.0,0.1"
        )
    if device_count is not None and indices:
        missing = [i for i in indices if i >= device_count]
        if missing:
            return (
                f"ZE_AFFINITY_MASK='{value}' names device index {missing[0]}, but this host "
                f"has {device_count} Intel GPU(s); Level Zero silently ignores it"
            )
    return None


def check_device_selector(value: str) -> str | None:
    terms = [t.strip() for t in value.split(";") if t.strip()]
    if not terms:
        return f"ONEAPI_DEVICE_SELECTOR='{value}' is empty: SYCL will see no device"
    for term in terms:
        if not _SELECTOR_TERM.match(term):
            return (
                f"ONEAPI_DEVICE_SELECTOR term '{term}' is malformed: expected "
                "backend:devices such as level_zero:0,1 or level_zero:gpu"
            )
    return None


def check_hierarchy(value: str) -> str | None:
    if value not in HIERARCHIES:
        return (
            f"ZE_FLAT_DEVICE_HIERARCHY='{value}' is not one of {', '.join(HIERARCHIES)} "
            "(exact, upper case); Level Zero ignores it"
        )
    return None
