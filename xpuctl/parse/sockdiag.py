"""Netlink sock_diag for TCP LISTEN sockets and for unix sockets bound to a file: the
requests, and the parsers of the kernel's answers (bytes in, records out). Layouts from
linux/netlink.h, linux/inet_diag.h and linux/unix_diag.h; all fields are host byte order
except TCP ports and addresses.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterator
from typing import NamedTuple

from xpuctl.parse.net import TCP_LISTEN, TcpSocket

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
IPPROTO_TCP = 6
_TCP_STATE_LISTEN = 10

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states; then a zeroed inet_diag_sockid (48)
_REQ = struct.Struct("=BBBBI48x")
# inet_diag_msg: family, state, timer, retrans; sockid (sport, dport, src, dst, if,
# cookie); expires, rqueue, wqueue, uid, inode
_MSG = struct.Struct("=BBBB2s2s16s16sI8sIIIII")


# unix_diag_req: family, protocol, pad, states, ino, show, cookie (2 x u32)
_UNIX_REQ = struct.Struct("=BBHIII8x")
# unix_diag_msg: family, type, state, pad, ino, cookie (2 x u32); then attributes
_UNIX_MSG = struct.Struct("=BBBBI8x")
_NLATTR = struct.Struct("=HH")
_UDIAG_SHOW_VFS = 0x2
_UNIX_DIAG_VFS = 1
_UNIX_VFS = struct.Struct("=II")  # unix_diag_vfs: udiag_vfs_ino, udiag_vfs_dev


class UnixBound(NamedTuple):
    """A unix socket bound to a file: the socket's own inode (the `socket:[N]` of an fd that
    holds it), and the device and inode of the file it is bound to (UNIX_DIAG_VFS: the
    kernel's s_dev, major in the top 12 bits, minor in the low 20)."""

    inode: int
    major: int
    minor: int
    file_inode: int


class NetlinkError(Exception):
    """The kernel answered with an error (errno), or with something we cannot parse."""


def listen_request(family: int, seq: int) -> bytes:
    """A dump request for the TCP sockets of `family` in LISTEN state. The kernel then walks
    only its listening hash, not the established one that /proc/net/tcp walks."""
    body = _REQ.pack(family, IPPROTO_TCP, 0, 0, 1 << _TCP_STATE_LISTEN)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY,
                          NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def _messages(data: bytes) -> Iterator[tuple[int, int] | None]:
    """The SOCK_DIAG_BY_FAMILY messages of one datagram, as (where the body starts, where the
    message ends); None once NLMSG_DONE is met (nothing follows it). Raises NetlinkError for
    an error message or a malformed one; other message types are skipped."""
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            raise NetlinkError(f"bad netlink message length {length}")
        body = off + _NLMSGHDR.size
        if kind == NLMSG_DONE:
            yield None
            return
        if kind == NLMSG_ERROR:
            errno = -struct.unpack_from("=i", data, body)[0] if length >= _NLMSGHDR.size + 4 else 0
            raise NetlinkError(f"sock_diag error {errno}")
        if kind == SOCK_DIAG_BY_FAMILY:
            yield body, off + length
        off += (length + 3) & ~3  # NLMSG_ALIGN


def parse_listen_reply(data: bytes, out: list[TcpSocket]) -> bool:
    """Append the sockets in one datagram of the answer to `out`; True once the dump is done.
    Raises NetlinkError for an error message or a malformed one."""
    for msg in _messages(data):
        if msg is None:
            return True
        body, end = msg
        if end - body < _MSG.size:
            raise NetlinkError("short inet_diag_msg")
        family, state, _, _, sport, _, src, _, _, _, _, _, _, uid, inode = _MSG.unpack_from(data, body)
        if state == _TCP_STATE_LISTEN:
            if family == AF_INET:
                address = str(ipaddress.IPv4Address(src[:4]))
            elif family == AF_INET6:
                address = str(ipaddress.IPv6Address(src))
            else:
                raise NetlinkError(f"unexpected family {family}")
            out.append(TcpSocket(address, int.from_bytes(sport, "big"), TCP_LISTEN, inode, uid))
    return False


def unix_request(seq: int) -> bytes:
    """A dump request for every unix socket in every state, with the file each one is bound
    to (UDIAG_SHOW_VFS): the sockets of the network namespace the netlink socket was made
    in, whatever path text they were bound by."""
    body = _UNIX_REQ.pack(AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _UDIAG_SHOW_VFS)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY,
                          NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def parse_unix_reply(data: bytes, out: list[UnixBound]) -> bool:
    """Append the sockets bound to a file in one datagram of the answer to `out` (an unbound
    or abstract socket has no UNIX_DIAG_VFS attribute); True once the dump is done. Raises
    NetlinkError for an error message or a malformed one."""
    for msg in _messages(data):
        if msg is None:
            return True
        body, end = msg
        if end - body < _UNIX_MSG.size:
            raise NetlinkError("short unix_diag_msg")
        inode = _UNIX_MSG.unpack_from(data, body)[4]
        at = body + _UNIX_MSG.size
        while at + _NLATTR.size <= end:
            alen, atype = _NLATTR.unpack_from(data, at)
            if alen < _NLATTR.size or at + alen > end:
                raise NetlinkError(f"bad netlink attribute length {alen}")
            if atype & 0x3FFF == _UNIX_DIAG_VFS and alen >= _NLATTR.size + _UNIX_VFS.size:
                file_inode, dev = _UNIX_VFS.unpack_from(data, at + _NLATTR.size)
                out.append(UnixBound(inode, dev >> 20, dev & 0xFFFFF, file_inode))
            at += (alen + 3) & ~3  # NLA_ALIGN
    return False
