"""Deep probe (child process only): torch.xpu, with intel-extension-for-pytorch where needed.

Run as `python -m xpuctl.probes.children.torch_xpu`; prints one JSON line (`xpuctl.parse.probes`).
Never imported by the CLI process: it initialises SYCL/Level Zero and so becomes a DRM
client with a little device memory of its own. Uses `torch.xpu.is_available`,
`device_count`, `get_device_properties(i)` (name, total_memory, driver_version) and
`mem_get_info(i)` → (free, total). Index i is the i-th Intel GPU in PCI order (the parent
sets ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 and drops ZE_AFFINITY_MASK).

torch < 2.5 has no built-in XPU device: IPEX is imported first when it is installed.
"""

from __future__ import annotations

import re
from typing import Any

from xpuctl.probes.children.common import TORCH_XPU_INSTALL, run

IPEX_NOTE = (
    "intel-extension-for-pytorch is end-of-life (last release 2.8.10+xpu, repository "
    "archived): torch 2.5 or later supports Intel GPUs itself and needs no IPEX"
)
LOST_MARKERS = ("DEVICE_LOST", "device lost", "DEVICE_REQUIRES_RESET")


def torch_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _lost(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(marker.lower() in text.lower() for marker in LOST_MARKERS)


def _device(xpu: Any, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"bdf": None, "index": i, "name": None, "state": "ok", "reason": None,
                           "memory_total_bytes": None, "memory_used_bytes": None, "processes": None}
    try:
        props = xpu.get_device_properties(i)
        out["name"] = str(getattr(props, "name", "") or "") or None
        total = getattr(props, "total_memory", None)
        out["memory_total_bytes"] = int(total) if isinstance(total, int) else None
        driver = getattr(props, "driver_version", None)
        if driver:
            out["driver_version"] = str(driver)
        free, total2 = xpu.mem_get_info(i)
        out["memory_total_bytes"] = int(total2)
        out["memory_used_bytes"] = max(0, int(total2) - int(free))
    except Exception as exc:
        if _lost(exc):
            out["state"] = "lost"
        out["reason"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def probe() -> dict[str, Any]:
    result: dict[str, Any] = {"name": "torch", "available": False, "reason": None, "version": None,
                              "notes": [], "devices": []}
    try:
        import torch
    except ImportError:
        result["reason"] = f"torch is not installed (its XPU build: {TORCH_XPU_INSTALL})"
        return result
    except OSError as exc:
        result["reason"] = f"torch could not load a library: {exc}"
        return result
    version = str(getattr(torch, "__version__", "") or "")
    result["version"] = version or None
    parsed = torch_version(version)
    if parsed is not None and parsed < (2, 5):
        from importlib.util import find_spec

        if find_spec("intel_extension_for_pytorch") is None:
            result["reason"] = (
                f"torch {version} has no built-in XPU support (2.5 or later has) and "
                "intel-extension-for-pytorch is not installed"
            )
            return result
        try:
            import intel_extension_for_pytorch as ipex
        except Exception as exc:
            result["reason"] = f"intel-extension-for-pytorch failed to import: {type(exc).__name__}: {exc}"
            return result
        result["notes"].append(
            f"torch {version} needs intel-extension-for-pytorch "
            f"{getattr(ipex, '__version__', '?')} for XPU; {IPEX_NOTE}"
        )
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        result["reason"] = f"torch {version} has no torch.xpu"
        return result
    try:
        available = bool(xpu.is_available())
    except Exception as exc:
        result["reason"] = f"torch.xpu.is_available() raised {type(exc).__name__}: {exc}"
        return result
    if not available:
        result["reason"] = (
            f"torch.xpu.is_available() is False: torch {version} sees no XPU "
            f"(a build without XPU, as PyPI's: {TORCH_XPU_INSTALL}; or no Intel GPU driver)"
        )
        return result
    result["available"] = True
    result["devices"] = [_device(xpu, i) for i in range(int(xpu.device_count()))]
    for d in result["devices"]:
        driver = d.pop("driver_version", None)
        if d["state"] == "lost" and driver:
            d["reason"] = f"{d['reason']} (driver {driver})"
    return result


def main() -> None:
    run(probe, lambda why: {"name": "torch", "available": False, "reason": why})


if __name__ == "__main__":
    main()
