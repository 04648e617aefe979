"""Stale shm and IPC files left by killed processes."""

from __future__ import annotations

from xpuctl.core.checks.registry import Ctx, check
from xpuctl.core.model import Artifact, Finding
from xpuctl.core.units import human_bytes


def _remedy(c: Ctx) -> str:
    """A stale file is tied to no device: reset --device leaves it (docs/safety.md)."""
    if c.wanted:
        return "xpuctl reset (without --device: a file whose process is gone is tied to no device)"
    return "xpuctl reset"
def _stale(c: Ctx, directory: str, libfabric: bool) -> list[Artifact]:
    return [a for a in c.scan.artifacts if a.stale and a.path.startswith(directory + "/")
            and (a.kind == "libfabric") == libfabric]


@check("stale-shm")
def stale_shm(c: Ctx) -> list[Finding]:
    """Shared-memory segments in /dev/shm that no live process has open or mapped (vLLM's,
    torch's, oneCCL's GPU build; libfabric's regions are `stale-libfabric`)."""
    stale = _stale(c, "/dev/shm", False)
    if not stale:
        return []
    size = sum(a.size_bytes for a in stale)
    return [
        Finding(
            "stale-shm",
            "warn",
            f"{len(stale)} stale shared-memory segment(s) in /dev/shm "
            f"({human_bytes(size)}) left by killed processes",
            _remedy(c),
            None,
            (),
            tuple(a.path for a in stale),
        )
    ]


@check("stale-libfabric")
def stale_libfabric(c: Ctx) -> list[Finding]:
    """libfabric shm regions `/dev/shm/<pid>:<uid>:<n>` (oneCCL with `FI_PROVIDER=shm` or
    `CCL_ATL_SHM=1`) whose rank is gone: they fill /dev/shm, and the next oneCCL start fails
    with `fi_getinfo error: ret -61` / `failed to initialize ATL`."""
    stale = _stale(c, "/dev/shm", True)
    if not stale:
        return []
    size = sum(a.size_bytes for a in stale)
    return [
        Finding(
            "stale-libfabric",
            "warn",
            f"{len(stale)} leaked libfabric shared-memory region(s) in /dev/shm "
            f"({human_bytes(size)}) left by killed oneCCL ranks; with enough of them the next "
            "oneCCL start fails (fi_getinfo error: ret -61, failed to initialize ATL)",
            _remedy(c),
            None,
            (),
            tuple(a.path for a in stale),
        )
    ]


@check("stale-ipc")
def stale_ipc(c: Ctx) -> list[Finding]:
    """oneCCL, vLLM FileStore and ZMQ files in /tmp that nothing uses any more."""
    stale = _stale(c, "/tmp", False)
    if not stale:
        return []
    kinds = sorted({a.kind for a in stale})
    return [
        Finding(
            "stale-ipc",
            "warn",
            f"{len(stale)} stale IPC file(s) ({', '.join(kinds)}) in /tmp",
            _remedy(c),
            None,
            (),
            tuple(a.path for a in stale),
        )
    ]
