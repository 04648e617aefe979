"""The rules a snapshot archive's members must keep, judged from their headers alone.

An archive comes from another host and may be hostile, so `unpack.py` reads every header
through `Members` before it writes a byte. A member is refused, with the reason, when:

- its kind is anything but a regular file or a directory: symbolic and hard links (a link
  can point out of the tree, or multiply the size cap), device files, FIFOs, sparse and
  unknown kinds;
- its name is empty, absolute, has a `.`, `..` or empty component, a control character
  (NUL included), a component over `MAX_COMPONENT_BYTES` or is over `MAX_PATH_BYTES` in all
  (well below PATH_MAX, whatever directory the archive is unpacked into);
- it is over `MAX_MEMBER_BYTES`, or the archive holds more than `MAX_MEMBERS` members or
  more than `MAX_TOTAL_BYTES` in all (the sizes declared in the headers: nothing larger can
  be written, since each file is written with exactly its declared size);
- it names a path an earlier member already took (a duplicate would overwrite), a file where
  another member needs a directory or the reverse, or lies outside the snapshot's one top
  directory.

The limits are module attributes read at each check, so a test can lower them.
"""

from __future__ import annotations

import os
import tarfile

MAX_MEMBER_BYTES = 64 << 20
MAX_MEMBERS = 200_000
MAX_TOTAL_BYTES = 1 << 30
MAX_COMPONENT_BYTES = 255  # NAME_MAX of every Linux file system xpuctl unpacks onto
MAX_PATH_BYTES = 1024  # a quarter of PATH_MAX: room for the temporary directory in front
#: an extended header (pax, GNU long name) is read whole into memory by tarfile: capped
MAX_HEADER_BYTES = 64 << 10

_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


def kind_refused(m: tarfile.TarInfo) -> str | None:
    """Why a member's kind is refused, or None for a regular file or a directory."""
    if m.type in _FILE_TYPES or m.isdir():
        return None
    if m.issym():
        return "symbolic link (an archive's links are refused)"
    if m.islnk():
        return "hard link (an archive's links are refused)"
    if m.ischr() or m.isblk():
        return "device file"
    if m.isfifo():
        return "FIFO"
    return "special file"


def name_refused(name: str) -> str | None:
    """Why a member's name is refused, or None."""
    if not name:
        return "empty name"
    if name.startswith("/"):
        return "absolute path"
    if any(ch < " " or ch == "\x7f" for ch in name):
        return "NUL in the path" if "\0" in name else "control character in the path"
    parts = name.split("/")
    if ".." in parts:
        return "'..' in the path"
    if "." in parts or "" in parts:
        return "'.' or empty component in the path"
    encoded = os.fsencode(name)
    if len(encoded) > MAX_PATH_BYTES:
        return f"path over {MAX_PATH_BYTES} bytes ({len(encoded)})"
    longest = max(len(os.fsencode(p)) for p in parts)
    if longest > MAX_COMPONENT_BYTES:
        return f"name component over {MAX_COMPONENT_BYTES} bytes ({longest})"
    return None


def check_member(m: tarfile.TarInfo) -> str | None:
    """Why one member is unsafe on its own, or None."""
    why = name_refused(m.name) or kind_refused(m)
    if why is None and m.size > MAX_MEMBER_BYTES:
        why = f"member over {MAX_MEMBER_BYTES >> 20} MiB ({m.size} bytes)"
    return why


class Refused(Exception):
    """A member breaks a rule: `member` is its name (None: the archive as a whole)."""

    def __init__(self, member: str | None, why: str) -> None:
        super().__init__(why)
        self.member = member
        self.why = why


class Members:
    """The members seen so far, and the rules that span members (count, total, a name taken
    twice, one top directory). `add` raises Refused; `layout` is what was accepted, in order."""

    def __init__(self) -> None:
        self.layout: list[tuple[str, bool, int]] = []  # (name, is a directory, size)
        self.total = 0
        self.top: str | None = None
        self._files: set[str] = set()
        self._dirs: set[str] = set()  # directories named or implied by a deeper member
        self._named: set[str] = set()  # directories named by a member of their own

    def add(self, m: tarfile.TarInfo) -> None:
        if len(self.layout) >= MAX_MEMBERS:
            raise Refused(m.name, f"more than {MAX_MEMBERS} members")
        why = check_member(m)
        if why is not None:
            raise Refused(m.name, why)
        self.total += m.size
        if self.total > MAX_TOTAL_BYTES:
            raise Refused(m.name, f"more than {MAX_TOTAL_BYTES >> 20} MiB in all")
        parts = m.name.split("/")
        if self.top is None:
            self.top = parts[0]
        if parts[0] != self.top:
            raise Refused(m.name, f"outside the snapshot's directory {self.top!r}")
        self._place(m.name, parts, m.isdir())
        self.layout.append((m.name, m.isdir(), m.size))

    def _place(self, name: str, parts: list[str], is_dir: bool) -> None:
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in self._files:
                raise Refused(name, f"inside {parent!r}, which is a file")
            self._dirs.add(parent)
        if name in self._files or (is_dir and name in self._named):
            raise Refused(name, "duplicate member (it would overwrite an earlier one)")
        if is_dir:
            self._dirs.add(name)
            self._named.add(name)
        elif name in self._dirs:
            raise Refused(name, "a file where another member has a directory")
        else:
            self._files.add(name)
