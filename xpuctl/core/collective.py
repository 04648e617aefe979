"""Typed records of `doctor --collective` (probes/collective.py): each rank, each device's
rerun alone, the check's result. No I/O."""

from __future__ import annotations

from typing import NamedTuple


class CollectiveRank(NamedTuple):
    """One rank of the collective check: its device, the last phase it entered, how it ended."""

    rank: int
    device: int  # the torch.xpu index it used
    bdf: str
    phase: str | None
    returncode: int | None  # None: still running at the deadline (killed with the group)
    error: str | None


class AloneRun(NamedTuple):
    """One device's rerun alone (world size 1) after its group hung or failed."""

    bdf: str
    verdict: str  # ok | hung | failed | unavailable
    phase: str | None


class CollectiveResult(NamedTuple):
    """`doctor --collective` (probes/collective.run_collective): one init_process_group,
    all_reduce and destroy across the devices, bounded; on one device (`proof` "compute"), an
    allocation and a computation on the card, no process group and no collective (vLLM skips
    its warm-up all_reduce at world size 1: vLLM PR #52389)."""

    verdict: str  # ok | hung | failed | unavailable
    backend: str | None
    world_size: int
    seconds: float
    stuck_phase: str | None  # hung or failed: the phase it stopped in
    reason: str | None
    ranks: tuple[CollectiveRank, ...] = ()
    alone: tuple[AloneRun, ...] = ()
    # oneCCL-like files the ranks made (probes/collective), then, once doctor removed what
    # the stale-file rules allow, those kept ("path: why")
    files: tuple[str, ...] = ()
    proof: str = "all_reduce"  # what ran: "all_reduce" (two or more devices) or "compute"

    @property
    def bdfs(self) -> tuple[str, ...]:
        return tuple(r.bdf for r in self.ranks)
