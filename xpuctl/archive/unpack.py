"""Unpack a snapshot archive, or refuse it with one line (exit 2).

An archive comes from another host and may be hostile (links out of the tree, chains of
links past PATH_MAX, hard links that multiply the size cap, decompression bombs), so it is
read twice and never handed to tarfile's extraction (nor its `filter=`, which older Pythons
lack and which a PATH_MAX chain of links passes):

1. every header is judged by `members.Members` (only regular files and directories, safe
   names, sizes, count, no name taken twice) before anything is written;
2. the archive is read again and each member, still the one judged, is written by this
   module: directories made with `mkdir(dir_fd=)`, files created with
   `O_CREAT|O_EXCL|O_NOFOLLOW` relative to their directory's fd, so nothing can be written
   outside the destination even if something raced.

What is read is bounded too: the archive file (`stream_cap()` bytes at most), the stream
once decompressed (the same bound: the declared sizes plus room for headers), and each
extended header (`members.MAX_HEADER_BYTES`), which tarfile would read whole into memory.

Unpacked files are owner-only (0600, directories 0700) and the caller's own: nothing of
the archive's modes, owners or times survives.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import stat
import tarfile
import zlib
from typing import IO, Any, cast

from xpuctl.archive import members
from xpuctl.archive.members import Members, Refused
from xpuctl.errors import UsageError
from xpuctl.output.safetext import safe

#: room for each member's header blocks, padding and a small pax header
MEMBER_OVERHEAD = 4 << 10
_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
             tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeArchive(UsageError):
    """The archive breaks a rule of members.py, or a bound here (exit 2)."""


def stream_cap() -> int:
    """Bytes read at most, from the file and from the stream once decompressed."""
    return members.MAX_TOTAL_BYTES + members.MAX_MEMBERS * MEMBER_OVERHEAD + (20 << 10)


_Stream = io.BufferedIOBase | io.RawIOBase  # what the archive is read through


class _Capped(io.RawIOBase):
    """A reader that refuses to give more than `cap` bytes in all."""

    def __init__(self, inner: _Stream, cap: int, what: str) -> None:
        super().__init__()
        self.inner = inner
        self.left = cap
        self.cap = cap
        self.what = what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.inner.read(min(len(view), self.left + 1))
        self.left -= len(data)
        if self.left < 0:
            raise Refused(None, f"{self.what} over {self.cap} bytes")
        view[: len(data)] = data
        return len(data)


class _Header(tarfile.TarInfo):
    """tarfile's header, refusing an extended header too large to hold in memory."""

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> _Header:
        info = super().frombuf(buf, encoding, errors)
        if info.type in _EXTENDED and info.size > members.MAX_HEADER_BYTES:
            raise Refused(None, f"extended header of {info.size} bytes "
                                f"(at most {members.MAX_HEADER_BYTES})")
        return info


def _decompressing(raw: _Capped, head: bytes) -> _Stream:
    """The archive's tar stream: gzip, bzip2, xz or plain, by its first bytes."""
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(raw)
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(cast(IO[bytes], raw))  # typeshed: a raw stream reads too
    return raw


def _open_file(path: str) -> int:
    """A read fd on the archive: a regular file of at most stream_cap() bytes."""
    try:
        # O_NONBLOCK: a FIFO named as the archive must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UsageError(f"snapshot {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"snapshot {path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    why = None
    if stat.S_ISDIR(st.st_mode):
        why = "is a directory"
    elif not stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    elif st.st_size > stream_cap():
        why = f"over {stream_cap()} bytes"
    if why is not None:
        os.close(fd)
        raise UsageError(f"snapshot {path}: {why}")
    return fd


def _tar(fd: int) -> tarfile.TarFile:
    """The archive's members as a stream, read from the start of `fd` through both caps."""
    os.lseek(fd, 0, os.SEEK_SET)
    head = os.pread(fd, 6, 0)
    raw = _Capped(open(fd, "rb", closefd=False), stream_cap(), "archive")  # noqa: SIM115
    stream = _Capped(_decompressing(raw, head), stream_cap(), "archive once decompressed")
    return tarfile.open(fileobj=stream, mode="r|", tarinfo=_Header)


def _judge(fd: int) -> Members:
    """Pass 1: every header, judged; nothing written."""
    seen = Members()
    with _tar(fd) as tf:
        while (m := tf.next()) is not None:
            seen.add(m)
            # tarfile keeps every header it read (not in typeshed); the layout is enough
            tf.members.clear()  # type: ignore[attr-defined]
    return seen


class _WriteFailed(Exception):
    """Writing under the destination failed (a full disk, a quota): not the archive's fault."""


class _Writer:
    """Writes members under `dest` through directory fds only (see the module doc). Its
    own failures are _WriteFailed."""

    def __init__(self, dest: str) -> None:
        self.root = os.open(dest, _DIR_FLAGS)
        self._last: tuple[str, int] | None = None  # the last directory used, and its fd

    def close(self) -> None:
        if self._last is not None:
            os.close(self._last[1])
            self._last = None
        os.close(self.root)

    def directory(self, parts: list[str]) -> int:
        """The fd of the directory `parts` (made as needed); owned by the writer."""
        key = "/".join(parts)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        cur = self.root
        try:
            for part in parts:
                try:
                    os.mkdir(part, 0o700, dir_fd=cur)
                except FileExistsError:
                    pass
                nxt = os.open(part, _DIR_FLAGS, dir_fd=cur)
                if cur != self.root:
                    os.close(cur)
                cur = nxt
        except OSError as exc:
            if cur != self.root:
                os.close(cur)
            raise _WriteFailed(exc) from None
        if self._last is not None:
            os.close(self._last[1])
        self._last = (key, cur)
        return cur

    def file(self, name: str, size: int, data: IO[bytes]) -> None:
        parts = name.split("/")
        parent = self.directory(parts[:-1])
        try:
            fd = os.open(parts[-1], _FILE_FLAGS, 0o600, dir_fd=parent)
        except OSError as exc:
            raise _WriteFailed(exc) from None
        try:
            left = size
            while left > 0:
                chunk = data.read(min(left, _CHUNK))  # the archive's errors pass through
                if not chunk:
                    raise tarfile.ReadError(f"unexpected end of data in {name}")
                try:
                    os.write(fd, chunk)  # a regular file: every byte is written
                except OSError as exc:
                    raise _WriteFailed(exc) from None
                left -= len(chunk)
        finally:
            os.close(fd)


def _write(fd: int, dest: str, seen: Members) -> None:
    """Pass 2: each member, still the one judged in pass 1, written under `dest`."""
    writer = _Writer(dest)
    try:
        with _tar(fd) as tf:
            for name, is_dir, size in seen.layout:
                m = tf.next()
                if m is None or (m.name, m.isdir(), m.size) != (name, is_dir, size):
                    raise Refused(None, "the archive changed while it was read")
                tf.members.clear()  # type: ignore[attr-defined]
                if is_dir:
                    writer.directory(name.split("/"))
                    continue
                data = tf.extractfile(m)
                if data is None:  # pass 1 let only regular files and directories through
                    raise Refused(name, "not a regular file")
                writer.file(name, size, data)
    finally:
        writer.close()


def unpack(path: str, dest: str) -> str:
    """Check and unpack the archive at `path` into the empty directory `dest`; return the
    top directory's path. UnsafeArchive or UsageError (exit 2) when it cannot be used."""
    fd = _open_file(path)
    try:
        seen = _judge(fd)
        if seen.top is None:
            raise UsageError(f"snapshot {path}: empty archive")
        _write(fd, dest, seen)
    except _WriteFailed as exc:
        raise UsageError(f"snapshot {path}: cannot unpack into {dest}: {_line(exc)}") from None
    except Refused as exc:
        where = f"member '{safe(exc.member, 200)}': " if exc.member is not None else ""
        raise UnsafeArchive(f"refusing unsafe snapshot {path}: {where}{exc.why}") from None
    except RecursionError:  # tarfile reads a chain of extended headers recursively
        raise UsageError(f"snapshot {path}: damaged archive (a chain of extended headers)") \
            from None
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
        raise UsageError(f"snapshot {path}: damaged archive ({_line(exc)})") from None
    finally:
        os.close(fd)
    return os.path.join(dest, seen.top)


def _line(exc: BaseException) -> str:
    """An exception's text on one line (tarfile's can span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__
