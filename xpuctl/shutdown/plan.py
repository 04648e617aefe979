"""What a shutdown will stop: the server trees that NAME, --pid, --port, --device or --all
name (with their run records), and the processes it will wait for."""

from __future__ import annotations

import os
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
    scan = scan_with_ray(host, environ, port=port, artifacts=False)
    return targets.find_trees(host, scan, records, name, pid, port, bdfs, all_)


def planned_members(host: Host, trees: list[Any]) -> dict[int, list[int]]:
    """Each tree's processes, by its top pid, as they are now."""
    from xpuctl.shutdown import targets

    return {t.top.pid: [m.pid for m in targets.members(host, t)] for t in trees}

