"""The files of /dev/shm and /tmp a rule knows, judged: the candidates (by name and lstat),
what the host says of each (who holds it open, maps it, is bound to it, the process its name
names, who went uninspected: host/liveness.py), and the rules' verdict (core/rules.py)."""

from __future__ import annotations

from collections.abc import Callable

from xpuctl.core.model import Artifact, FileInfo, Issue, Process
from xpuctl.core.rules import CCL_USED, Facts, Starter, judge, match, named_pid
from xpuctl.host.liveness import Holdings
from xpuctl.host.processes import FdTable
from xpuctl.host.reads.protocol import BlockedRead
from xpuctl.host.seam import Host

#: When a process of the pass started, by pid (None: unknown).
StartTime = Callable[[int], "float | None"]


def _candidates(host: Host) -> tuple[list[tuple[str, str, FileInfo]], list[Issue]]:
    """The files of /dev/shm and /tmp whose names a rule knows, with their lstat."""
    issues: list[Issue] = []
    candidates: list[tuple[str, str, FileInfo]] = []
    for directory in ("/dev/shm", "/tmp"):
        try:
            names = host.listdir(directory)
        except FileNotFoundError:
            continue
        except OSError as exc:
            issues.append(Issue(directory, f"cannot list: {exc.strerror or exc}"))
            continue
        for name in names:
            m = match(directory, name)
            if m is None:
                continue
            path = f"{directory}/{name}"
            try:
                info = host.lstat(path)
            except OSError:
                continue
            kind, socket_only = m
            if socket_only and not info.is_socket:
                continue
            candidates.append((path, kind, info))
    return sorted(candidates), issues


def judge_files(
    host: Host, fds: FdTable, start_time: StartTime, procs: list[Process], now: float,
    stuck: dict[int, BlockedRead],
) -> tuple[list[Artifact], list[Issue]]:
    candidates, issues = _candidates(host)
    if not candidates:
        return [], issues
    holds = Holdings(host, fds, {path: info for path, _, info in candidates},
                     ccl_wanted=any(kind in CCL_USED for _, kind, _ in candidates))
    vllm = tuple(Starter(p.pid, p.uid, p.start_time) for p in procs
                 if p.role is not None and not p.is_zombie)
    ccl: tuple[Starter, ...] | None = None
    out: list[Artifact] = []
    unjudged = 0
    for path, kind, info in candidates:
        facts = Facts((), (), False, None, vllm)
        if kind != "cache" and (info.is_regular or info.is_socket):
            facts = _facts(holds, start_time, path, kind, info, facts)
            if kind in CCL_USED and not facts.open_by and not facts.mapped_by:
                if ccl is None:
                    ccl = tuple(Starter(pid, holds.uid_of(pid), start_time(pid))
                                for pid in sorted(set(holds.ccl_users())))
                facts = facts._replace(ccl=ccl)
        verdict = judge(path, kind, info, facts)
        stale, reason = verdict.stale, verdict.reason
        if stale and stuck:
            # a process that did not answer may have it open or mapped, or be the vLLM
            # process whose FileStore it is: nothing is stale on the strength of that
            stale, reason = False, (f"not judged: pid(s) {', '.join(map(str, sorted(stuck)))} "
                                    "did not answer, their open files and mappings are unknown")
        unjudged += bool(verdict.unseen)
        out.append(
            Artifact(
                path=path,
                kind=kind,
                stale=stale,
                reason=reason,
                open_by=tuple(sorted(set(facts.open_by + facts.mapped_by))),
                owner_uid=info.uid,
                size_bytes=info.size,
                age_seconds=max(0.0, now - info.mtime),
                inode=info.inode,
                dev=info.dev,
                kept_by=verdict.kept_by,
                unseen=verdict.unseen,
            )
        )
    if unjudged:
        seen = max(a.unseen for a in out)
        issues.append(Issue("/proc", f"{unjudged} file(s) in /dev/shm and /tmp kept unjudged: "
                                     f"{seen} process(es) that could hold them could not be "
                                     "inspected"))
    return out, issues


def _facts(holds: Holdings, start_time: StartTime, path: str, kind: str, info: FileInfo,
           facts: Facts) -> Facts:
    """What the host says about one candidate: who has it open or mapped (a socket is never
    mapped), what is bound to it, the process its name's pid names, who went uninspected.

    A regular file on the kernel's /proc is asked first by its inode: a write lease
    (Holdings.lease) is refused while any open file description of it exists (an fd, or a
    mapping, which keeps its file open), whoever holds it: a process that could not be
    inspected, one that was handed it over a unix socket, one the pass did not see it in.
    Granted, nothing holds it, and no process's fds or mappings are read for it (the cost of
    the rule falls on the files some process holds); refused, they are, to name who."""
    held: bool | None = None
    if info.is_regular and holds.host.identity_checked:  # a fake tree's are texts: no lease
        held = holds.lease(path)
    open_by = () if held is False else holds.open_by(path)
    mapped_by: tuple[int, ...] = ()
    bound: bool | None = False
    bound_by: tuple[int, ...] = ()
    unseen: tuple[int, ...] = ()
    if info.is_socket:
        bound, bound_by = holds.bound(path)
    elif not open_by:
        mapped_by = () if held is False else holds.mapped_by(path)
        if not mapped_by:
            # refused: anyone uninspected may be the holder; else those who could open it
            unseen = holds.unseen(info, anyone=bool(held), maps=held is not False)
    named = None
    pid = named_pid(kind, path.rsplit("/", 1)[-1])
    if pid is not None and (raw := holds.fds.procs.get(pid)) is not None and raw.stat.state != "Z":
        named = (pid, start_time(pid))
    return facts._replace(open_by=open_by, mapped_by=mapped_by, bound=bound, named=named,
                          unseen=unseen, held=held, bound_by=bound_by)
