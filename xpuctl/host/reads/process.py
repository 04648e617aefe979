"""A reader process's life: started (forked, or spawned when this process runs other threads:
a fork copies only the calling thread, and locks the others hold would stay locked in the
copy), released when done (an idle reader leaves when its pipe closes), killed when a read
blocks, and reaped, through its pidfd, whoever else reaps children here."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, NamedTuple

from xpuctl.host.reads import child as _child_side
from xpuctl.host.reads.protocol import SLOT, SLOTS

if TYPE_CHECKING:  # imported where it is used: most commands never start a reader
    import mmap

#: Readers killed while blocked, not yet reaped: pidfd -> pid. Reaped without waiting, whenever
#: we pass; through the pidfd, so a pid reaped meanwhile by someone else (serve reaps every
#: exited child) and then reused never names the wrong process.
abandoned: dict[int, int] = {}


def reaped(pidfd: int) -> bool:
    """Reap the child if it has exited; True when it is gone (reaped here or elsewhere)."""
    try:
        return os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None
    except ChildProcessError:
        return True


def reap_abandoned() -> None:
    for pidfd in list(abandoned):
        if reaped(pidfd):
            del abandoned[pidfd]
            os.close(pidfd)


def sigkill(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # dies when its read returns, if ever
    except OSError:
        pass


def threads_running() -> bool:
    return threading.active_count() > 1


class Child(NamedTuple):
    pid: int
    pidfd: int  # signals and waits go through it: the pid may be reaped by others
    requests: int  # we write
    replies: int  # we read
    page: mmap.mmap  # its own: a helper of an abandoned reader may still write into its old one


def start() -> Child:
    import mmap

    memfd = os.memfd_create("xpuctl-reads", os.MFD_CLOEXEC)
    try:
        os.ftruncate(memfd, SLOTS * SLOT)
        page = mmap.mmap(memfd, SLOTS * SLOT)
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = _spawn(req_r, rep_w, memfd) if threads_running() else _fork(req_r, rep_w, page, (req_w, rep_r, memfd))
    finally:
        os.close(memfd)
    os.close(req_r)
    os.close(rep_w)
    return Child(pid, os.pidfd_open(pid), req_w, rep_r, page)


def release(child: Child) -> None:
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


def leave(child: Child) -> None:
    """An idle reader told to leave (its pipes close) and reaped: gone within a millisecond;
    one still there after a tenth of a second is killed and left to `reap_abandoned`."""
    release(child)  # the idle reader reads end-of-file and leaves
    reap_within(child.pidfd, child.pid)


def reap_within(pidfd: int, pid: int, ms: int = 100) -> None:
    """A reader told to leave, reaped once it has exited (waited for up to `ms`), else
    killed and left to `reap_abandoned`."""
    import select

    # a pidfd is readable once its process has exited: no polling
    exited = select.poll()
    exited.register(pidfd, select.POLLIN)
    exited.poll(ms)
    if reaped(pidfd):
        os.close(pidfd)
    else:
        sigkill(pidfd)
        abandoned[pidfd] = pid
