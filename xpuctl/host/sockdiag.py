"""TCP LISTEN sockets, and unix sockets bound to files, of this network namespace, asked of
the kernel over netlink (sock_diag), as `ss -ltn` and `ss -xp` do.

/proc/net/tcp and tcp6 walk the whole established-connection hash, whose size follows the
host's memory (262144 buckets on a 24 GiB machine: 3.3 ms per file; many times that on a
GPU host with a terabyte), to print a few LISTEN lines. A LISTEN-only dump walks only the
listening hash. Callers fall back to the files on any OSError (no inet_diag in the kernel,
netlink denied by seccomp).
"""

from __future__ import annotations

import _socket  # the C layer of `socket`, whose Python layer costs ~2 ms of enums per start
import os
from typing import TYPE_CHECKING

from xpuctl.parse.net import TcpSocket, parse_tcp
from xpuctl.parse.sockdiag import (
    AF_INET,
    AF_INET6,
    NETLINK_SOCK_DIAG,
    NetlinkError,
    UnixBound,
    listen_request,
    parse_listen_reply,
    parse_unix_reply,
    unix_request,
)

if TYPE_CHECKING:
    from xpuctl.host.seam import Host

TIMEOUT_S = 0.5  # the kernel answers a LISTEN dump in well under a millisecond


def listening_sockets(host: Host) -> list[TcpSocket]:
    """TCP LISTEN sockets: from the kernel over netlink when the scanned /proc is ours (same
    network namespace as /proc/net), else (a fake tree, or no sock_diag) from
    /proc/net/tcp and tcp6."""
    if host.proc_is_live:
        try:
            return tcp_listeners()
        except OSError:
            pass
    out: list[TcpSocket] = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            out.extend(parse_tcp(host.read_text(name)))
        except OSError:
            continue
    return out


def tcp_listeners() -> list[TcpSocket]:
    """Every TCP socket in LISTEN state, IPv4 then IPv6. Raises OSError when the kernel
    cannot answer."""
    sock = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC,
                          NETLINK_SOCK_DIAG)
    try:
        sock.settimeout(TIMEOUT_S)
        out: list[TcpSocket] = []
        for seq, family in enumerate((AF_INET, AF_INET6), 1):
            sock.sendto(listen_request(family, seq), (0, 0))
            try:
                while not parse_listen_reply(sock.recv(1 << 16), out):
                    pass
            except NetlinkError as e:
                raise OSError(str(e)) from e
        return out
    finally:
        sock.close()


def unix_bound() -> dict[tuple[int, int], list[int]]:
    """(st_dev, st_ino) of every file a unix socket of this network namespace is bound to ->
    the inodes of the sockets bound to it (a listener and the connections it accepted).
    Matched with lstat's st_dev and st_ino, whatever text the socket was bound by
    (`/tmp//x`, a relative path): the inode, not the text. Raises OSError when the kernel
    cannot answer (no unix_diag)."""
    sock = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC,
                          NETLINK_SOCK_DIAG)
    try:
        sock.settimeout(TIMEOUT_S)
        sock.sendto(unix_request(1), (0, 0))
        found: list[UnixBound] = []
        try:
            while not parse_unix_reply(sock.recv(1 << 16), found):
                pass
        except NetlinkError as e:
            raise OSError(str(e)) from e
    finally:
        sock.close()
    out: dict[tuple[int, int], list[int]] = {}
    for b in found:
        out.setdefault((os.makedev(b.major, b.minor), b.file_inode), []).append(b.inode)
    return out
