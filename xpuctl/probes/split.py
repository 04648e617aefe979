"""Run a per-process pass over /proc in two processes.

A pass over every process costs kernel work per process and per fd (readlink, listing,
rendering maps). Above SPLIT_ABOVE items, a forked copy of this process does every other
item and sends its result back through a pipe while this process does the rest. Two
threads would gain far less: each needs the GIL between two syscalls, and handing it over
costs about as much as the syscall it wraps (bench/scanpass.py has the figures).

The helper only reads /proc and writes to its pipe, then leaves with os._exit: no exit
handlers, no buffered output. If it fails (fork refused, a crash, garbled data) this
process does its half too, so a split pass never sees less than a plain one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: Measured on 2 cores with 35 fds per process: the split pays from about 100 processes
#: (bench/README.md).
SPLIT_ABOVE = 200


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


def _fork_helper(work: Callable[[list], T], items: list, dumps: Callable[[T], bytes]) -> tuple[int, int] | None:
    """(pid, read end of its pipe) of a helper doing work(items), or None."""
    try:
        r, w = os.pipe()
    except OSError:
        return None
    try:
        child = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if child == 0:  # the helper
        code = 1
        try:
            os.close(r)
            view = memoryview(dumps(work(items)))
            while view:
                view = view[os.write(w, view):]
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return child, r


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


def in_two(work: Callable[[list], T], items: list, dumps: Callable[[T], bytes],
           loads: Callable[[bytes], T]) -> list[T]:
    """work(items) as one or two partial results: [work(items)] when a split does not pay
    or is not possible, else [work(items[0::2]), work(items[1::2])] with the second done by
    a helper. `dumps`/`loads` carry a result through the pipe."""
    helper = (_fork_helper(work, items[1::2], dumps)
              if len(items) > SPLIT_ABOVE and can_split() else None)
    if helper is None:
        return [work(items)]
    try:
        mine = work(items[0::2])
    finally:
        theirs = _collect(*helper, loads)
    return [mine, theirs if theirs is not None else work(items[1::2])]
