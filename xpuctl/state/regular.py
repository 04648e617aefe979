"""Opening a file of the state directory as what it must be: a regular file, bounded.

A run record, a run log, the audit log or the idle baseline is a regular file that xpuctl
wrote. Anything else found under its name (a FIFO, a socket, a device node, a symbolic link,
a directory) is damage, named with its path, and never opened in a way that can block or
read without end: a FIFO with no writer blocks `open` for reading until one comes (and one
with no reader blocks `open` for writing), and a link to `/dev/zero` never reaches its end.

So the name is looked at first (`lstat`: only a regular file is opened at all, so no device
node sees an `open`), then opened with `O_NOFOLLOW | O_NONBLOCK` (a link or a FIFO swapped in
meanwhile cannot block or redirect it) and checked again through the open descriptor
(`fstat`: still a regular file, the same device and inode). A read takes at most `cap` bytes
and says so when there was more.
"""

from __future__ import annotations

import errno
import os
import stat

from xpuctl.core.units import human_bytes

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


class NotRegularError(OSError):
    """The name is there but is not a regular file, or is larger than allowed: `why` says
    what it is ("a FIFO", "larger than 1 MiB")."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path} is {why}")
        self.path = path
        self.why = why
        self.strerror = f"is {why}"


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words ("a regular file", "a FIFO", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    for test, what in _KINDS:
        if test(mode):
            return what
    return f"a file of type {stat.S_IFMT(mode):o}"


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o600,
                 dir_fd: int | None = None) -> int:
    """A descriptor on the regular file at `path` (relative to `dir_fd` when given), opened
    with `flags` plus O_NOFOLLOW, O_NONBLOCK and O_CLOEXEC. FileNotFoundError when it is
    absent (and `flags` do not create it), NotRegularError when it is something else; other
    OSErrors (permission) as they come."""
    try:
        before: os.stat_result | None = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
        before = None
    if before is not None and not stat.S_ISREG(before.st_mode):
        raise NotRegularError(path, kind_of(before.st_mode))
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # swapped in: a link, a FIFO (no reader)
            raise NotRegularError(path, "not a regular file (it changed while opened)") from None
        raise
    try:
        st = os.fstat(fd)
        same = before is None or (st.st_dev, st.st_ino) == (before.st_dev, before.st_ino)
        if not stat.S_ISREG(st.st_mode) or not same:
            raise NotRegularError(path, kind_of(st.st_mode) if not stat.S_ISREG(st.st_mode)
                                  else "not the file it was (it changed while opened)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, cap: int, dir_fd: int | None = None) -> bytes:
    """The whole regular file at `path`, at most `cap` bytes: NotRegularError when it is not
    a regular file or holds more (read no further than cap + 1 bytes to know)."""
    fd = open_regular(path, dir_fd=dir_fd)
    try:
        chunks: list[bytes] = []
        left = cap + 1
        while left > 0:
            data = os.read(fd, min(left, 1 << 16))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
    finally:
        os.close(fd)
    if left <= 0:
        raise NotRegularError(path, f"larger than {human_bytes(cap)}")
    return b"".join(chunks)

