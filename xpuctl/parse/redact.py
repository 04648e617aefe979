"""What a snapshot keeps of the files doctor read: bytes in, bytes out, no I/O.

Each function keeps exactly what doctor uses of a file and drops the rest, so an archive
carries no secrets doctor does not need: environ keeps only the variables doctor and a
support engineer look at, maps only the lines naming /dev/shm or /tmp, /proc/stat only
`btime`, /proc/net/unix only the sockets bound under /dev/shm or /tmp.
"""

from __future__ import annotations

from collections.abc import Callable

from xpuctl.parse.net import format_unix, parse_unix_paths

#: environ variables a snapshot keeps (prefixes, and one exact name); every other value is
#: dropped, since environ can hold secrets.
ENV_PREFIXES = ("XPUCTL_", "ZE_", "ONEAPI_", "SYCL_", "CCL_", "VLLM_")
ENV_NAMES = ("SPT_NOENV",)
#: Directories whose files doctor judges (see rules.py).
ARTIFACT_DIRS = ("/dev/shm/", "/tmp/")


def keeps_var(key: str) -> bool:
    return key.startswith(ENV_PREFIXES) or key in ENV_NAMES


def environ(data: bytes) -> bytes:
    """/proc/<pid>/environ with only the kept variables, in their order (duplicates too:
    the parser keeps the first)."""
    kept = []
    for item in data.split(b"\0"):
        key, sep, _ = item.partition(b"=")
        if sep and keeps_var(key.decode("utf-8", "surrogateescape")):
            kept.append(item + b"\0")
    return b"".join(kept)


def env_dict(env: dict[str, str]) -> dict[str, str]:
    """A process environment (the caller's) reduced the same way."""
    return {k: v for k, v in env.items() if keeps_var(k)}


def maps(data: bytes, to_host: Callable[[str], str]) -> bytes:
    """The /proc/<pid>/maps lines naming a file under /dev/shm or /tmp (as `to_host` maps the
    kernel's path), with that path written as the host path."""
    out = []
    for line in data.decode("utf-8", "surrogateescape").splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(" (deleted)"):
            continue
        path = to_host(parts[5])
        if path.startswith(ARTIFACT_DIRS):
            out.append(line[: len(line) - len(parts[5])] + path + "\n")
    return "".join(out).encode("utf-8", "surrogateescape")


def proc_stat(data: bytes) -> bytes:
    """/proc/stat: the `btime` line only (boot time, for process start times)."""
    return b"".join(line + b"\n" for line in data.splitlines() if line.startswith(b"btime"))


def net_unix(text: str, to_host: Callable[[str], str]) -> str:
    """/proc/net/unix: the sockets bound under /dev/shm or /tmp, with host paths."""
    paths = {to_host(p): inode for p, inode in parse_unix_paths(text).items()}
    return format_unix({p: i for p, i in paths.items() if p.startswith(ARTIFACT_DIRS)})
