"""The checks' registry: the options doctor judges with, the context every check reads, and
`@check`, which registers a check function under its stable id."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from xpuctl.core.model import Device, Finding, Process, Scan


class Options(NamedTuple):
    devices: tuple[str, ...] = ()  # BDFs to look at; empty = all
    port: int | None = 8000
    port_explicit: bool = False
    expect_idle: bool = False
    unattributed_threshold: int = 1 << 30  # --deep: device memory no visible process explains


class Ctx(NamedTuple):
    """What every check needs, computed once per evaluation."""

    scan: Scan
    opts: Options
    wanted: frozenset[str]
    by_pid: dict[int, Process]
    trees: dict[int, list[Process]]  # orphaned trees: top pid → live members
    #: (pid, card) → the device memory (fdinfo drm-total) of the DRM clients it holds there
    memory: dict[tuple[int, str], int]

    def on_wanted(self, bdfs: tuple[str, ...] | set[str] | list[str]) -> bool:
        """True when nothing was asked for, the thing holds no device, or it holds a wanted one."""
        return not self.wanted or not bdfs or bool(self.wanted & set(bdfs))

    def devices(self) -> Iterator[Device]:
        return (d for d in self.scan.devices if not self.wanted or d.bdf in self.wanted)


Check = Callable[[Ctx], list[Finding]]
REGISTRY: dict[str, Check] = {}


def check(check_id: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        REGISTRY[check_id] = fn
        return fn

    return register


def pids(procs: list[Process]) -> tuple[int, ...]:
    return tuple(sorted(p.pid for p in procs))



def holders(c: Ctx, bdf: str) -> list[Process]:
    return [c.by_pid[pid] for pid in c.scan.holders(bdf) if pid in c.by_pid]
