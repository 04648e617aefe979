"""Parsers for /proc/<pid>/{stat,status,cmdline,environ,maps} and /proc/stat (bytes in, data out)."""

from __future__ import annotations

from typing import NamedTuple

#: PF_KTHREAD in the flags field of /proc/<pid>/stat (include/linux/sched.h): a kernel
#: thread, which has no open files of its own.
PF_KTHREAD = 0x00200000


class ProcStat(NamedTuple):
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    threads: int
    start_ticks: int
    kthread: bool = False


def parse_stat(data: bytes) -> ProcStat | None:
    """Parse /proc/<pid>/stat; None when truncated or garbled.

    `comm` may hold spaces and parentheses, so its end is the *last* ')'.
    """
    open_ = data.find(b"(")
    close = data.rfind(b")")
    if open_ < 0 or close < open_:
        return None
    rest = data[close + 2 :].split()
    # rest[0] is field 3 (state); flags is field 9 -> rest[6]; starttime is field 22 -> rest[19]
    if len(rest) < 20:
        return None
    try:
        return ProcStat(
            comm=data[open_ + 1 : close].decode("utf-8", "surrogateescape"),
            state=rest[0].decode("ascii", "replace")[:1],
            ppid=int(rest[1]),
            pgrp=int(rest[2]),
            session=int(rest[3]),
            threads=int(rest[17]),
            start_ticks=int(rest[19]),
            kthread=bool(int(rest[6]) & PF_KTHREAD),
        )
    except ValueError:
        return None


def parse_status_uid(text: str) -> int | None:
    """Real uid from /proc/<pid>/status (`Uid:\treal\teffective\tsaved\tfs`)."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            parts = line[4:].split()
            if parts and parts[0].isascii() and parts[0].isdigit():
                return int(parts[0])
            return None
    return None


def parse_status_nspid(text: str) -> tuple[str, ...]:
    """The `NSpid:` ids of /proc/<pid>/status, outermost namespace first (one entry in the
    initial PID namespace; () on kernels before 4.1, which have no such line)."""
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            return tuple(line.split(":", 1)[1].split())
    return ()


def parse_cmdline(data: bytes) -> list[str]:
    """argv from /proc/<pid>/cmdline.

    setproctitle writes the title over argv and pads with NULs (or spaces on some versions),
    so trailing empties are dropped; a title padded with spaces is trimmed.
    """
    if not data:
        return []
    # surrogateescape: a byte that is not UTF-8 is kept reversibly (JSON writes it as \udcXX,
    # the terminal shows \xNN: safetext.safe)
    args = data.decode("utf-8", "surrogateescape").split("\0")
    while args and args[-1] == "":
        args.pop()
    if len(args) == 1:
        args[0] = args[0].rstrip(" ")
    return args


#: The most of a command line any output shows (ps, doctor, JSON, findings): a process can
#: have megabytes of argv, and 20 such made `ps --json` print 37 MiB.
ARGV_SHOWN_BYTES = 4096


def argv_bytes(argv: tuple[str, ...] | list[str]) -> int:
    """The length of argv as /proc/<pid>/cmdline gives it: each word and its NUL."""
    return sum(len(w.encode("utf-8", "surrogateescape")) + 1 for w in argv)


def shown_argv(argv: tuple[str, ...] | list[str], total: int = 0,
               cap: int = ARGV_SHOWN_BYTES) -> tuple[tuple[str, ...], int]:
    """(the words shown, the bytes cut): argv within `cap` bytes as /proc/<pid>/cmdline
    counts them (the last word maybe cut inside), and how many bytes of the whole, `total`
    (0: argv is the whole), are not shown. The cut never splits a UTF-8 sequence."""
    whole = max(total, argv_bytes(argv))
    if whole <= cap:
        return tuple(argv), whole - argv_bytes(argv)
    out: list[str] = []
    used = 0
    for word in argv:
        raw = word.encode("utf-8", "surrogateescape")
        if used + len(raw) + 1 <= cap:
            out.append(word)
            used += len(raw) + 1
            continue
        part = _utf8_prefix(raw, cap - used)
        if part:
            out.append(part.decode("utf-8", "surrogateescape"))
            used += len(part)
        break
    return tuple(out), whole - used


def _utf8_prefix(raw: bytes, n: int) -> bytes:
    """raw[:n], shortened so as not to end inside a UTF-8 sequence."""
    if n <= 0:
        return b""
    end = n
    i = end - 1
    while i > end - 4 and i > 0 and raw[i] & 0xC0 == 0x80:
        i -= 1
    lead = raw[i]
    if lead >= 0xC0:
        size = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        if i + size > end:
            end = i
    return raw[:end]


def shown_command(argv: tuple[str, ...] | list[str], total: int = 0) -> str:
    """argv as one line for people, capped like `shown_argv`, with `…[+N bytes]` when cut."""
    words, cut = shown_argv(argv, total)
    line = " ".join(words)
    return f"{line}…[+{cut} bytes]" if cut else line


def parse_environ(data: bytes) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env.setdefault(
                key.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")
            )
    return env


class Mapping(NamedTuple):
    """One file mapping of /proc/<pid>/maps: its address range (the name of its entry in
    /proc/<pid>/map_files), the device and inode of the mapped file, and its path as the
    kernel shows it (in the mapping process's mount namespace; "" when there is none)."""

    span: str
    major: int
    minor: int
    inode: int
    path: str


def parse_maps(text: str) -> list[Mapping]:
    """The file mappings of /proc/<pid>/maps (inode not 0): `start-end perms offset
    major:minor inode path`, the device in hex and the inode in decimal (show_map_vma in
    the kernel's fs/proc/task_mmu.c). A file mapped through a bind mount, or in another
    mount namespace, shows that namespace's path but its own device and inode: those are
    what identify it. Lines that do not parse are skipped."""
    out: list[Mapping] = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        inode = parts[4]
        if inode == "0" or not (inode.isascii() and inode.isdigit()):
            continue
        major, sep, minor = parts[3].partition(":")
        try:
            dev = (int(major, 16), int(minor, 16)) if sep else None
        except ValueError:
            dev = None
        if dev is None or "-" not in parts[0]:
            continue
        path = parts[5] if len(parts) > 5 else ""
        out.append(Mapping(parts[0], dev[0], dev[1], int(inode), path))
    return out


class Mount(NamedTuple):
    """One line of /proc/<pid>/mountinfo: the device (major:minor) and the path inside that
    filesystem that is mounted (its root: "/" for a whole filesystem, a directory or a file
    for a bind mount)."""

    major: int
    minor: int
    root: str


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of /proc/<pid>/mountinfo (`id parent major:minor root mount-point ...`,
    proc(5); space, tab, newline and backslash in a path are octal escapes such as `\\040`).
    Lines that do not parse are skipped."""
    out: list[Mount] = []
    for line in text.splitlines():
        parts = line.split(" ", 4)
        if len(parts) < 5:
            continue
        major, sep, minor = parts[2].partition(":")
        if not (sep and major.isascii() and major.isdigit()
                and minor.isascii() and minor.isdigit()):
            continue
        out.append(Mount(int(major), int(minor), _unescape(parts[3])))
    return out


def _unescape(path: str) -> str:
    if "\\" not in path:
        return path
    out, i = [], 0
    while i < len(path):
        c = path[i]
        code = path[i + 1:i + 4]
        if c == "\\" and len(code) == 3 and all(x in "01234567" for x in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Creds(NamedTuple):
    """Who a process acts as, from /proc/<pid>/status (readable for every process): its
    uids and gids (real, effective, saved, filesystem), its supplementary groups and its
    effective capabilities (a bit mask)."""

    uids: tuple[int, ...]
    gids: tuple[int, ...]
    groups: tuple[int, ...]
    cap_eff: int


def parse_status_creds(text: str) -> Creds | None:
    """The `Uid:`, `Gid:`, `Groups:` and `CapEff:` lines of /proc/<pid>/status; None when
    a uid or gid line is missing or garbled."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("Uid", "Gid", "Groups", "CapEff"):
            fields[key] = value
    try:
        uids = tuple(int(x) for x in fields["Uid"].split())
        gids = tuple(int(x) for x in fields["Gid"].split())
        groups = tuple(int(x) for x in fields.get("Groups", "").split())
        cap = int(fields.get("CapEff", "0").strip() or "0", 16)
    except (KeyError, ValueError):
        return None
    if not uids or not gids:
        return None
    return Creds(uids, gids, groups, cap)


def parse_maps_paths(text: str) -> set[str]:
    """The file paths mapped in /proc/<pid>/maps (as the kernel shows them)."""
    paths: set[str] = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5]
            if path.endswith(" (deleted)"):
                continue
            paths.add(path)
    return paths


def maps_library(text: str, stem: str) -> bool:
    """Does /proc/<pid>/maps map a shared library named `stem.so*` (`libccl` matches
    `/opt/.../libccl.so.1`, also one deleted since it was mapped)?"""
    want = f"/{stem}.so"
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and want in parts[5]:
            name = parts[5].removesuffix(" (deleted)").rsplit("/", 1)[-1]
            if name == want[1:] or name.startswith(want[1:] + "."):
                return True
    return False


def parse_boot_time(text: str) -> float | None:
    """`btime` from /proc/stat: boot time in seconds since the epoch."""
    for line in text.splitlines():
        if line.startswith("btime"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isascii() and parts[1].isdigit():
                return float(parts[1])
    return None
