"""reset: plan, confirmation, deletion by the stale rules only, and orphans stopped for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import fakehost
import proctools
import pytest
from typer.testing import CliRunner

from xpuctl.cli import app

runner = CliRunner()


def _invoke(root, *args):
    return runner.invoke(app, ["--root", str(root), "reset", *args])


def test_dry_run_lists_only_stale_files_and_deletes_nothing(tmp_path):
    h = fakehost.orphan_host(tmp_path / "root")
    before = sorted(p for p in (tmp_path / "root" / "tmp").iterdir())
    res = _invoke(h.root, "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    planned = {f["path"] for f in plan["files"]}
    assert h.paths["stale_shm"] in planned
    assert h.paths["ccl_dead"] in planned
    assert h.paths["filestore_old"] in planned
    for keep in ("ccl_live", "ccl_cache", "shm_symlink", "uuid_regular", "filestore_live"):
        assert h.paths[keep] not in planned, keep
    # a fake root's /proc is not ours: orphans are reported, never signalled
    assert plan["orphan_pids"] and plan["orphans"] == []
    assert any("cannot be stopped" in n for n in plan["notes"])
    assert sorted(p for p in (tmp_path / "root" / "tmp").iterdir()) == before


def test_yes_removes_exactly_the_stale_files(tmp_path):
    h = fakehost.orphan_host(tmp_path / "root")
    res = _invoke(h.root, "--yes", "--json")
    data = json.loads(res.stdout)
    removed = set(data["removed"])
    assert h.paths["stale_shm"] in removed and h.paths["ccl_dead"] in removed
    root = tmp_path / "root"
    for gone in removed:
        assert not os.path.lexists(str(root) + gone)
    for keep in ("ccl_live", "ccl_cache", "shm_symlink", "uuid_regular", "filestore_live"):
        assert os.path.lexists(str(root) + h.paths[keep]), keep
    assert os.path.exists("/etc/passwd")  # the symlink's target, never followed
    # orphans remain (cannot be stopped through a fake /proc): still failing
    assert res.exit_code == 1
    assert data["status"] == "dirty"


def test_refuses_without_yes_and_without_terminal(tmp_path):
    h = fakehost.orphan_host(tmp_path / "root")
    res = _invoke(h.root)
    assert res.exit_code == 2
    assert "--yes" in res.stderr
    assert os.path.lexists(str(h.root) + h.paths["stale_shm"])


def test_clean_host_has_nothing_to_do(tmp_path):
    h = fakehost.clean_host(tmp_path / "root")
    res = _invoke(h.root, "--yes")
    assert res.exit_code == 0
    assert "nothing to clean" in res.stdout


@pytest.mark.slow
def test_stops_real_orphans_and_cleans_their_files(proc_token, standin_root):
    """A fake vLLM tree whose API server was SIGKILLed: reset stops the orphans for real."""
    r = standin_root
    srv = proctools.start_fake_vllm(proc_token, r.root, tp=2, shutdown_timeout=5)
    assert srv.wait_ready(), srv.log()
    tree = srv.tree()
    os.kill(srv.pid, signal.SIGKILL)
    assert proctools.wait_for(lambda: proctools.is_gone(srv.pid), 30)
    survivors = [p for p in tree if p != srv.pid]
    assert len(survivors) == 3  # EngineCore and two workers
    assert all(not proctools.is_gone(p) for p in survivors)
    proctools.skip_unless_only_ours(r.root, proc_token)  # never stop an orphan we did not start
    out = subprocess.run(
        [sys.executable, "-m", "xpuctl", "--root", r.root, "reset", "--yes", "--json", "--kill-after", "2",
         "--timeout", "10"],
        capture_output=True, text=True, timeout=60,
    )
    data = json.loads(out.stdout)
    assert out.returncode == 0, out.stderr
    assert set(data["plan"]["orphan_pids"]) == set(survivors)
    assert proctools.wait_for(lambda: all(proctools.is_gone(p) for p in survivors), 30)
    assert not proctools.holders(r.node(0)) and not proctools.holders(r.node(1))


# ---------------------------------------------------------------------------------------------
# non-vLLM holders (--kill-holders) and the audit log

HOLDER = ("import os, signal, sys, time\n"
          "if sys.argv[2] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "os.open(sys.argv[1], os.O_RDWR)\n"
          "time.sleep(600)\n")


def _start_holder(token, node, mode="ignore"):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, node, mode],
                         env=proctools.token_env(token), stdin=subprocess.DEVNULL,
                         start_new_session=True)
    assert proctools.wait_for(lambda: p.pid in proctools.holders(node), 10)
    return p


def _reset(root, state, token, *args):
    proctools.skip_unless_only_ours(root, token)  # never stop an orphan this test did not start
    return subprocess.run([sys.executable, "-m", "xpuctl", "--root", root, "reset", "--state-dir",
                           str(state), *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def _audit(state) -> list[dict]:
    path = os.path.join(str(state), "audit.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def _start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        data = fh.read()
    return int(data[data.rfind(b")") + 2:].split()[19])


@pytest.mark.slow
def test_a_non_vllm_holder_is_listed_and_left_alone_without_kill_holders(proc_token, standin_root, tmp_path):
    r = standin_root
    holder = _start_holder(proc_token, r.node(0))
    try:
        out = _reset(r.root, tmp_path / "state", proc_token, "--yes")
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith("holder pid"))
        assert line.startswith(f"holder pid {holder.pid} ({sys.executable} -c import os, signal, sys")
        assert f"holds {r.bdf(0)}, not part of a live server: --kill-holders stops it" in line
        assert "\\n" in line  # the multi-line argv stays on one line, escaped
        out = _reset(r.root, tmp_path / "state", proc_token, "--yes", "--json")
        data = json.loads(out.stdout)
        assert data["plan"]["holders"] == [{"pid": holder.pid, "command": data["plan"]["holders"][0]["command"],
                                            "devices": [r.bdf(0)], "stop": False, "why_not": None}]
        assert holder.poll() is None and proctools.holders(r.node(0)) == [holder.pid]
        assert [e for e in _audit(tmp_path / "state") if e["action"] == "signal"] == []
    finally:
        holder.kill()
        holder.wait(10)


@pytest.mark.slow
def test_kill_holders_runs_the_ladder_and_audits_every_signal(proc_token, standin_root, tmp_path):
    """A holder that ignores SIGTERM: SIGTERM, wait (--timeout), SIGTERM again, SIGKILL after
    --kill-after; one audit line each, with the pid and its start time."""
    r = standin_root
    holder = _start_holder(proc_token, r.node(1), "ignore")
    ticks = _start_ticks(holder.pid)
    try:
        out = _reset(r.root, tmp_path / "state", proc_token, "--yes", "--kill-holders", "--json",
                     "--timeout", "1", "--kill-after", "1")
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert [h["pid"] for h in data["plan"]["holders"] if h["stop"]] == [holder.pid]
        assert data["stopped"] == "escalated"
        assert holder.wait(10) == -9
        assert proctools.holders(r.node(1)) == []
        lines = [e for e in _audit(tmp_path / "state") if e["target"].get("pid") == holder.pid]
        assert [(e["action"], e["signal"], e["result"]) for e in lines] == [
            ("signal", "SIGTERM", "sent"), ("signal", "SIGTERM", "sent"), ("signal", "SIGKILL", "sent")]
        for e in lines:
            assert e["target"]["start_ticks"] == ticks and e["command"] == "reset"
            assert e["uid"] == os.getuid() and e["time"].endswith("Z")
        assert data["audit"]["lines"] >= 3 and data["audit"]["lost"] == 0
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)


@pytest.mark.slow
def test_kill_holders_never_touches_a_live_server(proc_token, standin_root, tmp_path):
    r = standin_root
    srv = proctools.start_fake_vllm(proc_token, r.root, tp=1, shutdown_timeout=5)
    holder = _start_holder(proc_token, r.node(0), "default")
    try:
        assert srv.wait_ready()
        tree = srv.tree()
        assert proctools.holders(r.node(0)) and set(proctools.holders(r.node(0))) - {holder.pid}
        out = _reset(r.root, tmp_path / "state", proc_token, "--yes", "--kill-holders", "--json",
                     "--kill-after", "1")
        data = json.loads(out.stdout)
        assert [h["pid"] for h in data["plan"]["holders"]] == [holder.pid]
        assert holder.wait(15) == -15
        assert all(not proctools.is_gone(p) for p in [srv.pid, *tree])
        assert not [e for e in srv.events() if e["event"] == "signal"]
        signalled = {e["target"]["pid"] for e in _audit(tmp_path / "state") if e["action"] == "signal"}
        assert signalled == {holder.pid}
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)


def test_holders_above_under_or_tagged_with_a_live_server_are_never_stopped():
    from xpuctl.core.model import Process
    from xpuctl.sweep import _why_not

    parents = {100: 1, 200: 100, 300: 200, 400: 1, 500: 400, 600: 1}
    serving = {200}  # a live API server, child of a wrapper 100

    def proc(pid, run_id=None, proven=False):
        return Process(pid, parents[pid], "S", "x", ("x",), None, 1, 1, 1, 1, run_id=run_id,
                       run_proven=proven)

    assert _why_not(proc(100), parents, serving, set(), set()) == "a live vLLM server runs under it"
    assert _why_not(proc(300), parents, serving, set(), set()) == "it runs under a live vLLM server"
    assert _why_not(proc(600, "r1", True), parents, serving, set(), set()) == "it belongs to a live xpuctl run"
    # a tag no live run's record vouches for proves nothing (issue 29 §11)
    assert _why_not(proc(600, "r1"), parents, serving, set(), set()) is None
    # the launcher of vLLM run as a library (issue 29 §1)
    assert _why_not(proc(600), parents, serving, {600}, set()).startswith("it runs vLLM as a library")
    assert _why_not(proc(400), parents, serving, set(), {400, 1}) == "xpuctl itself or one of its parents"
    assert _why_not(proc(500), parents, serving, set(), {400, 1}) is None


def test_every_deletion_is_an_audit_line_with_its_inode(tmp_path):
    h = fakehost.orphan_host(tmp_path / "root")
    root = str(tmp_path / "root")
    inodes = {}
    for key in ("stale_shm", "ccl_dead", "filestore_old"):
        inodes[h.paths[key]] = os.lstat(root + h.paths[key]).st_ino
    state = tmp_path / "state"
    res = runner.invoke(app, ["--root", root, "reset", "--yes", "--json", "--state-dir", str(state)])
    data = json.loads(res.stdout)
    lines = _audit(state)
    deleted = {e["target"]["path"]: e for e in lines if e["action"] == "delete"}
    assert set(data["removed"]) == {p for p, e in deleted.items() if e["result"] == "removed"}
    for path, ino in inodes.items():
        assert deleted[path]["target"]["inode"] == ino and deleted[path]["result"] == "removed"
    assert all(e["command"] == "reset" and e["uid"] == os.getuid() for e in lines)
    assert not [e for e in lines if e["action"] == "signal"]  # a fake /proc: nothing signalled
    st = os.stat(state / "audit.jsonl")
    assert st.st_mode & 0o777 == 0o600
    # dry run: no line
    before = len(lines)
    runner.invoke(app, ["--root", root, "reset", "--dry-run", "--state-dir", str(state)])
    assert len(_audit(state)) == before
