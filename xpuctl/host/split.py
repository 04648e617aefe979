"""Run a per-process pass over /proc in two processes.

A pass over every process costs kernel work per process and per fd (readlink, listing,
rendering maps). Above SPLIT_ABOVE items, a forked copy of this process shares the work
with this one. Two threads would gain far less: each needs the GIL between two syscalls,
and handing it over costs about as much as the syscall it wraps (bench/scanpass.py).

The items are cut into chunks whose numbers are written to a pipe before the fork; each
process takes the next number with one read(2) until the pipe is empty, so a process that
gets less CPU (another task on its core) simply takes fewer chunks. The helper sends its
result back through a second pipe and leaves with os._exit: no exit handlers, no buffered
output. It stops taking chunks once this process is gone (a reader killed: nobody would read
its result). If it fails (fork refused, a crash, garbled data) this process does the helper's
chunks too, so a split pass never sees less than a plain one.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

#: Measured on 2 cores with 35 fds per process: the split pays from about 100 processes
#: (bench/README.md).
SPLIT_ABOVE = 200
CHUNK = 16  # items per chunk: ~1 ms of work; one read(2) to take it
_ID = 2  # bytes per chunk number in the queue pipe
_MAX_CHUNKS = 2048  # 4 KiB of chunk numbers: one atomic write into even a one-page pipe


def can_split() -> bool:
    """A second core, and no other thread in this process: a fork copies only the calling
    thread, so a lock held by another one (logging, imports) would stay locked in the copy."""
    try:
        if len(os.sched_getaffinity(0)) < 2:
            return False
    except (AttributeError, OSError):
        return False
    threading = sys.modules.get("threading")
    return threading is None or threading.active_count() == 1


def _default_signals() -> None:
    """In the helper: no Python signal handler of the caller's (serve forwards SIGTERM to a
    vLLM tree) may run here. With the defaults a signal just ends the helper, and the
    caller redoes its chunks."""
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue


def _take(queue: int, chunks: list[list[Any]], taken: list[int],
          parent: int | None = None) -> Iterator[Any]:
    """The items of every chunk this process takes from the queue, in order. In the helper
    (`parent`: the pid of the process that forked it), none once that process is gone (a
    reader killed: nobody would read the result)."""
    while True:
        if parent is not None and os.getppid() != parent:
            return
        b = os.read(queue, _ID)
        if len(b) < _ID:
            return  # empty: the writer is closed, so this is the end
        n = int.from_bytes(b, "little")
        taken.append(n)
        yield from chunks[n]


def in_two(work: Callable[[Iterable[Any]], T], items: list[Any], dumps: Callable[[T], bytes],
           loads: Callable[[bytes], T], split: bool = True,
           in_helper: Callable[[], None] | None = None) -> list[T]:
    """work(items) as one or two partial results: [work(items)] when a split does not pay,
    is not possible or not wanted (`split` False), else one result from here and one from a
    helper, over disjoint parts of `items` that together are all of it. `dumps`/`loads`
    carry a result through a pipe. `in_helper` runs first in the helper (in a reader:
    Host.in_split_helper, so the helper publishes its reads in its own slot)."""
    if not split or len(items) <= SPLIT_ABOVE or not can_split():
        return [work(items)]
    size = max(CHUNK, -(-len(items) // _MAX_CHUNKS))
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    pipes = _queue(len(chunks))
    if pipes is None:
        return [work(items)]
    q_r, r, w = pipes
    # Signals wait until the helper has dropped the caller's handlers (see _default_signals).
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    parent = os.getpid()
    try:
        child = os.fork()
    except OSError:
        child = -1
    if child == 0:  # the helper
        _helper(work, dumps, blocked, in_helper, q_r, chunks, parent, r, w)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(w)
    mine: list[int] = []
    theirs = None
    try:
        if child < 0:
            os.close(r)
            r = -1
        first = work(_take(q_r, chunks, mine))
    finally:
        os.close(q_r)
        if child > 0:
            theirs = _collect(child, r, loads)
    if theirs is None:  # no helper, or it failed: do every chunk this process did not take
        done = set(mine)
        theirs = work([x for n, chunk in enumerate(chunks) if n not in done for x in chunk])
    return [first, theirs]


def _queue(n: int) -> tuple[int, int, int] | None:
    """(the queue's read end, filled with the numbers of `n` chunks; the result pipe's read
    and write ends), or None when the pipes cannot be had."""
    try:
        q_r, q_w = os.pipe()
    except OSError:
        return None
    try:
        os.set_blocking(q_w, False)  # never wait on our own pipe; too small means no split
        os.write(q_w, b"".join(i.to_bytes(_ID, "little") for i in range(n)))
        os.close(q_w)
        q_w = -1
        r, w = os.pipe()
    except OSError:
        os.close(q_r)
        if q_w >= 0:
            os.close(q_w)
        return None
    return q_r, r, w


def _helper(work: Callable[[Iterable[Any]], T], dumps: Callable[[T], bytes],
            blocked: Any, in_helper: Callable[[], None] | None, q_r: int,
            chunks: list[list[Any]], parent: int, r: int, w: int) -> None:
    """The forked helper: take chunks, send the result, leave (never returns)."""
    code = 1
    try:
        _default_signals()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if in_helper is not None:
            in_helper()
        os.close(r)
        view = memoryview(dumps(work(_take(q_r, chunks, [], parent))))
        while view:
            view = view[os.write(w, view):]
        code = 0
    finally:
        os._exit(code)


def _collect(child: int, r: int, loads: Callable[[bytes], T]) -> T | None:
    """The helper's result; None when it failed."""
    chunks = []
    try:
        while True:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        try:
            _, status = os.waitpid(child, 0)
        except ChildProcessError:
            status = 0  # reaped by someone else; the data decides
    if status != 0:
        return None
    try:
        return loads(b"".join(chunks))
    except (EOFError, ValueError, TypeError):
        return None
