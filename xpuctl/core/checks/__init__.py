"""Pure judgement: Scan → findings and a status. No I/O.

One small function per stable check id, registered in `registry.REGISTRY` (id → function) by
the `@check` decorator in the module of its area (`processes`, `files`, `serving`,
`inspection`, `deep`, `lastrun`); `evaluate` runs them all. Check ids are stable (scripts and
alerts key on them) and `CHECKS` is their order in the output. To add a check: a function
with `@check("id")` in the module of its area, and its id in `CHECKS`.
"""

from __future__ import annotations

from xpuctl.core.checks import deep, files, inspection, kernel, lastrun, processes, serving  # noqa: F401 (they register)
from xpuctl.core.checks.lastrun import last_run_findings, last_run_keys
from xpuctl.core.checks.registry import REGISTRY, Ctx, Options
from xpuctl.core.model import Process, Report, Scan

__all__ = ["CHECKS", "REGISTRY", "Options", "evaluate", "last_run_findings", "last_run_keys"]

# Output order of the ids; every registered check has a place here (a test holds them equal).
CHECKS = (
    "no-device",
    "device-wedged",
    "device-holders",
    "orphans",
    "device-memory",
    "stuck-processes",
    "stale-shm",
    "stale-libfabric",
    "stale-ipc",
    "ports",
    "env",
    "run-health",
    "unattributed-memory",
    "device-lost",
    "gpu-hang",
    "devcoredump",
    "device-survivability",
    "device-health",
    "known-issues",
    "probe-timeout",
    "collective",
    "last-run",
    "run-records",
    "blocked-reads",
    "inspection",
)


def _context(scan: Scan, opts: Options) -> Ctx:
    by_pid = {p.pid: p for p in scan.processes}
    trees: dict[int, list[Process]] = {}
    for p in scan.processes:
        if p.orphan and not p.is_zombie:
            trees.setdefault(p.top or p.pid, []).append(p)
    memory: dict[tuple[int, str], int] = {}
    for cl in scan.clients:
        if cl.bdf is None:
            continue  # on no card a check asks of
        for pid in set(cl.pids):
            memory[pid, cl.bdf] = memory.get((pid, cl.bdf), 0) + (cl.memory_bytes or 0)
    return Ctx(scan, opts, frozenset(opts.devices), by_pid, trees, memory)


def evaluate(scan: Scan, opts: Options) -> Report:
    c = _context(scan, opts)
    findings = [f for check_id in CHECKS for f in REGISTRY[check_id](c)]
    failed = any(f.severity == "fail" for f in findings)
    busy = any(scan.holders(d.bdf) for d in c.devices()) or any(
        p.pid is not None and p.port == opts.port for p in scan.ports
    )
    status = "dirty" if failed else ("busy" if busy else "clean")
    if status == "clean" and scan.blocked:
        status = "unknown"  # something did not answer: never judged clean
    order = {"fail": 0, "warn": 1, "info": 2}
    findings.sort(key=lambda f: (order[f.severity], CHECKS.index(f.check)))
    return Report(scan, tuple(findings), status)
