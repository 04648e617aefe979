"""systemd's notify protocol, written out: one datagram per message to `$NOTIFY_SOCKET`.

The protocol (systemd's sd_notify(3) and its "Notify protocol" documentation): the service
manager passes `NOTIFY_SOCKET`, the address of an AF_UNIX datagram socket: a file system path,
or an abstract address when it starts with `@` (the `@` stands for a leading NUL byte). A
message is newline-separated `KEY=VALUE` assignments in one datagram: `READY=1` (start-up is
done: for `Type=notify`), `STATUS=...` (a line `systemctl status` shows), `WATCHDOG=1` (a
keep-alive, within `WatchdogSec=`; the manager passes `WATCHDOG_USEC`, and `WATCHDOG_PID` names
the process expected to send it), `STOPPING=1`, `EXTEND_TIMEOUT_USEC=N` (the start, runtime or
stop timeout may run N more microseconds from now) and `MAINPID=N` (the service's main
process is now N).

Nothing here ever fails its caller: without `NOTIFY_SOCKET` every call does nothing, and a
socket that is gone (the manager restarted, a test stopped listening) loses the message.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

#: the variables of the protocol: never passed on to vLLM (sd_notify's unset_environment)
VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def address(value: str) -> str | bytes | None:
    """The socket address `$NOTIFY_SOCKET` names: a path, or an abstract address (`@` ->
    a leading NUL byte); None when it names neither."""
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode("utf-8", "surrogateescape")
    if value.startswith("/"):
        return value
    return None  # systemd also takes vsock:CID:PORT; xpuctl does not


def watchdog_seconds(environ: Mapping[str, str], pid: int) -> float | None:
    """The watchdog timeout in seconds when the manager asks *this* process for keep-alives:
    `WATCHDOG_USEC` is a positive number and `WATCHDOG_PID`, when set, is `pid`."""
    owner = environ.get("WATCHDOG_PID", "").strip()
    if owner and owner != str(pid):
        return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", "").strip())
    except ValueError:
        return None
    return usec / 1e6 if usec > 0 else None


class Notifier:
    """Messages to the service manager; inert without `NOTIFY_SOCKET`."""

    def __init__(self, environ: Mapping[str, str], pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.address = address(environ.get("NOTIFY_SOCKET", ""))
        self.watchdog = watchdog_seconds(environ, self.pid) if self.address is not None else None
        self.sock: socket.socket | None = None
        self.sent = 0
        self.lost = 0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """One datagram of `KEY=VALUE` lines; False when it could not be sent (or nothing is
        listening for it). A newline inside a value would start a new assignment: it becomes
        a space."""
        if self.address is None or not assignments:
            return False
        msg = "\n".join(a.replace("\n", " ") for a in assignments).encode("utf-8", "surrogateescape")
        try:
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self.sock.sendto(msg, self.address)
        except OSError:
            self.lost += 1
            return False
        self.sent += 1
        return True

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def ready(self, text: str) -> bool:
        return self.send("READY=1", f"STATUS={text}")

    def ping(self) -> bool:
        """One watchdog keep-alive (only when the manager asked this process for them)."""
        return self.watchdog is not None and self.send("WATCHDOG=1")

    def stopping(self, text: str, seconds: float | None = None) -> bool:
        extra = [f"EXTEND_TIMEOUT_USEC={usec(seconds)}"] if seconds is not None else []
        return self.send("STOPPING=1", f"STATUS={text}", *extra)

    def extend(self, seconds: float) -> bool:
        return self.send(f"EXTEND_TIMEOUT_USEC={usec(seconds)}")

    def main_pid(self, pid: int) -> bool:
        return self.send(f"MAINPID={pid}")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def usec(seconds: float) -> int:
    return max(1, round(seconds * 1_000_000))
