"""Unpack a snapshot archive safely, or refuse it with one line (exit 2).

An archive comes from another host and may be hostile. Every member is checked before
anything is written, and the rules are checked here one by one (tarfile's `data` filter,
where the Python has it, runs on top as a second guard):

- no absolute name, no `..` component;
- only regular files, directories and links; no device file, FIFO or other special file;
- a symbolic or hard link must stay inside the tree (checked on its text, then again on
  the unpacked tree with realpath, which sees chains of links);
- no member over 64 MiB, no more than 200 000 members, at most 1 GiB in all;
- all members under one top directory, the snapshot's.

Unpacked files are owner-only (0600, directories 0700) and the caller's own: nothing of
the archive's modes or owners survives.
"""

from __future__ import annotations

import os
import posixpath
import stat
import tarfile
import zlib

from xpuctl.errors import UsageError

MAX_MEMBER_BYTES = 64 << 20
MAX_MEMBERS = 200_000
MAX_TOTAL_BYTES = 1 << 30


class UnsafeArchive(UsageError):
    """The archive breaks a rule above (exit 2)."""


def _leaves(name: str, target: str) -> bool:
    """True when `target` (a link text, relative to the directory of member `name`) points
    outside the tree."""
    if target.startswith("/"):
        return True
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    return joined == ".." or joined.startswith("../")


def check_member(m: tarfile.TarInfo) -> str | None:
    """Why a member is unsafe, or None."""
    name = m.name
    if name.startswith("/"):
        return "absolute path"
    if ".." in name.split("/"):
        return "'..' in the path"
    if "\0" in name:
        return "NUL in the path"
    if m.ischr() or m.isblk():
        return "device file"
    if m.isfifo():
        return "FIFO"
    if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
        return "special file"
    if m.issym() and _leaves(name, m.linkname):
        return f"symbolic link leaving the tree ({m.linkname!r})"
    if m.islnk() and (m.linkname.startswith("/") or ".." in m.linkname.split("/")):
        return f"hard link leaving the tree ({m.linkname!r})"
    if m.size > MAX_MEMBER_BYTES:
        return f"member over {MAX_MEMBER_BYTES >> 20} MiB ({m.size} bytes)"
    return None


def _refuse(path: str, why: str) -> UnsafeArchive:
    return UnsafeArchive(f"refusing unsafe snapshot {path}: {why}")


def _private(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    data_filter = getattr(tarfile, "data_filter", None)
    if data_filter is not None:
        member = data_filter(member, dest)
    mode = 0o700 if member.isdir() else 0o600
    # None drops the archive's owner: extract() then leaves the files to the extracting user
    # (typeshed types these as int and str only)
    return member.replace(mode=mode, uid=None, gid=None, uname=None, gname=None,  # type: ignore[arg-type]
                          deep=False)


def unpack(path: str, dest: str) -> str:
    """Check and unpack the archive at `path` into the empty directory `dest`; return the
    top directory's path. UnsafeArchive or UsageError (exit 2) when it cannot be used."""
    try:
        tf = tarfile.open(path, "r:*")  # noqa: SIM115 (closed by the `with tf` below)
    except FileNotFoundError:
        raise UsageError(f"snapshot {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"snapshot {path}: is a directory") from None
    except OSError as exc:
        raise UsageError(f"snapshot {path}: {exc.strerror or exc}") from None
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise UsageError(f"snapshot {path}: not a tar archive ({_line(exc)})") from None
    with tf:
        members: list[tarfile.TarInfo] = []
        total = 0
        top: str | None = None
        try:
            for m in tf:
                if len(members) >= MAX_MEMBERS:
                    raise _refuse(path, f"more than {MAX_MEMBERS} members")
                why = check_member(m)
                if why is not None:
                    raise _refuse(path, f"member {m.name!r}: {why}")
                total += m.size
                if total > MAX_TOTAL_BYTES:
                    raise _refuse(path, f"more than {MAX_TOTAL_BYTES >> 30} GiB in all")
                first = m.name.split("/", 1)[0]
                if top is None and first not in ("", "."):
                    top = first
                if first != top:
                    raise _refuse(path, f"member {m.name!r} is outside the snapshot's "
                                        f"directory {top!r}")
                members.append(m)
            if top is None:
                raise UsageError(f"snapshot {path}: empty archive")
            tf.extractall(dest, members=members, numeric_owner=True,
                          **({"filter": _private} if hasattr(tarfile, "data_filter") else {}))
        except UsageError:
            raise
        except (tarfile.TarError, EOFError, zlib.error, OSError, KeyError) as exc:
            # KeyError: a hard link to a member the archive does not have
            raise UsageError(f"snapshot {path}: damaged archive ({_line(exc)})") from None
    if not hasattr(tarfile, "data_filter"):  # Python < 3.11.4: set the modes ourselves
        _owner_only(dest)
    _links_stay_inside(path, dest)
    return os.path.join(dest, top)


def _line(exc: BaseException) -> str:
    """An exception's text on one line (tarfile's can span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _owner_only(dest: str) -> None:
    for dirpath, dirnames, filenames in os.walk(dest):
        for n in dirnames:
            os.chmod(os.path.join(dirpath, n), 0o700, follow_symlinks=False)
        for n in filenames:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                os.chmod(p, 0o600)


def _links_stay_inside(path: str, dest: str) -> None:
    """Every symbolic link, resolved on the finished tree (chains included), stays inside."""
    real_dest = os.path.realpath(dest)
    for dirpath, dirnames, filenames in os.walk(dest):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if not stat.S_ISLNK(os.lstat(p).st_mode):
                continue
            target = os.path.realpath(p)
            if os.path.commonpath([target, real_dest]) != real_dest:
                rel = os.path.relpath(p, dest)
                raise _refuse(path, f"member {rel!r}: symbolic link leaving the tree")
