"""The caller's side of bounded reads: `Reader`, a Host's way of reading when its reads are
bounded (the package's docstring says why and how).

The reader is started on first use (`process.start`) and serves requests until its pipe
closes.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from xpuctl.host.reads import child as _child_side
from xpuctl.host.reads.process import (
    Child,
    abandoned,
    leave,
    reap_abandoned,
    reap_within,
    release,
    sigkill,
    start,
)
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


class _Pending:
    """A request `Reader.submit` sent: to which reader, and once its reply is read, the
    outcome (True, the value) or (False, the exception)."""

    __slots__ = ("args", "fn", "outcome", "request", "sent_to")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], request: bytes) -> None:
        self.fn, self.args, self.request = fn, args, request
        self.sent_to: Child | None = None
        self.outcome: tuple[bool, Any] = (False, RuntimeError("not collected"))


class Reader:
    """A Host's way of reading when its reads are bounded: functions and reads run in a
    reader child, each read bounded.

    `blocked` keeps every read that did not answer, in order, for reports."""

    def __init__(self, bound: float = DEFAULT_BOUND) -> None:
        self.bound = float(bound)
        self.blocked: dict[str, BlockedRead] = {}  # group -> the first file of it that blocked
        self._child: Child | None = None
        self._finalizer: Any = None
        self._owner = os.getpid()
        self._lock = threading.Lock()  # one request at a time on the pipe (serve has threads)
        self._pending: _Pending | None = None  # submitted, its reply not read yet (`submit`)
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

    def _ensure(self) -> Child:
        if self._child is not None and self._owner != os.getpid():
            # a forked copy of this process (a split helper): the reader is the parent's
            self._child, self._finalizer = None, None
        if self._child is None:
            self._owner = os.getpid()
            reap_abandoned()
            self._child = start()
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
            self._settle()
            return self._call(fn, args, kwargs)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """fn(*args) as `call` runs it, asked for now and collected later: the request is
        sent at once (the reader started if need be), and the function returned waits for
        the reply and returns or raises as `call` would. Meanwhile this process does other
        work: doctor loads what judges a scan while the reader takes it.

        The pipe holds one request at a time: a call made before this one is collected
        (another thread's, or another request's) first waits for this one's reply and keeps
        it for its collector."""
        with self._lock:
            self._settle()
            pending = _Pending(fn, args, self._request(fn, args, {}))
            child = self._ensure()
            try:
                self.round_trips += 1
                send(child.requests, pending.request)
                pending.sent_to = child
            except BrokenPipeError:
                pass  # it ended by itself: the collector sends it again (`_call`)
            self._pending = pending

        def collect() -> Any:
            with self._lock:
                if self._pending is pending:
                    self._settle()
            ok, value = pending.outcome
            if ok:
                return value
            raise value

        return collect

    def _settle(self) -> None:
        """Wait for the reply of a request submitted and not collected yet, and keep it
        (`_Pending.outcome`): the next reply on the pipe is then the next request's."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.outcome = (True, self._call(pending.fn, pending.args, {}, pending))
        except Exception as exc:  # raised to its collector, not to whoever settled it
            pending.outcome = (False, exc)

    def _request(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> bytes:
        import io

        out = io.BytesIO()
        pickler = _pickler()(out, protocol=5)
        pickler.reads = self
        pickler.dump((fn, args, kwargs, tuple(self.blocked.values()), self.bound))
        return out.getvalue()

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              sent: _Pending | None = None) -> Any:
        """The round trip, and again while a read blocks. `sent`: a request submitted to a
        reader, sent again only when that reader is no longer this Reader's."""
        died = 0
        request = sent.request if sent is not None else self._request(fn, args, kwargs)
        sent_to = sent.sent_to if sent is not None else None
        while True:
            child = self._ensure()
            try:
                if child is not sent_to:
                    self.round_trips += 1
                    send(child.requests, request)
                sent_to = None
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

    def _wait(self, child: Child) -> tuple[Any, ...] | None:
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
            sigkill(child.pidfd)
        for pid in set(stuck_pids) - {child.pid, 0}:
            try:  # its split helper, seen reading a moment ago: alive, so the pid is its own
                helper = os.pidfd_open(pid)
            except OSError:
                continue
            sigkill(helper)
            os.close(helper)
        abandoned[child.pidfd] = child.pid  # reaped later without waiting
        release(child)
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
    starts a reader of its own when it reads; a request submitted there is not the copy's to
    collect."""
    for reader in list(_LIVE or ()):
        child, reader._child = reader._child, None
        reader._pending = None
        if child is not None:
            release(child)
            os.close(child.pidfd)
        if reader._finalizer is not None:
            reader._finalizer.detach()
            reader._finalizer = None


def close_all() -> None:
    """Close every reader of this process (a long-lived caller, like a test run, whose hosts
    may wait for a garbage collection before they go)."""
    for reader in list(_live()):
        reader.close()


#: Readers told to leave before the exit (`let_go`), reaped at exit: pidfd -> pid.
_leaving: dict[int, int] = {}


def let_go() -> None:
    """Every idle reader of this process is told to leave now, not at exit: a command that
    has read all it will read (doctor, its report taken) lets the readers' exit overlap what
    it still does (rendering), instead of waiting for it at exit (1-2 ms). They are reaped
    at exit; a read made after all the same starts a new reader."""
    for reader in list(_LIVE or ()):
        with reader._lock:
            if reader._pending is not None:
                continue  # a request is out: its collector reads the reply
            child, reader._child = reader._child, None
        if child is not None:
            release(child)
            _leaving[child.pidfd] = child.pid


def _at_exit() -> None:
    """At exit the idle readers are told to leave (their pipes close) and reaped: an idle
    reader is gone within a millisecond, while a parent that reaps nothing it inherits (PID 1
    of many containers, of this machine) would keep a zombie of every run. One still there
    after a tenth of a second is killed and left (`_close`); so is one told to leave
    earlier (`let_go`)."""
    for reader in list(_live()):
        _close(reader.__dict__)
    while _leaving:
        pidfd, pid = _leaving.popitem()
        reap_within(pidfd, pid)


def _close(state: dict[str, Any]) -> None:
    child = state.get("_child")
    state["_child"] = None
    if child is not None:
        leave(child)
    reap_abandoned()
