"""Write a node_exporter textfile atomically.

node_exporter's textfile collector reads every `*.prom` file in its directory on each scrape,
at any moment. So the text goes to a hidden temporary file in the same directory (same
filesystem, so the rename is atomic; its name does not end in `.prom`, so the collector never
reads it), is fsynced, made 0644 (node_exporter often runs as another user), and renamed over
PATH; then the directory is fsynced so the rename survives a crash. On any failure the
temporary file is removed and the old PATH is left as it was.

Only a SIGKILL (or a crash) between creating the temporary file and the rename leaves it
behind, as `.NAME.XXXXXXXX.tmp`. The next write removes such files older than
`STALE_TEMP_SECONDS` (`doctor.write_textfile` -> `cleanup.remove_stale_temps`, audited).
"""

from __future__ import annotations

import os

from xpuctl.errors import UsageError, XpuctlError
from xpuctl.state import atomic

MODE = 0o644
SUFFIX = ".prom"
#: a temporary file of ours older than this is a leftover: a write renames its file within
#: milliseconds, and even an fsync on a loaded disk ends well within five minutes
STALE_TEMP_SECONDS = 300.0


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


def write_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` atomically (see the module docstring).

    A failure to write (no space, read-only filesystem, permission) raises XpuctlError
    (exit 1) with one line; nothing is left behind and the previous file is untouched.
    """
    full = check_target(path)
    try:
        atomic.replace(full, text.encode(), mode=MODE, sync_dir=True)
    except OSError as exc:
        raise XpuctlError(f"--textfile {path}: cannot write: {exc.strerror or exc}") from None
