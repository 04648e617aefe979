"""A FUSE file system whose one file never answers a read: `python fuse_stall.py MOUNTPOINT`.

It speaks the kernel's FUSE protocol on /dev/fuse itself (no libfuse needed; root and
/dev/fuse are). The mount has one file, `f` (4 KiB): lookups, attributes and opens answer,
a READ never does. A page of `f` mapped into a process and touched from elsewhere (a read of
/proc/PID/cmdline whose argv points into it) waits in the kernel until this process ends,
which aborts the connection and fails the read. Prints "ready" once mounted.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr (88 bytes)
LOOKUP, FORGET, GETATTR, OPEN, READ, RELEASE, INIT = 1, 2, 3, 14, 15, 18, 26
OPENDIR, RELEASEDIR, INTERRUPT, BATCH_FORGET, FLUSH = 27, 29, 36, 42, 25
ROOT, FILE = 1, 2
SIZE = 4096


def attr(node: int) -> bytes:
    mode = 0o40755 if node == ROOT else 0o100644
    size = 0 if node == ROOT else SIZE
    return ATTR.pack(node, size, 8, 0, 0, 0, 0, 0, 0, mode, 2 if node == ROOT else 1,
                     0, 0, 0, 4096, 0)


def reply(fd: int, unique: int, body: bytes = b"", error: int = 0) -> None:
    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body)


def mount(fd: int, where: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"stall", where.encode(), b"fuse.stall", 0, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), where)


def serve(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 1 << 20)
        except OSError as exc:
            if exc.errno == errno.ENODEV:  # unmounted
                return
            if exc.errno == errno.EINTR:
                continue
            raise
        _, op, unique, node, *_ = IN_HEADER.unpack_from(data)
        if os.environ.get("FUSE_STALL_DEBUG"):
            print("op", op, node, file=sys.stderr, flush=True)
        body = data[IN_HEADER.size:]
        if op == INIT:
            _major, _minor, _readahead, _flags = struct.unpack_from("<IIII", body)
            reply(fd, unique, struct.pack("<IIIIHHIIHHII", 7, 31, 0, 0, 16, 12, 4096, 1, 1, 0, 0, 0)
                  + bytes(24))
        elif op == LOOKUP:
            name = body.split(b"\0", 1)[0]
            if node == ROOT and name == b"f":
                reply(fd, unique, struct.pack("<QQQQII", FILE, 1, 3600, 3600, 0, 0) + attr(FILE))
            else:
                reply(fd, unique, error=errno.ENOENT)
        elif op == GETATTR:
            reply(fd, unique, struct.pack("<QII", 3600, 0, 0) + attr(node))
        elif op in (OPEN, OPENDIR):
            reply(fd, unique, struct.pack("<QIi", 1, 0, 0))
        elif op in (RELEASE, RELEASEDIR, FLUSH):
            reply(fd, unique)
        elif op in (FORGET, BATCH_FORGET, INTERRUPT, READ):
            continue  # no reply: FORGETs take none, and a READ is never answered
        else:
            reply(fd, unique, error=errno.ENOSYS)


def main() -> None:
    where = sys.argv[1]
    fd = os.open("/dev/fuse", os.O_RDWR)
    mount(fd, where)
    print("ready", flush=True)
    serve(fd)


if __name__ == "__main__":
    main()
