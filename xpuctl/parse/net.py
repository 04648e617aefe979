"""Parsers for /proc/net/{tcp,tcp6,unix}."""

from __future__ import annotations

import ipaddress
import struct
from typing import NamedTuple

TCP_LISTEN = "0A"


class TcpSocket(NamedTuple):
    address: str
    port: int
    state: str
    inode: int
    uid: int | None


def _hex_addr(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(struct.pack("<I", struct.unpack(">I", raw)[0])))
    if len(raw) == 16:
        # four little-endian 32-bit words
        words = struct.unpack("<4I", raw)
        return str(ipaddress.IPv6Address(struct.pack(">4I", *words)))
    raise ValueError(text)


def parse_tcp(text: str, listen_only: bool = True) -> list[TcpSocket]:
    out: list[TcpSocket] = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        state = parts[3].upper()
        if listen_only and state != TCP_LISTEN:
            continue
        local, _, port = parts[1].partition(":")
        try:
            out.append(
                TcpSocket(
                    address=_hex_addr(local),
                    port=int(port, 16),
                    state=state,
                    inode=int(parts[9]),
                    uid=int(parts[7]) if parts[7].isascii() and parts[7].isdigit() else None,
                )
            )
        except ValueError:
            continue
    return out


def parse_unix_paths(text: str) -> dict[str, int]:
    """Bound unix socket paths (not abstract ones) -> inode, from /proc/net/unix."""
    out: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        parts = line.split(None, 7)
        if len(parts) < 8 or not parts[7].startswith("/"):
            continue
        try:
            out[parts[7]] = int(parts[6])
        except ValueError:
            continue
    return out


# -- the inverse: text a snapshot writes, which the parsers above read back exactly ---------

TCP_HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
    "   uid  timeout inode"
)
UNIX_HEADER = "Num       RefCount Protocol Flags    Type St Inode Path"


def _addr_hex(address: str) -> str:
    ip = ipaddress.ip_address(address)
    if ip.version == 4:
        return struct.pack(">I", struct.unpack("<I", ip.packed)[0]).hex().upper()
    return struct.pack("<4I", *struct.unpack(">4I", ip.packed)).hex().upper()


def is_v6(sock: TcpSocket) -> bool:
    return ":" in sock.address


def format_tcp(sockets: list[TcpSocket]) -> str:
    """/proc/net/tcp (or tcp6) text for these sockets, in the kernel's column layout."""
    lines = [TCP_HEADER]
    for sl, s in enumerate(sockets):
        uid = "-" if s.uid is None else str(s.uid)
        lines.append(
            f"{sl:4d}: {_addr_hex(s.address)}:{s.port:04X} {_addr_hex('::' if is_v6(s) else '0.0.0.0')}"
            f":0000 {s.state} 00000000:00000000 00:00000000 00000000 {uid:>5} {0:8d} {s.inode} 1"
        )
    return "".join(line + "\n" for line in lines)


def format_unix(paths: dict[str, int]) -> str:
    """/proc/net/unix text naming these bound paths (path -> inode)."""
    lines = [UNIX_HEADER]
    for path, inode in paths.items():
        lines.append(f"0000000000000000: 00000002 00000000 00010000 0001 01 {inode:5d} {path}")
    return "".join(line + "\n" for line in lines)
