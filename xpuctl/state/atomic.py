"""Replace a file atomically: the one way xpuctl writes a file someone else may be reading.

The data goes to a hidden temporary file in the target's directory (same filesystem, so the
rename is atomic), is fsynced, given its mode, and renamed over the target; with `sync_dir`
the directory is fsynced too, so the rename survives a crash. On any failure the temporary
file is removed, the old target is left as it was, and the OSError propagates: callers map
it to their own one-line error. Used by run records, the idle baseline, the node_exporter
textfile and snapshot archives.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from xpuctl import pausepoint


def temp_pattern(path: str, suffix: str = ".tmp") -> re.Pattern[str]:
    """The names `replace` gives its temporary files for `path`: `.NAME.` + mkstemp's eight
    characters + `suffix`. A SIGKILL between mkstemp and the rename leaves one behind."""
    name = os.path.basename(path)
    return re.compile(re.escape(f".{name}.") + r"[a-z0-9_]{8}" + re.escape(suffix) + r"\Z")


def fsync_dir(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # a filesystem that cannot sync directories
            raise
    finally:
        os.close(dfd)


def replace(
    path: str,
    data: bytes | Callable[[BinaryIO], None],
    *,
    mode: int | None = None,
    suffix: str = ".tmp",
    sync_dir: bool = False,
) -> None:
    """Put `data` (bytes, or a function writing to the open file) at `path` atomically.

    The temporary file is `.NAME.XXXX<suffix>` beside `path`; without `mode` it keeps
    mkstemp's 0600.
    """
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=suffix, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            if callable(data):
                data(f)
                f.flush()
            else:
                view = memoryview(data)
                while view:
                    view = view[os.write(f.fileno(), view):]
            os.fsync(f.fileno())
        pausepoint.reached("record-rename")
        os.replace(tmp, path)
        tmp = ""  # renamed: nothing to remove
        if sync_dir:
            fsync_dir(directory)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
