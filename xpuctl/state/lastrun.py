"""The state directory's most recent run, for the relaunch advice (doctor's `last-run`).

Cheap on purpose, since doctor runs before every launch: one listing of `runs/`, one record
read (the newest by modification time: records are rewritten on every state change), and
the last `TAIL_BYTES` of that run's log. The log is found by the run's name under the state
directory's own `logs/`, never through a path written in the record.
"""

from __future__ import annotations

import os

from xpuctl.core.model import LastRun
from xpuctl.parse.vllmlog import furthest_phase, hang_signatures, log_lines
from xpuctl.state.runs import ACTIVE_STATES, RunRecord, ensure_state_dir, read_record

TAIL_BYTES = 64 * 1024
NOT_READY_NOTE = "not ready after "  # serve's note on a readiness timeout (serve._not_ready)


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
        with open(path, "rb") as fh:
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


def unclean_run_on(state_dir: str | None, bdfs: list[str] | tuple[str, ...]) -> tuple[str, str] | None:
    """(run name, why) when the newest run recorded on any of `bdfs` did not end cleanly:
    it failed (killed, exited by itself with an error, left leftovers), was never ready in
    time, or is recorded as running while its supervisor is gone. None when it ended
    cleanly, or there is none (serve's automatic collective check)."""
    if not state_dir or not os.path.isdir(state_dir):
        return None
    from xpuctl.state.runs import list_records

    wanted = set(bdfs)
    mine = [r for r in list_records(state_dir) if not wanted or wanted & set(r.devices)]
    if not mine:
        return None
    rec = max(mine, key=lambda r: r.stopped_at or r.ready_at or r.started_at or 0.0)
    if any(n.startswith(NOT_READY_NOTE) for n in rec.notes):
        return rec.name, "was not ready in time"
    if rec.state == "failed":
        code = f" (exit {rec.exit_code})" if rec.exit_code is not None else ""
        return rec.name, f"failed{code}: killed, an error, or leftovers"
    if rec.state in ACTIVE_STATES and rec.supervisor_pid and not _alive(rec.supervisor_pid):
        return rec.name, f"is recorded as {rec.state} but its supervisor {rec.supervisor_pid} is gone"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
