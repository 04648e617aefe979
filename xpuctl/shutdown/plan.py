"""What a shutdown will stop: the server trees that NAME, --pid, --port, --device or --all
name (with their run records), and the processes it will wait for."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from xpuctl.host.seam import Host


def find_targets(host: Host, state_dir: str | None, name: str | None, pid: int | None, port: int | None,
                 specs: list[str], all_: bool, environ: Mapping[str, str]) -> list[Any]:
    """The trees to stop (NotFoundError, exit 3, when NAME, --pid or --port match nothing).
    `environ`: the command's (where Ray is)."""
    from xpuctl.host.devices import resolve_device_specs
    from xpuctl.shutdown import targets
    from xpuctl.state import runs

    records = []
    if state_dir and os.path.isdir(state_dir):
        records = runs.list_records(runs.ensure_state_dir(state_dir, create=False))
    bdfs = resolve_device_specs(host, specs)
    from xpuctl.ray.actors import scan_with_ray

    # finding trees needs no files; Ray actors on an existing cluster join their run's tree
    snap = scan_with_ray(host, environ, port=port, artifacts=False)
    return targets.find_trees(host, snap, records, name, pid, port, bdfs, all_)


def planned_members(host: Host, trees: list[Any]) -> dict[int, list[int]]:
    """Each tree's processes, by its top pid, as they are now."""
    from xpuctl.shutdown import targets

    return {t.top.pid: [m.pid for m in targets.members(host, t)] for t in trees}


def mark_records(state_dir: str | None, trees: list[Any], **changes: Any) -> None:
    """Note a stop in the records of the runs being stopped ("stopping", then "stopped" or
    "failed"); a record that cannot be written does not stop the shutdown."""
    from xpuctl.state import runs

    if "state" in changes and changes["state"] != "stopping":
        changes.setdefault("stopped_at", time.time())
    if changes.get("state") == "stopping":  # who: a stopper SIGKILLed midway stops nothing
        from xpuctl.actions.signals import own_identity

        changes.setdefault("stopping_by", own_identity())
    if state_dir is None:
        return
    for t in trees:
        if t.record is not None:
            try:
                runs.update_record(state_dir, t.record, **changes)
            except OSError:
                pass
