"""The state directory's most recent run, for the relaunch advice (doctor's `last-run`), and
whether the last run on some devices ended uncleanly (serve's automatic collective check).

Cheap on purpose, since doctor runs before every launch: one listing of `runs/`, one record
read (the newest by modification time: records are rewritten on every state change), and
the last `TAIL_BYTES` of that run's log. The log is found by the run's name under the state
directory's own `logs/`, never through a path written in the record.

An unclean end stays recorded until a check proves the devices clean: a later shutdown of
what the run left keeps it (`unclean_end`, the shutdown marks such a run "failed"), and only
a collective check that passed on them or a reset that left them clean, after the run ended,
clears it (`note_clean`, kept in `PROOFS` under the state directory).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

from xpuctl.core.model import LastRun
from xpuctl.parse.vllmlog import furthest_phase, hang_signatures, log_lines
from xpuctl.state import atomic
from xpuctl.state.regular import open_regular, read_regular
from xpuctl.state.runs import ACTIVE_STATES, RunRecord, ensure_state_dir, read_record

TAIL_BYTES = 64 * 1024
NOT_READY_NOTE = "not ready after "  # serve's note on a readiness timeout (serve._not_ready)
#: {"devices": {BDF or "*": {"at": epoch seconds, "by": "collective check" | "reset"}}}: when
#: each device was last proved clean ("*": every device, a reset of them all)
PROOFS = "proved-clean.json"
EVERY_DEVICE = "*"


def newest_record(state_dir: str) -> RunRecord | None:
    best: tuple[float, str] | None = None
    try:
        with os.scandir(os.path.join(state_dir, "runs")) as it:
            for entry in it:
                if not entry.name.endswith(".json") or entry.name.startswith("."):
                    continue
                try:
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
                if best is None or mtime > best[0]:
                    best = (mtime, entry.name[: -len(".json")])
    except OSError:
        return None
    return read_record(state_dir, best[1]) if best else None


def log_tail(path: str, limit: int = TAIL_BYTES) -> list[str]:
    """vLLM's lines among the last `limit` bytes of a run log (xpuctl's own lines dropped)."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:  # a FIFO there must not block doctor
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - limit))
            data = fh.read(limit)
    except OSError:
        return []
    lines = log_lines(data)  # at newlines only: a progress bar's CRs stay inside its line
    if size > limit and lines:
        lines = lines[1:]  # cut mid-line
    return [ln for ln in lines if not ln.startswith("xpuctl:")]


def last_run(state_dir: str | None) -> LastRun | None:
    """None when there is no state directory, no run, or the directory is unsafe to trust."""
    if not state_dir or not os.path.isdir(state_dir):
        return None
    try:
        state_dir = ensure_state_dir(state_dir, create=False)
    except Exception:
        return None
    rec = newest_record(state_dir)
    if rec is None:
        return None
    log_path = os.path.join(state_dir, "logs", f"{rec.name}.log")
    lines = log_tail(log_path)
    not_ready = any(n.startswith(NOT_READY_NOTE) for n in rec.notes)
    # A start in progress is not stuck (yet): only errors in its log count. A record written
    # before `ready_at` existed has none; its log then decides (a start that became ready
    # logged past `backend=xccl`).
    ever_ready = rec.state in ACTIVE_STATES or rec.ready_at is not None
    return LastRun(
        name=rec.name,
        state=rec.state,
        log_path=log_path,
        not_ready=not_ready,
        phase=furthest_phase(lines).label,
        signatures=tuple(hang_signatures(lines, ever_ready)),
        ended_at=rec.stopped_at,
        devices=tuple(str(d) for d in rec.devices or ()),
    )


def unclean_end(rec: RunRecord, top_alive: bool | None = None) -> str | None:
    """Why the run did not end cleanly, from its record; None when it did, or has not ended.
    It failed (killed, exited by itself with an error, left leftovers; a shutdown of what an
    unclean end left marks it so), was never ready in time, or is recorded as running while its
    supervisor is gone, unless its API server is known to be alive (`top_alive`: then its own
    stop decides)."""
    if any(n.startswith(NOT_READY_NOTE) for n in rec.notes):
        return "was not ready in time"
    if rec.state == "failed":
        code = f" (exit {rec.exit_code})" if rec.exit_code is not None else ""
        return f"failed{code}: killed, an error, or leftovers"
    if (rec.state in ACTIVE_STATES and rec.supervisor_pid and not top_alive
            and not _alive(rec.supervisor_pid)):
        return f"is recorded as {rec.state} but its supervisor {rec.supervisor_pid} is gone"
    return None


def unclean_run_on(state_dir: str | None, bdfs: list[str] | tuple[str, ...]) -> tuple[str, str] | None:
    """(run name, why) when the newest run recorded on any of `bdfs` did not end cleanly
    (`unclean_end`) and no collective check or reset proved those devices clean since it
    ended. None when it ended cleanly, was proved clean since, or there is none (serve's
    automatic collective check)."""
    if not state_dir or not os.path.isdir(state_dir):
        return None
    from xpuctl.state.runs import list_records

    wanted = set(bdfs)
    mine = [r for r in list_records(state_dir) if not wanted or wanted & set(r.devices)]
    if not mine:
        return None
    rec = max(mine, key=lambda r: r.stopped_at or r.ready_at or r.started_at or 0.0)
    why = unclean_end(rec)
    if why is None:
        return None
    ended = rec.stopped_at or rec.ready_at or rec.started_at or 0.0
    proved = proved_clean(state_dir)
    devices = (wanted & set(rec.devices)) or set(rec.devices)
    if all(max(proved.get(b, 0.0), proved.get(EVERY_DEVICE, 0.0)) > ended for b in devices or [""]):
        return None
    return rec.name, why


def proved_clean(state_dir: str) -> dict[str, float]:
    """When each device was last proved clean (BDF or EVERY_DEVICE -> epoch seconds); {} when
    nothing was, or the file cannot be read."""
    try:
        data = json.loads(read_regular(os.path.join(state_dir, PROOFS), 1 << 20))
    except (OSError, ValueError):
        return {}
    devices = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(devices, dict):
        return {}
    out: dict[str, float] = {}
    for bdf, proof in devices.items():
        at = proof.get("at") if isinstance(proof, dict) else None
        if isinstance(bdf, str) and isinstance(at, (int, float)) and not isinstance(at, bool):
            out[bdf] = float(at)
    return out


def note_clean(state_dir: str | None, bdfs: Iterable[str] | None, by: str) -> bool:
    """Record that `by` (the collective check, a reset) proved these devices clean now (None:
    every device). Only where runs are recorded (a state directory with `runs/`); a storage
    fault is not the caller's failure: False, and the unclean end stays recorded."""
    if not state_dir or not os.path.isdir(os.path.join(state_dir, "runs")):
        return False
    keys = [EVERY_DEVICE] if bdfs is None else sorted(set(bdfs))
    if not keys:
        return False
    try:
        data = json.loads(read_regular(os.path.join(state_dir, PROOFS), 1 << 20))
    except (OSError, ValueError):
        data = {}
    devices = data.get("devices") if isinstance(data, dict) else None
    devices = dict(devices) if isinstance(devices, dict) else {}
    now = time.time()
    devices.update({k: {"at": now, "by": by} for k in keys})
    try:
        atomic.replace(os.path.join(state_dir, PROOFS),
                       (json.dumps({"devices": devices}, indent=1, sort_keys=True) + "\n").encode())
    except OSError:
        return False
    return True


def _alive(pid: int) -> bool:
    """The process runs (a zombie does not: a killed supervisor stays one where PID 1 does
    not reap, as in many containers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read(4096)
    except OSError:
        return True  # it was there a moment ago; unreadable is not gone
    return data[data.rfind(b")") + 2:][:1] not in (b"Z", b"X", b"")
