"""A stand-in for systemd's end of the notify protocol, and a parent that reaps a detached
supervisor, for the tests of serve's watch. Importable without pytest.

`Listener` binds an AF_UNIX datagram socket (a path, or an abstract address given to xpuctl
as `@name`, the spelling of sd_notify(3)) and keeps every datagram with the monotonic time it
arrived, parsed into its `KEY=VALUE` assignments (the notify protocol's format).

`DetachedServe` runs `serve --detach` as the child of a small subreaper process, so that the
supervisor `serve` leaves behind is reparented to it and its exit status can be read (PID 1
here does not reap)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Message:
    t: float  # time.monotonic() when it arrived
    fields: tuple[tuple[str, str], ...]
    raw: str

    def get(self, key: str) -> str | None:
        return next((v for k, v in self.fields if k == key), None)

    def has(self, key: str) -> bool:
        return any(k == key for k, _ in self.fields)


class Listener:
    """A notify socket the test owns. `address` is what NOTIFY_SOCKET is set to."""

    def __init__(self, directory: str | os.PathLike[str], abstract: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"xpuctl-test-notify-{os.getpid()}-{time.monotonic_ns()}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            path = os.path.join(directory, "notify.sock")
            self.sock.bind(path)
            self.address = path
        self.messages: list[Message] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:  # shut down by close(): a datagram is never empty here
                return
            t = time.monotonic()
            text = data.decode("utf-8", "replace")
            fields = tuple(tuple(line.split("=", 1)) for line in text.split("\n") if "=" in line)
            with self._lock:
                self.messages.append(Message(t, fields, text))  # type: ignore[arg-type]

    def env(self, watchdog_usec: int | None = 2_000_000) -> dict[str, str]:
        env = {"NOTIFY_SOCKET": self.address}
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    def all(self) -> list[Message]:
        with self._lock:
            return list(self.messages)

    def with_key(self, key: str) -> list[Message]:
        return [m for m in self.all() if m.has(key)]

    def first(self, key: str, value: str | None = None) -> Message | None:
        for m in self.all():
            if m.has(key) and (value is None or m.get(key) == value):
                return m
        return None

    def statuses(self) -> list[str]:
        return [m.get("STATUS") or "" for m in self.all() if m.has("STATUS")]

    def pings(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [m.t for m in self.all() if m.get("WATCHDOG") == "1" and since <= m.t <= until]

    def close(self) -> None:
        """Stop the reader thread and close the socket: a thread left blocked in recv() would
        outlive the test, and the in-process commands of every later test would then run
        with a second thread (their bounded reader spawned, not forked: tests/README.md)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked recv() with b""
        except OSError:
            pass
        self._thread.join(5)
        self.sock.close()


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


_REAPER = r"""
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
cmd = json.loads(sys.argv[1])
serve = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=open(sys.argv[2], "wb"))
print(json.dumps({"serve": serve.returncode}), flush=True)
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    print(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class DetachedServe:
    """`serve --detach` (the command line `cmd`) under a subreaper: `serve_code()` is what
    `serve --detach` returned, `supervisor_code(pid)` what the supervisor exited with."""

    def __init__(self, cmd: list[str], env: Mapping[str, str], cwd: str | os.PathLike[str],
                 err_path: Path) -> None:
        self.err_path = err_path
        self.proc = subprocess.Popen([sys.executable, "-c", _REAPER, json.dumps(cmd), str(err_path)],
                                     env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL, cwd=cwd,
                                     start_new_session=True)
        self.lines: list[dict[str, int]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                pass

    def serve_code(self) -> int | None:
        return next((d["serve"] for d in self.lines if "serve" in d), None)

    def supervisor_code(self, pid: int) -> int | None:
        return next((d["code"] for d in self.lines if d.get("pid") == pid), None)

    def err(self) -> str:
        return self.err_path.read_text(errors="replace") if self.err_path.exists() else ""

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)
