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
                    uid=int(parts[7]) if parts[7].isdigit() else None,
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
