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


# ---------------------------------------------------------------------------------------------
# issue 29 §9: each deletion is audited before the next one; the log is UTF-8 whatever a path


def _reset_cmd(root, state) -> list[str]:
    from serverig import XPUCTL

    return [*XPUCTL, "--root", str(root), "reset", "--yes", "--json", "--state-dir", str(state)]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_reset_killed_after_its_nth_deletion_has_audited_each_one(tmp_path, n):
    """xpuctl paused right after its N-th unlink (file-removed:N) and SIGKILLed there: the
    audit log holds exactly N deletions, the N files that are gone. On a fake host nothing
    is signalled (its /proc is not ours), so deletions are the only acts."""
    import fakehost
    from proctools import pause_env, wait_for

    h = fakehost.orphan_host(tmp_path / "root")
    for i in range(4):  # stale from the start: regular, matching psm_*, held by nobody
        (tmp_path / "root" / "dev/shm" / f"psm_extra{i}").write_bytes(b"x")
    state = tmp_path / "state"
    marker = tmp_path / "paused"
    p = subprocess.Popen(_reset_cmd(h.root, state), env=dict(os.environ, **pause_env(
        marker, f"file-removed:{n}")), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_for(lambda: marker.exists() or p.poll() is not None, 120), "never paused"
        assert marker.read_text().startswith(f"file-removed:{n} "), p.stderr
    finally:
        p.kill()
        p.wait()
    lines = _read_all(state)["audit.jsonl"]
    deletions = [e for e in lines if e["action"] == "delete"]
    assert [e["result"] for e in deletions] == ["removed"] * n, deletions
    root = str(tmp_path / "root")
    for e in deletions:
        assert not os.path.lexists(root + e["target"]["path"]), e
    # and what is still on disk of what was planned has no line yet
    planned = {f"/dev/shm/psm_extra{i}" for i in range(4)} | {h.paths["stale_shm"]}
    left = {q for q in planned if os.path.lexists(root + q)}
    assert left.isdisjoint(e["target"]["path"] for e in deletions)
    assert len(planned - left) <= n


def test_a_path_that_is_not_utf8_is_deleted_and_the_log_stays_utf8_json(tmp_path):
    import fakehost

    h = fakehost.clean_host(tmp_path / "root")
    # torch's file_system sharing names (torch_*) take any bytes; psm_* names are letters,
    # digits and '_' only (core/rules.py): a psm_ name with such bytes is no candidate
    name = b"torch_\xff\xfe"
    target = os.path.join(os.fsencode(str(h.root)), b"dev/shm", name)
    with open(target, "wb") as fh:
        fh.write(b"x")
    state = tmp_path / "state"
    p = subprocess.run(_reset_cmd(h.root, state), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not os.path.lexists(target)
    raw = (state / "audit.jsonl").read_bytes()
    text = raw.decode("utf-8")  # strict: every byte of the log is UTF-8
    (line,) = [json.loads(x) for x in text.splitlines()]
    assert line["action"] == "delete" and line["result"] == "removed"
    # readable: each byte that is not UTF-8 as the four characters \xNN; exact: its bytes in hex
    assert line["target"]["path"] == "/dev/shm/torch_\\xff\\xfe"
    assert bytes.fromhex(line["target"]["path_bytes"]) == b"/dev/shm/" + name


def test_text_that_is_utf8_is_written_as_it_is():
    """Only a path that is not UTF-8 gets `path_bytes`; other text is left alone."""
    line = {"target": {"path": "/tmp/ccl-é", "label": "VLLM::Worker_TP0"}, "result": "sent"}
    assert audit.utf8(line) == line
    bad = os.fsdecode(b"/tmp/\xc3(")
    assert audit.utf8({"path": bad}) == {"path": "/tmp/\\xc3(", "path_bytes": b"/tmp/\xc3(".hex()}
    assert audit.text(os.fsdecode(b"VLLM::\xff")) == "VLLM::\\xff"


def test_a_signal_label_is_capped_like_every_command_line_shown(tmp_path):
    """A holder's label is its command (read up to 64 KiB, parse/procfs); the audit line shows
    4 KiB of it and says how many bytes were cut (issue 29 §10)."""
    with audit.recording(str(tmp_path), "reset"):
        audit.signal(4242, 7, "/usr/bin/python3 " + "A" * 70_000, 15, "sent")
    (line,) = _read_all(tmp_path)["audit.jsonl"]
    label = line["target"]["label"]
    assert label.startswith("/usr/bin/python3 AAAA") and len(label.encode()) < 4200
    assert label.endswith("…[+65922 bytes]"), label[-40:]
