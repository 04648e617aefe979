"""TCP LISTEN sockets over netlink sock_diag: the parser on crafted kernel answers, and the
live query against /proc/net/tcp{,6} with sockets this test opens."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from xpuctl.host import sockdiag
from xpuctl.host.scan import listening_sockets
from xpuctl.host.seam import Host
from xpuctl.parse.net import TcpSocket, parse_tcp
from xpuctl.parse.sockdiag import (
    AF_INET,
    AF_INET6,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    SOCK_DIAG_BY_FAMILY,
    NetlinkError,
    listen_request,
    parse_listen_reply,
)


def diag_msg(family: int, state: int, port: int, addr: bytes, uid: int, inode: int) -> bytes:
    body = struct.pack("=BBBB", family, state, 0, 0) + port.to_bytes(2, "big") + b"\0\0"
    body += addr.ljust(16, b"\0") + bytes(16) + struct.pack("=I", 0) + bytes(8)
    body += struct.pack("=IIIII", 0, 0, 0, uid, inode)
    body += struct.pack("=HH", 8, 1) + bytes(4)  # an attribute the parser must skip
    return struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY, 2, 1, 0) + body


def done() -> bytes:
    return struct.pack("=IHHIIi", 20, NLMSG_DONE, 2, 1, 0, 0)


def test_parser_reads_listeners_of_both_families_and_stops_at_done():
    out: list[TcpSocket] = []
    v4 = diag_msg(AF_INET, 10, 8000, bytes([127, 0, 0, 1]), 1000, 4242)
    v6 = diag_msg(AF_INET6, 10, 29500, socket.inet_pton(socket.AF_INET6, "::1"), 0, 99)
    assert parse_listen_reply(v4 + v6, out) is False  # more to come
    assert parse_listen_reply(done(), out) is True
    assert out == [TcpSocket("127.0.0.1", 8000, "0A", 4242, 1000), TcpSocket("::1", 29500, "0A", 99, 0)]


def test_parser_skips_other_states_and_reports_errors():
    out: list[TcpSocket] = []
    established = diag_msg(AF_INET, 1, 8000, bytes(4), 0, 1)
    assert parse_listen_reply(established + done(), out) is True
    assert out == []
    error = struct.pack("=IHHIIi", 20, NLMSG_ERROR, 0, 1, 0, -22)
    with pytest.raises(NetlinkError, match="22"):
        parse_listen_reply(error, out)
    with pytest.raises(NetlinkError):
        parse_listen_reply(struct.pack("=IHHII", 400, SOCK_DIAG_BY_FAMILY, 0, 1, 0), out)


def test_request_asks_for_tcp_listen_only():
    req = listen_request(AF_INET6, 7)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", req)
    family, proto, _, _, states = struct.unpack_from("=BBBBI", req, 16)
    assert (length, kind, seq) == (len(req), SOCK_DIAG_BY_FAMILY, 7) and len(req) == 72
    assert flags == NLM_F_REQUEST | NLM_F_DUMP
    assert (family, proto, states) == (AF_INET6, 6, 1 << 10)


def _files() -> list[TcpSocket]:
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            out += parse_tcp(f.read())
    return out


def test_live_query_matches_proc_net_tcp():
    opened = []
    try:
        for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                s = socket.socket(family, socket.SOCK_STREAM)
                s.bind((addr, 0))
            except OSError:
                continue  # no IPv6 here
            s.listen()
            opened.append((s, addr, s.getsockname()[1], os.fstat(s.fileno()).st_ino))
        try:
            live = sockdiag.tcp_listeners()
        except OSError as e:
            pytest.skip(f"netlink sock_diag unavailable here: {e}")
        files = _files()
        for _, addr, port, inode in opened:
            want = TcpSocket(addr, port, "0A", inode, os.getuid())
            assert want in live and want in files
        mine = {o[3] for o in opened}
        assert {s for s in live if s.inode in mine} == {s for s in files if s.inode in mine}
    finally:
        for s, *_ in opened:
            s.close()


def test_falls_back_to_proc_net_tcp_without_netlink(monkeypatch):
    def unavailable():
        raise OSError("no sock_diag")

    monkeypatch.setattr(sockdiag, "tcp_listeners", unavailable)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.listen()
        inode = os.fstat(s.fileno()).st_ino
        assert inode in {x.inode for x in listening_sockets(Host("/"))}
    finally:
        s.close()
