"""The collective check's group leader (child process only; never imports torch).

Started by `xpuctl.probes.collective` in a new session, it reads the group's ranks from
stdin (JSON: `{"ranks": [{"slot": 0, "argv": [...], "env": {...}}, ...]}`), starts each
one in the leader's own process group (so that one killpg of that group ends every rank
and whatever a rank started), and reports on stdout, beside the ranks' own
events (`xpuctl.parse.collective`), when each rank started and how it exited, with the last
line of its stderr. It exits when every rank has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

MARKER = "XPUCTL-COLLECTIVE "  # xpuctl.parse.collective.MARKER
TAIL = 4096
_lock = threading.Lock()


def emit(ev: str, slot: int, **fields: Any) -> None:
    data = (MARKER + json.dumps({"ev": ev, "slot": slot, **fields}, ensure_ascii=True)[:3000]
            + "\n").encode("ascii")
    with _lock:
        while data:
            data = data[os.write(1, data):]


def _drain(proc: subprocess.Popen[bytes], tail: list[bytes]) -> None:
    assert proc.stderr is not None
    buf = b""
    stream = proc.stderr
    for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
        buf = (buf + chunk)[-TAIL:]
    tail.append(buf)


def _last_line(data: bytes) -> str:
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def main() -> None:
    spec = json.loads(sys.stdin.read())
    running: dict[int, tuple[int, subprocess.Popen[bytes], threading.Thread, list[bytes]]] = {}
    for r in spec["ranks"]:
        slot = int(r["slot"])
        try:
            proc = subprocess.Popen(r["argv"], env=r["env"], stdin=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, close_fds=True)
        except OSError as exc:
            emit("error", slot, phase="import", error=f"could not start: {exc}")
            emit("exit", slot, returncode=None, stderr="")
            continue
        emit("started", slot, pid=proc.pid)
        tail: list[bytes] = []
        reader = threading.Thread(target=_drain, args=(proc, tail), daemon=True)
        reader.start()
        running[proc.pid] = (slot, proc, reader, tail)
    while running:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in running:
            continue
        slot, proc, reader, tail = running.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        reader.join(0.5)  # a grandchild may keep the pipe open: its tail is then not waited for
        emit("exit", slot, returncode=proc.returncode, stderr=_last_line(tail[0] if tail else b""))


if __name__ == "__main__":
    main()
