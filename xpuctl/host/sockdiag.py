"""TCP LISTEN sockets of this network namespace, asked of the kernel over netlink
(sock_diag), as `ss -ltn` does.

/proc/net/tcp and tcp6 walk the whole established-connection hash, whose size follows the
host's memory (262144 buckets on a 24 GiB machine: 3.3 ms per file; many times that on a
GPU host with a terabyte), to print a few LISTEN lines. A LISTEN-only dump walks only the
listening hash. Callers fall back to the files on any OSError (no inet_diag in the kernel,
netlink denied by seccomp).
"""

from __future__ import annotations

import _socket  # the C layer of `socket`, whose Python layer costs ~2 ms of enums per start

from xpuctl.parse.net import TcpSocket
from xpuctl.parse.sockdiag import (
    AF_INET,
    AF_INET6,
    NETLINK_SOCK_DIAG,
    NetlinkError,
    listen_request,
    parse_listen_reply,
)

TIMEOUT_S = 0.5  # the kernel answers a LISTEN dump in well under a millisecond


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
