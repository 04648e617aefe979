"""The audit log's rotation by size (issue 17 item 3): at the bound, and under concurrent
xpuctl runs (no line lost, split or interleaved)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xpuctl.state import audit


def _read_all(state: Path) -> dict[str, list[dict]]:
    out = {}
    for path in sorted(state.glob("audit.jsonl*")):
        text = path.read_text()
        assert text == "" or text.endswith("\n"), path  # no torn last line
        out[path.name] = [json.loads(line) for line in text.splitlines()]
    return out


def test_the_log_rotates_at_the_bound_and_keeps_KEEP_files(tmp_path, monkeypatch):
    monkeypatch.setattr(audit, "MAX_BYTES", 2000)
    monkeypatch.setattr(audit, "KEEP", 2)
    state = tmp_path / "state"
    with audit.recording(str(state), "test") as sink:
        for n in range(60):
            audit.record("signal", {"pid": n, "start_ticks": 1, "label": "x" * 40}, "sent", signal="SIGTERM")
    assert sink.lines == 60 and sink.lost == 0
    files = _read_all(state)
    assert sorted(files) == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]  # never a .3
    line_size = len(json.dumps(files["audit.jsonl"][0], ensure_ascii=False)) + 1
    for name in ("audit.jsonl.1", "audit.jsonl.2"):
        size = (state / name).stat().st_size
        # rotated once it reached the bound: at most one line over it
        assert 2000 <= size < 2000 + line_size + 10, (name, size)
        assert (state / name).stat().st_mode & 0o777 == 0o600
    # newest last, oldest dropped, no gap between the files kept
    pids = [e["target"]["pid"] for name in ("audit.jsonl.2", "audit.jsonl.1", "audit.jsonl")
            for e in files[name]]
    assert pids == list(range(60 - len(pids), 60)) and len(pids) < 60


WRITER = r"""
import sys
from xpuctl.state import audit
audit.MAX_BYTES, audit.KEEP = int(sys.argv[2]), 10_000
with audit.recording(sys.argv[1], "writer") as sink:
    for n in range(int(sys.argv[3])):
        audit.record("signal", {"pid": n, "start_ticks": 0, "label": "y" * 200}, "sent")
assert sink.lost == 0, sink.error
"""


@pytest.fixture()
def writers():
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_concurrent_runs_rotate_without_losing_or_splitting_a_line(tmp_path, writers):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    per, count = 150, 4
    for _ in range(count):
        writers.append(subprocess.Popen([sys.executable, "-c", WRITER, str(state), "3000", str(per)]))
    for p in writers:
        assert p.wait(timeout=120) == 0
    files = _read_all(state)
    assert len(files) > 10  # many rotations happened while the others wrote
    seen = [(e["xpuctl_pid"], e["target"]["pid"]) for lines in files.values() for e in lines]
    assert len(seen) == len(set(seen)) == per * count  # every line once, whole
    for p in writers:
        assert sorted(n for pid, n in seen if pid == p.pid) == list(range(per))
    for name in files:
        if name != "audit.jsonl":  # a rotated file reached the bound; by at most a few lines
            assert 3000 <= (state / name).stat().st_size < 3000 + count * 400, name


def test_a_deep_probes_group_kill_is_audited_when_the_command_records(tmp_path):
    """The one signal outside actions/signals: doctor --deep's SIGKILL of its own probe
    child's process group (serve --preflight deep records it)."""
    import time as _time

    from xpuctl.probes.runner import _Job

    state = tmp_path / "state"
    job = _Job("torch", [sys.executable, "-c", "pass"], dict(os.environ))
    try:
        with audit.recording(str(state), "serve"):
            deadline = _time.monotonic() + 60
            while not job.exited():
                assert _time.monotonic() < deadline
                _time.sleep(0.01)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
        job.proc.wait()
    (line,) = _read_all(state)["audit.jsonl"]
    assert (line["command"], line["action"], line["signal"], line["result"]) == (
        "serve", "signal", "SIGKILL", "sent")
    assert line["target"] == {"pgid": job.pid, "label": "probe torch"}
