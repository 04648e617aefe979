"""TCP LISTEN sockets over netlink sock_diag: the parser on crafted kernel answers, and the
live query against /proc/net/tcp{,6} with sockets this test opens."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from xpuctl.host import sockdiag
from xpuctl.host.seam import Host
from xpuctl.host.sockdiag import listening_sockets
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
    UnixBound,
    listen_request,
    parse_listen_reply,
    parse_unix_reply,
    unix_request,
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


# --- unix sockets bound to files (UNIX_DIAG_VFS) -------------------------------------------------


def unix_msg(sock_inode: int, vfs: tuple[int, int] | None, type_: int = 1,
             state: int = 10) -> bytes:
    """A unix_diag_msg (linux/unix_diag.h: family, type, state, pad, ino, cookie[2]) with a
    UNIX_DIAG_NAME attribute the parser skips and, when bound, UNIX_DIAG_VFS (ino, dev)."""
    body = struct.pack("=BBBBI8x", socket.AF_UNIX, type_, state, 0, sock_inode)
    name = b"/tmp//x\0"
    body += struct.pack("=HH", 4 + len(name), 0) + name + bytes(-len(name) % 4)
    if vfs is not None:
        body += struct.pack("=HHII", 12, 1, *vfs)
    return struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY, 2, 1, 0) + body


def test_unix_parser_reads_the_file_each_socket_is_bound_to():
    out: list[UnixBound] = []
    # the kernel's s_dev keeps the major in the top 12 bits: 254:0 is 254 << 20
    listener = unix_msg(4242, (2146681, 254 << 20))
    accepted = unix_msg(4243, (2146681, 254 << 20), state=1)  # carries its listener's file
    unbound = unix_msg(4244, None)
    tmpfs = unix_msg(4245, (7, 0x23))  # 0:35, a tmpfs
    assert parse_unix_reply(listener + accepted + unbound + tmpfs, out) is False
    assert parse_unix_reply(done(), out) is True
    assert out == [UnixBound(4242, 254, 0, 2146681), UnixBound(4243, 254, 0, 2146681),
                   UnixBound(4245, 0, 0x23, 7)]
    with pytest.raises(NetlinkError):
        parse_unix_reply(listener[:-6], out)  # a message cut inside its attribute


def test_unix_request_asks_for_every_state_with_the_bound_file():
    req = unix_request(3)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", req)
    family, proto, _, states, ino, show = struct.unpack_from("=BBHIII", req, 16)
    assert (length, kind, seq) == (len(req), SOCK_DIAG_BY_FAMILY, 3)
    assert flags == NLM_F_REQUEST | NLM_F_DUMP
    assert (family, proto, states, ino, show) == (socket.AF_UNIX, 0, 0xFFFFFFFF, 0, 2)


def test_live_unix_query_finds_a_socket_by_its_file_whatever_text_bound_it(tmp_path):
    """Bound as `dir//name` and by a relative name: /proc/net/unix keeps those texts, the
    kernel's UNIX_DIAG_VFS gives the file's device and inode, as lstat does."""
    opened = []
    here = os.getcwd()
    try:
        a = socket.socket(socket.AF_UNIX)
        a.bind(f"{tmp_path}//double")
        os.chdir(tmp_path)
        b = socket.socket(socket.AF_UNIX)
        b.bind("relative")
        opened = [a, b]
        try:
            bound = sockdiag.unix_bound()
        except OSError as e:
            pytest.skip(f"netlink sock_diag (unix_diag) unavailable here: {e}")
        for s, name in ((a, "double"), (b, "relative")):
            st = os.lstat(tmp_path / name)
            assert bound[(st.st_dev, st.st_ino)] == [os.fstat(s.fileno()).st_ino]
    finally:
        os.chdir(here)
        for s in opened:
            s.close()
