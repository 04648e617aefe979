"""What a shutdown will stop: the server trees that NAME, --pid, --port, --device or --all
name (with their run records), and the processes it will wait for."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from xpuctl.host.seam import Host

if TYPE_CHECKING:  # types only: the modules load where used (a dry run needs no signals)
    from xpuctl.actions.signals import Target
    from xpuctl.core.runrecords import Unread
    from xpuctl.shutdown.targets import ServerTree


def find_targets(host: Host, state_dir: str | None, name: str | None, pid: int | None, port: int | None,
                 specs: list[str], all_: bool, environ: Mapping[str, str]) -> list[ServerTree]:
    """The trees to stop (NotFoundError, exit 3, when NAME, --pid or --port match nothing).
    `environ`: the command's (where Ray is)."""
    from xpuctl.host.devices import resolve_device_specs
    from xpuctl.shutdown import targets
    from xpuctl.state import runs
    from xpuctl.state.live import recorded

    records = []
    if state_dir and os.path.isdir(state_dir):
        found = runs.read_runs(runs.ensure_state_dir(state_dir, create=False))
        records = found.records
        if name is not None and not any(r.name == name for r in records):
            _damaged(name, found.unread)
    bdfs = resolve_device_specs(host, specs)
    from xpuctl.host.scan import take_scan
    from xpuctl.ray.actors import with_ray

    # finding trees needs no files; Ray actors on an existing cluster join their run's tree;
    # the records are what proves a process's XPUCTL_RUN_ID
    scan = with_ray(host, take_scan(host, port=port, artifacts=False, runs=recorded(records)),
                    environ)
    return targets.find_trees(host, scan, records, name, pid, port, bdfs, all_)


def _damaged(name: str, unread: list[Unread]) -> None:
    """NAME has no record that could be read, but its file (or the directory of records) is
    there: DamagedRecordError (exit 1), never "no such run" (exit 3): the run may live."""
    from xpuctl.output.safetext import safe
    from xpuctl.state.runs import DamagedRecordError

    bad = next((u for u in unread if u.name == name), None) or next(
        (u for u in unread if u.name is None), None)
    if bad is not None:
        raise DamagedRecordError(f"run {name!r}: {safe(bad.line())}; stop its server with "
                                 "--pid or --port")


def planned_members(host: Host, trees: list[ServerTree]) -> dict[int, list[int]]:
    """Each tree's processes, by its top pid, as they are now."""
    from xpuctl.shutdown import targets

    return {t.top.pid: [m.pid for m in targets.members(host, t)] for t in trees}



def recorded_top(host: Host, state_dir: str | None, name: str) -> ServerTree | None:
    """The tree of the run NAME (a request that names only it) whose record still ties it to
    the process serve launched: its top, identified by pid and start ticks (one read of its
    stat), with the record's budgets; None when the request must take the full scan first
    (no record, no recorded identity, the top gone or someone else's, or a run on an
    existing Ray cluster, whose actors are listed before any signal)."""
    from xpuctl.actions.signals import target_of
    from xpuctl.parse.roles import API_SERVER
    from xpuctl.shutdown import targets
    from xpuctl.state import runs

    if not state_dir or not os.path.isdir(state_dir):
        return None
    rec = runs.read_record(state_dir, name)
    if (rec is None or rec.state not in runs.ACTIVE_STATES or not rec.pid
            or rec.start_ticks is None or getattr(rec, "ray_cluster", None) not in (None, "local")):
        return None
    top = target_of(host, rec.pid, "api-server", rec.start_ticks)
    if top is None:
        return None
    tree = targets.ServerTree(top=top, role=API_SERVER, orphan=False, known=[top])
    targets.apply_record(tree, rec)
    return tree


def with_top(tree: ServerTree, top: Target, never_ready: bool) -> ServerTree:
    """A tree found after its recorded top was signalled keeps that top (what the ladder
    waits on and watches first), and the record's budget as it was before "stopping"."""
    if tree.top.pid != top.pid:
        tree.known = [tree.top, *tree.known]
        tree.top = top
        tree.orphan = False
    tree.never_ready = never_ready
    return tree
