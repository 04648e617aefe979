"""Write a node_exporter textfile atomically.

node_exporter's textfile collector reads every `*.prom` file in its directory on each scrape,
at any moment. So the text goes to a hidden temporary file in the same directory (same
filesystem, so the rename is atomic; its name does not end in `.prom`, so the collector never
reads it), is fsynced, made 0644 (node_exporter often runs as another user), and renamed over
PATH; then the directory is fsynced so the rename survives a crash. On any failure the
temporary file is removed and the old PATH is left as it was.
"""

from __future__ import annotations

import errno
import os
import tempfile

from xpuctl.errors import UsageError, XpuctlError

MODE = 0o644
SUFFIX = ".prom"


def check_target(path: str) -> str:
    """The absolute PATH, or UsageError (exit 2) when it cannot be a textfile."""
    full = os.path.abspath(path)
    directory = os.path.dirname(full)
    if not full.endswith(SUFFIX) or os.path.basename(full) == SUFFIX:
        raise UsageError(f"--textfile {path}: the name must end in {SUFFIX} "
                         "(node_exporter's textfile collector reads only *.prom)")
    if not os.path.isdir(directory):
        raise UsageError(f"--textfile {path}: directory {directory} does not exist")
    if os.path.isdir(full):
        raise UsageError(f"--textfile {path}: is a directory")
    return full


def _fsync_dir(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # a filesystem that cannot sync directories
            raise
    finally:
        os.close(dfd)


def write_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` atomically (see the module docstring).

    A failure to write (no space, read-only filesystem, permission) raises XpuctlError
    (exit 1) with one line; nothing is left behind and the previous file is untouched.
    """
    full = check_target(path)
    directory, name = os.path.split(full)
    data = text.encode()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        try:
            os.fchmod(fd, MODE)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, full)
        tmp = None
        _fsync_dir(directory)
    except OSError as exc:
        raise XpuctlError(f"--textfile {path}: cannot write: {exc.strerror or exc}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
