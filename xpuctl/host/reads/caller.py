"""The caller's side of bounded reads: `Reader`, a Host's way of reading when its reads are
bounded (the package's docstring says why and how).

The reader is forked on first use (spawned, running `xpuctl.host.reads.child` of this very
package, when this process runs other threads: a fork copies only the calling thread, and locks
the others hold would stay locked in the copy) and serves requests until its pipe closes.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from xpuctl.host.reads import child as _child_side
from xpuctl.host.reads.protocol import (
    DEFAULT_BOUND,
    DIRECT,
    HEAD,
    LEN,
    READS,
    SLOT,
    SLOTS,
    Blocked,
    BlockedRead,
    ReaderTraceback,
    group_of,
    pid_of,
    read_exact,
    send,
)

if TYPE_CHECKING:  # the rest is imported where it is used: most commands never start a reader
    import mmap

__all__ = ["DEFAULT_BOUND", "Blocked", "BlockedRead", "Reader", "reap_abandoned"]


# -- the caller's side ------------------------------------------------------------------------

#: Readers killed while blocked, not yet reaped: pidfd -> pid. Reaped without waiting, whenever
#: we pass; through the pidfd, so a pid reaped meanwhile by someone else (serve reaps every
#: exited child) and then reused never names the wrong process.
_abandoned: dict[int, int] = {}


def _reaped(pidfd: int) -> bool:
    """Reap the child if it has exited; True when it is gone (reaped here or elsewhere)."""
    try:
        return os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None
    except ChildProcessError:
        return True


def reap_abandoned() -> None:
    for pidfd in list(_abandoned):
        if _reaped(pidfd):
            del _abandoned[pidfd]
            os.close(pidfd)


def _kill(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # dies when its read returns, if ever
    except OSError:
        pass


def _threads_running() -> bool:
    return threading.active_count() > 1


class _Child(NamedTuple):
    pid: int
    pidfd: int  # signals and waits go through it: the pid may be reaped by others
    requests: int  # we write
    replies: int  # we read
    page: mmap.mmap  # its own: a helper of an abandoned reader may still write into its old one


def _start() -> _Child:
    import mmap

    memfd = os.memfd_create("xpuctl-reads", os.MFD_CLOEXEC)
    try:
        os.ftruncate(memfd, SLOTS * SLOT)
        page = mmap.mmap(memfd, SLOTS * SLOT)
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = _spawn(req_r, rep_w, memfd) if _threads_running() else _fork(req_r, rep_w, page, (req_w, rep_r, memfd))
    finally:
        os.close(memfd)
    os.close(req_r)
    os.close(rep_w)
    return _Child(pid, os.pidfd_open(pid), req_w, rep_r, page)


def _release(child: _Child) -> None:
    """Close our ends of a reader we are done with."""
    for fd in (child.requests, child.replies):
        os.close(fd)
    child.page.close()


#: True once start-up's objects are frozen for good (`freeze_start_up`).
_START_UP_FROZEN = False


def freeze_start_up() -> None:
    """Leave every object made so far out of this process's garbage collections, for good:
    the modules a command loaded and what they made live until it exits (cli.group, once
    the command is loaded). A reader forked later needs no freeze of its own then, and none
    is asked whether one was made (`gc.get_freeze_count` walks every frozen object: 1-2 ms
    of a doctor run)."""
    import gc

    global _START_UP_FROZEN  # noqa: PLW0603 (once per process, before any reader)
    gc.freeze()
    _START_UP_FROZEN = True


def _fork(req_r: int, rep_w: int, page: mmap.mmap, parent_ends: tuple[int, ...]) -> int:
    import gc

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    # Objects made before the fork are left out of the reader's garbage collections: a
    # collection touches every object it visits, and each page touched is copied. Frozen
    # here only for the fork, unless start-up's objects are frozen already (the few made
    # since are left to the reader's collections).
    freeze = not _START_UP_FROZEN
    if freeze:
        gc.freeze()
    try:
        pid = os.fork()
    except OSError:
        if freeze:
            gc.unfreeze()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    if pid == 0:
        code = 1
        try:
            for fd in parent_ends:
                os.close(fd)
            _child_side.isolate((req_r, rep_w))
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            _child_side.serve(req_r, rep_w, page)
            code = 0
        finally:
            os._exit(code)
    if freeze:
        gc.unfreeze()
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return pid


#: Where this xpuctl was imported from: the directory (or zip) that holds the package. A
#: spawned reader imports xpuctl from there and from nowhere else: the interpreter may not find
#: it by itself (a Ray task imports xpuctl from a zip it put on its own sys.path, and the
#: node's Python has no xpuctl), or may find another one.
PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: A spawned reader's start: xpuctl from argv[1] (with the package's own importer: a directory
#: or a zip), without putting that place on sys.path; `-P` keeps the working directory off
#: sys.path as well (a reader started in /tmp as root must not import a file found there).
_BOOT = """\
import importlib.machinery as m, importlib.util as u, os, sys
s = m.PathFinder.find_spec("xpuctl", [sys.argv[1]])
x = u.module_from_spec(s)
sys.modules["xpuctl"] = x
s.loader.exec_module(x)
import xpuctl.host.reads.child as c
try:
    c.main(sys.argv[2:])
finally:
    os._exit(0)
"""


def _spawn(req_r: int, rep_w: int, memfd: int) -> int:
    for fd in (req_r, rep_w, memfd):
        os.set_inheritable(fd, True)
    try:
        return os.posix_spawn(
            sys.executable,
            [sys.executable, "-P", "-c", _BOOT, PACKAGE_PARENT,
             str(req_r), str(rep_w), str(memfd)],
            dict(os.environ),
        )
    finally:
        for fd in (req_r, rep_w, memfd):
            os.set_inheritable(fd, False)


def _runnable(pid: int) -> bool:
    """The reading process is on a run queue (state R): a loaded machine starves it, a read
    that blocks sleeps (D, or S for a FIFO). Our own child's stat is read directly: its
    stat takes no lock a wedged read could hold."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 512)
        finally:
            os.close(fd)
    except OSError:
        return False
    return data[data.rfind(b")") + 2:][:1] == b"R"


def _without_gc(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with the cyclic garbage collector paused: unpickling a scan makes tens of
    thousands of containers, and each few hundred start a collection that finds nothing
    (bench: a 575 kB reply unpickles in about 3/4 of the time)."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        return fn(*args)
    finally:
        if was:
            gc.enable()


@functools.cache
def _pickler() -> Any:
    """A pickler that sends its `reads` (a Reader) as a reference: in the reader, the Hosts
    of a request read through the reader's side (child.serve resolves it)."""
    import _pickle

    class Pickler(_pickle.Pickler):
        reads: Any = None

        def persistent_id(self, obj: Any) -> Any:
            return READS if obj is self.reads else None

    return Pickler


class Reader:
    """A Host's way of reading when its reads are bounded: functions and reads run in a
    reader child, each read bounded.

    `blocked` keeps every read that did not answer, in order, for reports."""

    def __init__(self, bound: float = DEFAULT_BOUND) -> None:
        self.bound = float(bound)
        self.blocked: dict[str, BlockedRead] = {}  # group -> the first file of it that blocked
        self._child: _Child | None = None
        self._finalizer: Any = None
        self._owner = os.getpid()
        self._lock = threading.Lock()  # one request at a time on the pipe (serve has threads)
        #: Round trips made (requests sent, retries included), for tests and bench.
        self.round_trips = 0

    def __repr__(self) -> str:
        return f"Reader(bound={self.bound:g})"

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled other than to our reader (which gets a reference, see _request): the Host
        # reads where it lands, in that process
        return (type(DIRECT), ())

    @property
    def reader(self) -> Reader:
        return self

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child else None

    def blocked_reads(self) -> tuple[BlockedRead, ...]:
        return tuple(self.blocked.values())

    def in_split_helper(self) -> None:
        """A split pass runs in the reader, never beside a Reader: nothing to do."""

    def _ensure(self) -> _Child:
        if self._child is not None and self._owner != os.getpid():
            # a forked copy of this process (a split helper): the reader is the parent's
            self._child, self._finalizer = None, None
        if self._child is None:
            self._owner = os.getpid()
            reap_abandoned()
            self._child = _start()
            if self._finalizer is None:
                import weakref

                self._finalizer = weakref.finalize(self, _close, self.__dict__)
                self._finalizer.atexit = False  # see _at_exit
                _live().add(self)
        return self._child

    def read(self, root: str, kind: str, hostpath: str, limit: int) -> bytes:
        return self.call(_child_side.read, self, root, kind, hostpath, limit)  # type: ignore[no-any-return]

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) in the reader: one round trip. Hosts among the arguments read
        there through the reader's side. Reads that block are recorded, and the call runs
        again with them failing at once; an exception of fn is raised here, caused by a
        ReaderTraceback that holds the reader's traceback."""
        with self._lock:
            return self._call(fn, args, kwargs)

    def _request(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> bytes:
        import io

        out = io.BytesIO()
        pickler = _pickler()(out, protocol=5)
        pickler.reads = self
        pickler.dump((fn, args, kwargs, tuple(self.blocked.values()), self.bound))
        return out.getvalue()

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        died = 0
        request = self._request(fn, args, kwargs)
        while True:
            child = self._ensure()
            try:
                self.round_trips += 1
                send(child.requests, request)
                reply = self._wait(child)
            except (EOFError, BrokenPipeError):
                self._abandon(kill=False)  # it ended by itself
                died += 1
                if died < 2:
                    continue  # killed from outside (an OOM kill, a stray signal): once more
                raise Blocked(errno.EIO, "the reader process ended unexpectedly", None) from None
            if reply is None:  # blocked: recorded, reader abandoned; again without them
                request = self._request(fn, args, kwargs)
                continue
            if reply[0]:
                return reply[1]
            raise reply[1] from ReaderTraceback(reply[2])

    def _wait(self, child: _Child) -> tuple[Any, ...] | None:
        """The reply, or None once a read has blocked."""
        import _pickle
        import select

        waiting = select.poll()  # not select(): it fails on descriptors above 1023
        waiting.register(child.replies, select.POLLIN)
        page = child.page
        seen = [HEAD.unpack_from(page, i * SLOT) for i in range(SLOTS)]
        since = [time.monotonic()] * SLOTS
        began = list(since)  # when each slot's current read began
        cap = max(30.0, 10 * self.bound)
        tick = min(0.05, self.bound / 4)
        while True:
            if waiting.poll(tick * 1000):
                (size,) = LEN.unpack(read_exact(child.replies, LEN.size))
                data = read_exact(child.replies, size)
                return _without_gc(_pickle.loads, data)  # type: ignore[no-any-return]
            now = time.monotonic()
            stuck = []
            for i in range(SLOTS):
                head = HEAD.unpack_from(page, i * SLOT)
                if head[0] != seen[i][0] or head[1] != seen[i][1]:
                    seen[i], since[i], began[i] = head, now, now
                elif head[2] and now - since[i] >= self.bound:
                    if now - began[i] < cap and _runnable(head[1]):
                        since[i] = now  # starved of CPU (state R), not blocked: another bound
                    else:
                        stuck.append(i)
            if stuck:
                self._record(page, stuck)
                self._abandon(stuck_pids=[seen[i][1] for i in stuck])
                return None
            if now - max(since) >= max(30.0, 10 * self.bound):
                # no read in flight and no progress at all: not a read that blocks, but the
                # command must not wait for ever either
                self._abandon()
                raise Blocked(errno.ETIMEDOUT, "the reader process stopped answering", None)

    def _record(self, page: mmap.mmap, slots: list[int]) -> None:
        for i in slots:
            _, _, n = HEAD.unpack_from(page, i * SLOT)
            start = i * SLOT + HEAD.size
            path = bytes(page[start:start + n]).decode("utf-8", "surrogateescape")
            self.blocked.setdefault(group_of(path), BlockedRead(path, pid_of(path), self.bound))

    def _abandon(self, stuck_pids: Sequence[int] = (), kill: bool = True) -> None:
        """Kill the reader (and a stuck split helper) without waiting for them."""
        child, self._child = self._child, None
        if child is None:
            return
        if kill:
            _kill(child.pidfd)
        for pid in set(stuck_pids) - {child.pid, 0}:
            try:  # its split helper, seen reading a moment ago: alive, so the pid is its own
                helper = os.pidfd_open(pid)
            except OSError:
                continue
            _kill(helper)
            os.close(helper)
        _abandoned[child.pidfd] = child.pid  # reaped later without waiting
        _release(child)
        reap_abandoned()

    def close(self) -> None:
        """End the reader (it is idle: it leaves when its pipe closes)."""
        if self._finalizer is not None:
            self._finalizer()


_LIVE: Any = None


def _live() -> Any:
    """The readers with a child (a WeakSet), for _at_exit."""
    global _LIVE  # noqa: PLW0603 (the registry of live readers, made on first use)
    if _LIVE is None:
        import atexit
        import weakref

        _LIVE = weakref.WeakSet()
        atexit.register(_at_exit)
        os.register_at_fork(after_in_child=_after_fork)
    return _LIVE


def _after_fork() -> None:
    """In a forked copy of this process (serve --detach's supervisor, a reader being born):
    the readers are the parent's. Our copies of their pipes would keep them alive after the
    parent is gone (an idle reader leaves when its pipe closes), so close them; the copy
    starts a reader of its own when it reads."""
    for reader in list(_LIVE or ()):
        child, reader._child = reader._child, None
        if child is not None:
            _release(child)
            os.close(child.pidfd)
        if reader._finalizer is not None:
            reader._finalizer.detach()
            reader._finalizer = None


def close_all() -> None:
    """Close every reader of this process (a long-lived caller, like a test run, whose hosts
    may wait for a garbage collection before they go)."""
    for reader in list(_live()):
        reader.close()


def _at_exit() -> None:
    """At exit the idle readers are told to leave (their pipes close) and reaped: an idle
    reader is gone within a millisecond, while a parent that reaps nothing it inherits (PID 1
    of many containers, of this machine) would keep a zombie of every run. One still there
    after a tenth of a second is killed and left (`_close`)."""
    for reader in list(_live()):
        _close(reader.__dict__)


def _close(state: dict[str, Any]) -> None:
    import select

    child = state.get("_child")
    state["_child"] = None
    if child is not None:
        _release(child)  # the idle reader reads end-of-file and leaves
        # a pidfd is readable once its process has exited: no polling
        exited = select.poll()
        exited.register(child.pidfd, select.POLLIN)
        exited.poll(100)
        if _reaped(child.pidfd):
            os.close(child.pidfd)
        else:
            _kill(child.pidfd)
            _abandoned[child.pidfd] = child.pid
    reap_abandoned()
