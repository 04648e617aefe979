"""The stale-file rules, in one place. `cleanup` deletes only what `judge` calls stale.

A file is stale only when ALL of these hold (docs/safety.md, "Files"):

1. its name matches one of the documented PATTERNS below, directly in /dev/shm or /tmp;
2. it is a regular file or a socket (never a symlink, never a directory: lstat, no follow);
3. no live process has it open (an fd links to it) or mapped (a /proc/<pid>/maps line);
4. for a socket: no socket is bound to its path in /proc/net/unix;
5. for a oneCCL fd-exchange socket `/tmp/ccl-ipc-fd-sock-<pid>:…`: process <pid> is gone;
6. for vLLM's FileStore `/tmp/vllm_dist_*` (opened only during collective set-up, so a running
   server holds no fd on it): no live vLLM process of the file's owner started before the
   file was last modified;
7. caches (`/tmp/ccl-module-cache-*`) are never stale.

Ownership (who may delete) is decided by `cleanup.may_delete`, not here: root cleans for
every user, anyone else only their own files.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from xpuctl.core.model import FileInfo

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"

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
    # vLLM's torch.distributed FileStore
    ("/tmp", re.compile(r"^vllm_dist_[0-9A-Za-z_]+\Z"), "filestore", False),
    # oneCCL: device-fd exchange sockets and IPC handle-exchange sockets
    ("/tmp", re.compile(r"^ccl-ipc-fd-sock-\d+:.*\Z"), "ccl-socket", False),
    ("/tmp", re.compile(r"^ccl-handle-.+\Z"), "ccl-socket", False),
    # oneCCL kernel module cache: a cache, listed but never stale
    ("/tmp", re.compile(r"^ccl-module-cache-.+\Z"), "cache", False),
    # vLLM's ZMQ ipc:// sockets: uuid4 names directly in /tmp (VLLM_RPC_BASE_PATH)
    ("/tmp", re.compile(rf"^{_UUID}\Z"), "zmq-socket", True),
)

CCL_PID = re.compile(r"^ccl-ipc-fd-sock-(\d+):")


def match(directory: str, name: str) -> tuple[str, bool] | None:
    """(kind, socket_only) when a file name is one we know, else None."""
    for d, pattern, kind, socket_only in PATTERNS:
        if d == directory and pattern.match(name):
            return kind, socket_only
    return None


class Facts(NamedTuple):
    """What the rest of the host says about one candidate file."""

    open_by: tuple[int, ...]
    mapped_by: tuple[int, ...]
    bound: bool
    live_pids: frozenset[int]
    # (uid, start_time) of every live vLLM process
    vllm_starts: tuple[tuple[int | None, float | None], ...]


def judge(path: str, kind: str, info: FileInfo, facts: Facts) -> tuple[bool, str]:
    """(stale, reason) for one candidate."""
    if kind == "cache":
        return False, "cache, kept"
    if not (info.is_regular or info.is_socket):
        return False, "not a regular file or socket"
    if facts.open_by:
        return False, "open by " + ", ".join(map(str, facts.open_by))
    if facts.mapped_by:
        return False, "mapped by " + ", ".join(map(str, facts.mapped_by))
    if info.is_socket and facts.bound:
        return False, "a socket is bound to it"
    name = path.rsplit("/", 1)[-1]
    m = CCL_PID.match(name)
    if m and int(m.group(1)) in facts.live_pids:
        return False, f"its process {m.group(1)} is alive"
    if kind == "filestore":
        for uid, started in facts.vllm_starts:
            if (uid is None or uid == info.uid) and (started is None or started <= info.mtime):
                return False, "a live vLLM process of its owner may still use it"
        return True, "no live vLLM process of its owner started before it was written"
    if info.is_socket:
        return True, "no socket is bound to it and no process has it open"
    return True, "no process has it open or mapped"
