"""reset: plan, confirmation, deletion by the stale rules only, and orphans stopped for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import fakehost
import proctools
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
