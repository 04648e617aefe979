"""Hold N idle processes with K open fds each; the first HOLDERS of them also hold NODE.

Usage: python holders.py N K NODE HOLDERS [exec|fork] [shared:DIR]

One parent forks N children. Every child has exactly K fds open (0, 1 and 2 included):
/dev/null, pipe ends, unix socket pairs, an eventfd, a few regular files and /dev/null
duplicates as filler; in the first HOLDERS children the last fd is NODE instead.
exec (default): each child then execs `sleep infinity`, keeping those fds (about 0.2 MiB
per process). fork: each child stays a forked copy of this interpreter, paused (about
0.6 MiB per process: page tables and the pages the child touches).
The parent writes "ready <pid> <pid> ..." to its stdout once every child has its final
fd set (through a pipe each child closes when ready: by exec, or after writing a byte),
then waits. On SIGTERM, SIGINT or SIGHUP it SIGKILLs and reaps its own children and exits.
Children carry PR_SET_PDEATHSIG=SIGKILL, so they die with the parent if it is killed; the
parent carries PR_SET_PDEATHSIG=SIGTERM, so a bench killed without its cleanup (SIGKILL, or
a SIGTERM to a script that does not close its population) takes the population with it: a
session of 2026-12-06 left 3,000 sleeping processes for two hours that way, and every later
scan of /proc counted them. (The death signal follows the thread that started this process:
start it from a thread that outlives the population, as harness.Population does.)

shared:DIR (issue 38's population): every child's K fds are all on five regular files
DIR/shared-0..4 (the parent makes them), fd i on file i mod 5; and one child in
N / HOLDERS (every tenth for HOLDERS = N / 10), spread over the population, holds NODE as
an extra fd K.
"""

import ctypes
import gc
import os
import shutil
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1
REPORT_FD = 1000  # the parent's report channel, kept out of the children's fd range
READY_R, READY_W = 1001, 1002  # children report "set up" here, then close it


def fill_fds(k: int) -> None:
    """Leave this process holding exactly fds 0..k-1 (plus REPORT_FD)."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    if null > 2:
        os.close(null)
    os.closerange(3, REPORT_FD)
    os.closerange(READY_W + 1, 1 << 16)
    made: list[int] = []
    for _ in range(4):
        made += list(os.pipe())
    for _ in range(2):
        a, b = socket.socketpair()
        made += [a.detach(), b.detach()]
    if hasattr(os, "eventfd"):
        made.append(os.eventfd(0))
    for path in ("/etc/hostname", "/etc/passwd", "/etc/os-release", sys.executable):
        try:
            made.append(os.open(path, os.O_RDONLY))
        except OSError:
            pass
    while len(made) + 3 > k and made:
        os.close(made.pop())
    while len(made) + 3 < k:
        made.append(os.dup(0))
    for fd in made:
        os.set_inheritable(fd, True)  # kept across exec in "exec" mode


def fill_shared(k: int, files: list[str]) -> None:
    """Leave this process holding exactly fds 0..k-1 (plus REPORT_FD), fd i on files[i % 5]."""
    os.closerange(0, REPORT_FD)
    os.closerange(READY_W + 1, 1 << 16)
    for i in range(k):
        fd = os.open(files[i % len(files)], os.O_RDONLY)
        if fd != i:
            raise RuntimeError(f"expected fd {i}, got {fd}")
        os.set_inheritable(fd, True)


def main() -> None:
    n, k, node, n_hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "exec"
    shared = sys.argv[6].removeprefix("shared:") if len(sys.argv) > 6 else None
    files: list[str] = []
    if shared is not None:
        for j in range(5):
            files.append(os.path.join(shared, f"shared-{j}"))
            with open(files[-1], "wb") as f:
                f.write(b"x")
    every = max(1, n // n_hold) if n_hold else 0
    sleep = shutil.which("sleep") or "/bin/sleep"
    if mode not in ("exec", "fork"):
        sys.exit("mode must be exec or fork")
    if not 4 <= k < REPORT_FD:
        sys.exit("K must be in 4..999")
    os.dup2(1, REPORT_FD, inheritable=False)
    r, w = os.pipe()
    os.dup2(r, READY_R, inheritable=False)
    os.dup2(w, READY_W, inheritable=False)
    if r not in (READY_R, READY_W):
        os.close(r)
    if w not in (READY_R, READY_W):
        os.close(w)
    if shared is None:
        fill_fds(k)
    else:
        fill_shared(k, files)
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()
    kids: list[int] = []

    def stop(*_: object) -> None:
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
        os._exit(0)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, stop)
    boss = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != boss:  # the bench died before the death signal was armed
        stop()
    gc.disable()
    gc.freeze()  # children must not touch (copy) the parent's object pages
    last = k - 1
    try:
        for i in range(n):
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(REPORT_FD)
                    os.close(READY_R)
                    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
                    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                        signal.signal(s, signal.SIG_DFL)
                    if os.getppid() != parent:
                        os._exit(0)
                    if shared is not None and every and i % every == 0:
                        fd = os.open(node, os.O_RDWR)
                        if fd != k:
                            os.dup2(fd, k)
                            os.close(fd)
                        os.set_inheritable(k, True)
                    elif shared is None and i < n_hold:
                        fd = os.open(node, os.O_RDWR)
                        os.dup2(fd, last)
                        os.close(fd)
                    if mode == "exec":
                        # READY_W is close-on-exec: the parent sees EOF once every child
                        # has exec'd, i.e. holds exactly its K inherited fds
                        os.execv(sleep, [sleep, "infinity"])
                    os.write(READY_W, b"r")
                    os.close(READY_W)
                    while True:
                        signal.pause()
                finally:
                    os._exit(0)
            kids.append(pid)
        os.close(READY_W)
        got = 0
        while True:  # every child has its final fd set (fork: wrote a byte; exec: exec'd)
            chunk = os.read(READY_R, 65536)
            if not chunk:
                break
            got += len(chunk)
        os.close(READY_R)
        if mode == "fork" and got < n:
            raise RuntimeError(f"only {got} of {n} children reported ready")
        dead = [pid for pid in kids if os.waitpid(pid, os.WNOHANG)[0]]
        if dead:
            raise RuntimeError(f"{len(dead)} children exited during set-up")
    except BaseException as exc:
        os.write(REPORT_FD, f"error {type(exc).__name__}: {exc}\n".encode())
        stop()
    os.write(REPORT_FD, ("ready " + " ".join(map(str, kids)) + "\n").encode())
    os.close(REPORT_FD)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
