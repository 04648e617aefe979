"""The stale-file rules, in one place. `cleanup` deletes only what `judge` calls stale.

A file is stale only when ALL of these hold (docs/safety.md, "Files"):

1. its name matches one of the documented PATTERNS below, directly in /dev/shm or /tmp;
2. it is a regular file or a socket (never a symlink, never a directory: lstat, no follow);
3. no live process has it open (an fd leads to its device and inode) or mapped (a mapping
   of its device and inode), whatever path that process sees it by;
4. for a socket: no socket is bound to its inode (sock_diag), and connect() is refused;
5. for a name that carries a pid (a oneCCL fd-exchange socket `/tmp/ccl-ipc-fd-sock-<pid>:…`,
   a libfabric region `/dev/shm/<pid>:<uid>:<n>`): that pid is gone, or the live process
   with it started after the file was last modified (the pid was reused);
6. for vLLM's FileStore `/tmp/vllm_dist_*` (opened only during collective set-up, so a running
   server holds no fd on it): no live vLLM process of the file's owner started before the
   file was last modified; for oneCCL's GPU-build names, which carry no pid, the same with
   the owner's live oneCCL processes (vLLM's, and any that maps libccl);
7. no process that could hold it went uninspected (its fds or maps unreadable, another
   user's for a non-root run, or a read that did not answer);
8. caches (`/tmp/ccl-module-cache-*`) are never stale.

The facts come from the scan (host/scan.py); on a fake tree or a snapshot, whose fds and maps
are texts, by path text. Ownership (who may delete) is decided by `cleanup.may_delete`, not
here: root cleans for every user, anyone else only their own files.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # the pass over /proc asks `match` and needs no record types
    from xpuctl.core.model import FileInfo

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

#: Kinds of file whose liveness is proved by their owner's oneCCL processes (no pid in
#: the name, nothing binds them).
CCL_USED = frozenset({"ccl-shm", "ccl-probe"})

#: (directory, name pattern, kind, must be a socket). First match wins.
PATTERNS: tuple[tuple[str, re.Pattern[str], str, bool], ...] = (
    # Python multiprocessing.shared_memory (vLLM's shm MessageQueue): /psm_<hex>
    ("/dev/shm", re.compile(r"^psm_[0-9A-Za-z_]+\Z"), "shm", False),
    # multiprocessing semaphores (sem_open): sem.mp-<random>
    ("/dev/shm", re.compile(r"^sem\.mp-[0-9A-Za-z_]+\Z"), "shm", False),
    # torch file_system tensor sharing
    ("/dev/shm", re.compile(r"^torch_.+\Z"), "shm", False),
    # libfabric shm provider regions and its Level Zero IPC sockets
    ("/dev/shm", re.compile(r"^fi_.+\Z"), "shm", False),
    ("/dev/shm", re.compile(r"^ze_.+\Z"), "shm", False),
    # libfabric's shm provider under oneCCL (FI_PROVIDER=shm, CCL_ATL_SHM=1): a 64 MiB region
    # per endpoint named <pid>:<uid>:<n>, in newer libfabric <pid>:<uid>:<dom>:<ep>
    ("/dev/shm", re.compile(r"^[1-9][0-9]{0,9}:[0-9]{1,10}:[0-9]{1,10}(?::[0-9]{1,10})?\Z"),
     "libfabric", False),
    # oneCCL's GPU build (atl_ofi_helper.cpp, ze_fd_manager.cpp): the endpoint table of a
    # node, EPS-shm-file-<PALS_APID or "default">-<uid>; the fd manager's shared memory,
    # ccl-shm-file-<uid>; the rank-to-process table of its binary
    ("/dev/shm", re.compile(r"^EPS-shm-file-[0-9A-Za-z_.-]+-[0-9]{1,10}\Z"), "ccl-shm", False),
    ("/dev/shm", re.compile(r"^ccl-shm-file-[0-9]{1,10}\Z"), "ccl-shm", False),
    ("/dev/shm", re.compile(r"^ccl-rank2proc-eps-shm-.+\Z"), "ccl-shm", False),
    # vLLM's torch.distributed FileStore
    ("/tmp", re.compile(r"^vllm_dist_[0-9A-Za-z_]+\Z"), "filestore", False),
    # oneCCL: device-fd exchange sockets and IPC handle-exchange sockets
    ("/tmp", re.compile(r"^ccl-ipc-fd-sock-\d+:.*\Z"), "ccl-socket", False),
    # oneCCL's IPC handle exchange (/tmp/ccl-handle-<rank>-<tag>...): no pid in the name,
    # nothing to prove its users by but who holds it (an fd, a mapping, a bound socket:
    # host/liveness.py, by device and inode)
    ("/tmp", re.compile(r"^ccl-handle-.+\Z"), "ccl-socket", False),
    # torch-xpu-ops' peer IPC exchange (its un_allgather: a server socket per rank,
    # /tmp/open-peer-ipc-mem-server-rank_<rank>_<user>, and the clients'
    # /tmp/open-peer-ipc-mem-client-rank_<rank>_<user>): judged by holders only, like above
    ("/tmp", re.compile(r"^open-peer-ipc-mem-(?:server|client)-rank_[0-9]{1,9}[_-].+\Z"),
     "xpu-ipc-socket", False),
    # oneCCL's pidfd_getfd probe (ze_fd_manager.cpp is_pidfd_supported): mkstemp of the
    # template /tmp/oneccl_pidfd_check_getXXXXXXXXXX, whose last 6 X become random letters
    # and digits (the 4 before them stay); unlinked at once, left by a rank killed meanwhile
    ("/tmp", re.compile(r"^oneccl_pidfd_check_get(?:XXXX)?[0-9A-Za-z]{6}\Z"), "ccl-probe", False),
    # oneCCL kernel module cache: a cache, listed but never stale
    ("/tmp", re.compile(r"^ccl-module-cache-.+\Z"), "cache", False),
    # vLLM's ZMQ ipc:// sockets: uuid4 names directly in /tmp (VLLM_RPC_BASE_PATH)
    ("/tmp", re.compile(rf"^{_UUID}\Z"), "zmq-socket", True),
)

#: Kinds that are never stale (kept whatever holds them).
NEVER_STALE = frozenset({"cache"})

#: Every kind a file can be judged stale as, in the order of PATTERNS: the registry that
#: Prometheus's `xpuctl_stale_files` kinds and docs/output.md come from.
STALE_KINDS: tuple[str, ...] = tuple(dict.fromkeys(
    kind for _, _, kind, _ in PATTERNS if kind not in NEVER_STALE))

CCL_PID = re.compile(r"^ccl-ipc-fd-sock-(\d+):")
_LIBFABRIC_PID = re.compile(r"^(\d+):")

#: Seconds of slack in "started after the file was last modified": a start time is read
#: from boot time (whole seconds) plus clock ticks, a clock may be stepped. A pid reused
#: within this of the file's last write is taken for the file's own process (kept).
CLOCK_SLACK = 1.0


def match(directory: str, name: str) -> tuple[str, bool] | None:
    """(kind, socket_only) when a file name is one we know, else None."""
    for d, pattern, kind, socket_only in PATTERNS:
        if d == directory and pattern.match(name):
            return kind, socket_only
    return None


def named_pid(kind: str, name: str) -> int | None:
    """The pid a file's name carries (a oneCCL fd-exchange socket, a libfabric region), else
    None."""
    if kind == "ccl-socket":
        m = CCL_PID.match(name)
    elif kind == "libfabric":
        m = _LIBFABRIC_PID.match(name)
    else:
        return None
    return int(m.group(1)) if m else None


class Starter(NamedTuple):
    """A live process that may use a file with no pid in its name: pid, uid, start time."""

    pid: int
    uid: int | None
    started: float | None


class Facts(NamedTuple):
    """What the rest of the host says about one candidate file."""

    open_by: tuple[int, ...]
    mapped_by: tuple[int, ...]
    # a socket bound to it: True, False, or None when that could not be told
    bound: bool | None
    # the live process with the pid its name carries: (start time, or None if unknown);
    # None when no live process has that pid (or the name carries none)
    named: tuple[int, float | None] | None
    # every live vLLM process
    vllm: tuple[Starter, ...]
    # every live process that maps libccl (oneCCL)
    ccl: tuple[Starter, ...] = ()
    # processes that could hold it but could not be inspected
    unseen: tuple[int, ...] = ()
    # for those: does any process hold it at all (a write lease refused: True; granted:
    # False; None: not asked or cannot tell)
    held: bool | None = None
    # processes holding a socket bound to it (when known)
    bound_by: tuple[int, ...] = ()


class Ruling(NamedTuple):
    """`judge`'s answer: stale or not, why, and the live processes that keep it (their end
    lets it be judged again: reset plans it after the orphans it stops)."""

    stale: bool
    reason: str
    kept_by: tuple[int, ...] = ()
    # kept only because this many processes that could hold it could not be inspected
    unseen: int = 0


def _pids(pids: tuple[int, ...], most: int = 5) -> str:
    head = ", ".join(map(str, pids[:most]))
    return head + (f" and {len(pids) - most} more" if len(pids) > most else "")


def _started_before(starters: tuple[Starter, ...], info: FileInfo) -> tuple[int, ...]:
    """The pids of those of the file's owner that started before it was last modified."""
    return tuple(s.pid for s in starters
                 if (s.uid is None or s.uid == info.uid)
                 and (s.started is None or s.started <= info.mtime + CLOCK_SLACK))


def judge(path: str, kind: str, info: FileInfo, facts: Facts) -> Ruling:
    """(stale, reason, kept_by) for one candidate."""
    v = _judge(path, kind, info, facts)
    if v.stale and facts.unseen:
        return v._replace(reason=f"{v.reason} ({len(facts.unseen)} process(es) could not be "
                          "inspected; a write lease showed that nothing holds it)")
    return v


def _judge(path: str, kind: str, info: FileInfo, facts: Facts) -> Ruling:
    if kind in NEVER_STALE:
        return Ruling(False, "cache, kept")
    if not (info.is_regular or info.is_socket):
        return Ruling(False, "not a regular file or socket")
    if facts.open_by:
        return Ruling(False, "open by " + _pids(facts.open_by), facts.open_by)
    if facts.mapped_by:
        return Ruling(False, "mapped by " + _pids(facts.mapped_by), facts.mapped_by)
    if facts.held:
        if facts.unseen:
            return Ruling(False, f"kept: some process holds it (a write lease was refused), "
                           f"and {len(facts.unseen)} process(es) could not be inspected "
                           f"(pid {_pids(facts.unseen)})", (), len(facts.unseen))
        return Ruling(False, "kept: some process holds it open or mapped (a write lease was "
                       "refused), though none of those inspected does")
    if info.is_socket and facts.bound:
        who = f" (held by {_pids(facts.bound_by)})" if facts.bound_by else ""
        return Ruling(False, f"a socket is bound to it{who}", facts.bound_by)
    if info.is_socket and facts.bound is None:
        return Ruling(False, "kept: whether a socket is bound to it could not be told")
    name = path.rsplit("/", 1)[-1]
    pid = named_pid(kind, name)
    if pid is not None and facts.named is not None:
        started = facts.named[1]
        if started is None or started <= info.mtime + CLOCK_SLACK:
            return Ruling(False, f"its process {pid} is alive", (pid,))
    if kind == "filestore" and (users := _started_before(facts.vllm, info)):
        return Ruling(False, "a live vLLM process of its owner may still use it", users)
    if kind in CCL_USED and (users := _started_before(facts.vllm + facts.ccl, info)):
        return Ruling(False, "a live oneCCL process of its owner may still use it "
                       f"({_pids(users)})", users)
    if facts.unseen and facts.held is None:
        return Ruling(False, f"kept: {len(facts.unseen)} process(es) that could hold it could "
                       f"not be inspected (pid {_pids(facts.unseen)})", (), len(facts.unseen))
    if pid is not None:
        gone = "gone" if facts.named is None else "reused: its process started after the file"
        return Ruling(True, f"its process {pid} is {gone}, and no process has it open or mapped")
    if kind == "filestore":
        return Ruling(True, "no live vLLM process of its owner started before it was written")
    if kind in CCL_USED:
        return Ruling(True, "no live oneCCL process of its owner started before it was written, "
                       "and no process has it open or mapped")
    if info.is_socket:
        return Ruling(True, "no socket is bound to it and no process has it open")
    return Ruling(True, "no process has it open or mapped")
