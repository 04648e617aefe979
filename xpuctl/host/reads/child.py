"""The reader's side of bounded reads (caller.py has the caller's side, the package's
docstring why).

A reader is a child process that runs what it is asked (a scan, one read, a per-pid pass)
and, before each read, writes "reading PATH" into its slot of a page shared with the caller,
and "done" after it: two writes into memory, well under a microsecond. A read in a group that
did not answer before (see `protocol.group_of`) fails at once with `Blocked`. The split
helper of a pass (host/split.py) publishes in its own slot.

The Hosts a request carries read through this reader's `Published`: the request's pickle
names their way of reading by reference (`protocol.READS`), and `serve` resolves it.
"""

from __future__ import annotations

import errno
import io
import os
import signal
from typing import TYPE_CHECKING, Any

from xpuctl.host.reads.protocol import (
    COMM,
    DEFAULT_BOUND,
    DIRECT,
    HEAD,
    PATH_MAX,
    SLOT,
    SLOTS,
    Blocked,
    BlockedRead,
    group_of,
    pid_of,
    read_kind,
    receive,
    send,
)

if TYPE_CHECKING:
    import mmap


class Published:
    """Reads made in a reader (or its split helper): each one published in a slot of the
    shared page while it runs, and refused at once when its group did not answer before."""

    __slots__ = ("blocked", "bound", "offset", "page", "pid", "reads", "seq")
    reader = None

    def __init__(self, page: mmap.mmap, slot: int) -> None:
        self.page = page
        self.offset = slot * SLOT
        self.seq = 0
        self.pid = os.getpid()
        self.blocked: frozenset[str] = frozenset()  # groups that did not answer
        self.reads: tuple[BlockedRead, ...] = ()  # and the files that showed it
        self.bound = DEFAULT_BOUND

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(DIRECT), ())  # a Host in a reply reads where it lands, unbounded

    def read(self, root: str, kind: str, hostpath: str, limit: int) -> bytes:
        self.enter(hostpath)
        try:
            return read_kind(root + hostpath, kind, limit)
        finally:
            self.leave()

    def blocked_reads(self) -> tuple[BlockedRead, ...]:
        """The reads the caller told of."""
        return self.reads

    def enter(self, path: str) -> None:
        """Before a read: raise Blocked if its group did not answer before, else publish it."""
        if self.blocked and group_of(path) in self.blocked:
            raise Blocked(errno.ETIMEDOUT, BlockedRead(path, pid_of(path), self.bound).reason, path)
        data = path.encode("utf-8", "surrogateescape")[:PATH_MAX]
        off = self.offset
        self.page[off + HEAD.size: off + HEAD.size + len(data)] = data
        self.seq += 1
        HEAD.pack_into(self.page, off, self.seq, self.pid, len(data) or 1)

    def leave(self) -> None:
        self.seq += 1
        HEAD.pack_into(self.page, self.offset, self.seq, self.pid, 0)

    def in_split_helper(self) -> None:
        """In a forked split helper: publish in its own slot."""
        self.offset = 1 * SLOT
        self.pid = os.getpid()
        self.seq = 0
        self.leave()


def isolate(keep: tuple[int, ...]) -> None:
    """In a new reader: nothing of the caller's but the pipes. Its stdout and stderr must
    not be held open (a `| jq` waits for their end), nor its lock files (a lock lives while
    any copy of its descriptor does), and no handler of the caller's may run here."""
    try:  # named in ps and top (a fork keeps the caller's argv): an abandoned one is recognisable
        with open("/proc/self/comm", "w") as comm:
            comm.write(COMM)
    except OSError:
        pass
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    last = 2
    for fd in sorted(keep):
        if fd > last + 1:
            os.closerange(last + 1, fd)
        last = fd
    os.closerange(last + 1, 1 << 20)
    for sig in signal.valid_signals():
        try:
            if sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP):
                signal.signal(sig, signal.SIG_IGN)  # the caller decides when this one ends
            elif callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue


def _failure(exc: BaseException) -> tuple[bool, Any, str]:
    import traceback

    return (False, exc, "".join(traceback.format_exception(exc)))


def serve(requests: int, replies: int, page: mmap.mmap) -> None:
    """The reader's loop: run each request, publish reads, reply; return when the pipe
    ends."""
    # _pickle, not pickle: the Python module costs ~2 ms more to import, on every command
    import _pickle
    import gc

    published = Published(page, 0)
    published.leave()

    class Unpickler(_pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return published

    while True:
        try:
            data = receive(requests)
        except EOFError:
            return
        fn, args, kwargs, reads, bound = Unpickler(io.BytesIO(data)).load()
        published.reads, published.bound = reads, bound
        published.blocked = frozenset(group_of(r.path) for r in reads)
        gc.disable()  # a request builds a scan, nothing that must be collected meanwhile
        try:
            try:
                reply: tuple[Any, ...] = (True, fn(*args, **kwargs))
            except Exception as exc:  # handed to the caller, who raises it
                reply = _failure(exc)
            try:
                out = _pickle.dumps(reply, protocol=5)
            except (_pickle.PicklingError, TypeError, AttributeError) as exc:
                out = _pickle.dumps(_failure(RuntimeError(f"reader: unpicklable result: {exc}")))
        finally:
            gc.enable()
        send(replies, out)


def read(host_reads: Any, root: str, kind: str, hostpath: str, limit: int) -> bytes:
    """One read, in the reader (`host_reads` is this reader's Published)."""
    return host_reads.read(root, kind, hostpath, limit)  # type: ignore[no-any-return]


def main(argv: list[str]) -> None:
    """A spawned reader (process._spawn): `REQUESTS REPLIES PAGE`, three descriptors."""
    import mmap

    requests, replies, memfd = (int(a) for a in argv)
    page = mmap.mmap(memfd, SLOTS * SLOT)
    isolate((requests, replies, memfd))
    serve(requests, replies, page)

