"""The pass over /proc, started in a reader before the scan that will take it.

For `cli.headstart`: a doctor's pass begins a few milliseconds into the process, before the
command line is parsed and before this process imports the scan. Only `reads.caller` and the
pass (host/processes.py) are imported here, before the reader is forked: the reader finds
them imported, and this process needs them for its scan anyway; the rest of the scan's
code is imported in the reader while the pass's split helper scans.
The pass is kept in the reader (`processes.keep_pass`), and the scan that can use it takes it
(`processes.taken_pass`): one of the same /proc, skipping the same pids, whose root's fds the
pass kept (`processes.pass_serves`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from xpuctl.host.processes import keep_pass, own_pids, scan_processes
from xpuctl.host.seam import Host

if TYPE_CHECKING:
    from xpuctl.host.reads.caller import Reader


def start_pass(reader: Reader, root: str) -> None:
    """Post the pass of this process's next scan of the Host at `root` to `reader` (the one
    that Host will read through)."""
    reader.post(_pass, reader, root, os.getpid())


def _pass(reads: Any, root: str, caller: int) -> None:
    """In the reader (`reads`: its side of the reads): the pass take_scan would make there
    for `caller`, skipping what it skips (processes.own_pids)."""
    host = Host(root, reads=reads)
    skip = own_pids(host, frozenset({caller}))
    # the scan that takes the pass needs the rest of the scan's code: imported while the
    # pass's split helper is scanning, it costs that scan nothing
    started = host.now()
    fds = scan_processes(host, skip, meanwhile=_import_the_scan)
    keep_pass(host, skip, started, fds)


def _import_the_scan() -> None:
    import xpuctl.host.scan
    import xpuctl.parse.kmsg  # noqa: F401 (doctor reads the kernel log next)
