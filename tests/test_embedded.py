"""vLLM run as a library is no orphan (issue 29 §1).

`LLM(...)` in a script, an AsyncLLM inside an app, a Ray Serve replica: the same
`VLLM::EngineCore` / `VLLM::Worker` titles under a parent that is no API server
(docs/safety.md, "Orphans and vLLM as a library"). Such a tree belongs to its live launcher:
doctor shows it as "vLLM embedded in pid N (command)", and nothing plans to stop it. Only
once its launcher is gone (reparented to init or a subreaper, or its parent pid reused by a
younger process) is it an orphan that reset stops.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fakehost as fh
import pytest
from proctools import pidns_available
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.core import trees
from xpuctl.parse.roles import API_SERVER, ENGINE_CORE, WORKER

runner = CliRunner()
PY = sys.executable
SUPPORT_DIR = Path(__file__).resolve().parent / "support"


def _json(root: Path, *args: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["--root", str(root), *args])
    assert "Traceback" not in res.output, res.output
    return res.exit_code, json.loads(res.stdout)


def _procs(doc: dict) -> dict[int, dict]:
    return {p["pid"]: p for p in doc["processes"]}


# -- fake hosts ---------------------------------------------------------------------------


def test_doctor_shows_a_library_tree_as_embedded_not_orphaned(tmp_path):
    h = fh.embedded_host(tmp_path / "root")
    code, doc = _json(h.root, "doctor", "--json")
    procs = _procs(doc)
    for pid in (h.engine, h.worker):
        p = procs[pid]
        assert p["orphan"] is False, p
        assert p["embedded_in"] == {"pid": h.script, "blocked": False,
                                    "command": "python3 batch.py --prompts /data/p.jsonl"}
    assert procs[h.engine]["role"] == ENGINE_CORE and procs[h.worker]["role"] == WORKER
    assert not [f for f in doc["findings"] if f["check"] == "orphans"]
    busy = [f for f in doc["findings"] if f["check"] == "device-holders"]
    assert len(busy) == 1 and busy[0]["severity"] == "info", busy
    assert busy[0]["message"].startswith(
        f"{fh.BDF0} is busy: held by vLLM embedded in pid {h.script} (python3 batch.py")
    # the script holds the device itself (its own Level Zero context): part of the same job
    assert set(busy[0]["pids"]) == {h.script, h.worker}
    assert code == 0 and doc["status"] == "busy"


def test_ps_and_the_tables_name_the_process_it_is_embedded_in(tmp_path):
    h = fh.embedded_host(tmp_path / "root")
    code, doc = _json(h.root, "ps", "--json")
    assert code == 0
    assert {p["pid"]: p["embedded_in"]["pid"] for p in doc["processes"]} == {
        h.engine: h.script, h.worker: h.script}
    res = runner.invoke(app, ["--root", str(h.root), "ps"], env={"COLUMNS": "200"})
    row = next(line for line in res.stdout.splitlines() if line.lstrip().startswith(str(h.engine)))
    assert f"engine-core embedded in {h.script}" in row and "ORPHAN" not in row
    res = runner.invoke(app, ["--root", str(h.root), "doctor"], env={"COLUMNS": "200"})
    assert f"vLLM embedded in pid {h.script} (python3 batch.py" in res.stdout, res.stdout


def test_nothing_plans_to_stop_an_embedded_tree(tmp_path):
    h = fh.embedded_host(tmp_path / "root")
    code, doc = _json(h.root, "reset", "--dry-run", "--json")
    plan = doc["plan"]
    assert code == 0 and plan["orphan_pids"] == [] and plan["orphans"] == []
    assert (f"kept: vLLM tree {h.engine}: vLLM embedded in pid {h.script} (python3 batch.py "
            "--prompts /data/p.jsonl): not an orphan") in plan["notes"], plan["notes"]
    code, doc = _json(h.root, "shutdown", "--all", "--dry-run", "--json")
    assert code == 0 and doc["targets"] == []
    res = runner.invoke(app, ["--root", str(h.root), "shutdown", "--device", "0", "--dry-run"])
    assert res.exit_code == 3
    assert f"vLLM embedded in pid {h.script} (python3 batch.py" in res.stderr, res.stderr


def test_rebind_is_blocked_by_an_embedded_tree(tmp_path):
    h = fh.embedded_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "reset", "--device", "0", "--rebind",
                              "--dry-run", "--state-dir", str(tmp_path / "state")])
    line = next(x for x in res.stdout.splitlines() if f"holder pid {h.worker} " in x)
    assert line.endswith(f"vLLM embedded in pid {h.script} (python3 batch.py --prompts "
                         "/data/p.jsonl): stop that process itself"), line


def test_a_parent_pid_reused_by_a_younger_process_is_no_launcher(tmp_path):
    """The script died and its pid names `sleep 600` now, started after the EngineCore (same
    session and group: only the start time tells)."""
    h = fh.embedded_host(tmp_path / "root", reused_parent=True)
    code, doc = _json(h.root, "doctor", "--json")
    procs = _procs(doc)
    for pid in (h.engine, h.worker):
        assert procs[pid]["orphan"] is True and procs[pid]["embedded_in"] is None, procs[pid]
    orphans = [f for f in doc["findings"] if f["check"] == "orphans"]
    assert len(orphans) == 1 and set(orphans[0]["pids"]) == {h.engine, h.worker}
    assert orphans[0]["severity"] == "fail" and code == 1


def _container(root: Path, pid1_runs_vllm: bool) -> fh.FakeHost:
    """A container's PID namespace seen from inside (`kubectl exec` xpuctl): PID 1 leads
    session and group 1 (runc's setsid) and is either the script that called `LLM(...)`
    (vLLM's and torch's libraries mapped in it) or a harness that ran a script since killed
    (nothing of vLLM's in it); the EngineCore and its worker share session and group 1."""
    h = fh.FakeHost(root)
    h.add_device("renderD128", "card0", fh.BDF0, device=fh.B60, driver="xe",
                 vram_tiles=[fh.B60_VRAM])
    libs = ["/usr/local/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so",
            "/usr/local/lib/python3.12/site-packages/vllm/_C.abi3.so"] if pid1_runs_vllm else [
            "/usr/lib/x86_64-linux-gnu/libc.so.6"]
    h.add_process(1, 0, ["python3", "batch.py" if pid1_runs_vllm else "harness.py"], uid=0,
                  pgrp=1, session=1, start_ticks=h.ticks(1),
                  maps=[fh.maps_line(p, 900 + i, 0x7F0000000000 + (i << 24), perms="r-xp",
                                     dev="08:02") for i, p in enumerate(libs)])
    spawn = ["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    h.add_process(10, 1, spawn, title="VLLM::EngineCore", uid=0, pgrp=1, session=1,
                  start_ticks=h.ticks(5), fds={0: "/dev/null"})
    h.add_process(20, 10, spawn, title="VLLM::Worker_TP0", uid=0, pgrp=1, session=1,
                  start_ticks=h.ticks(6), fds={9: "/dev/dri/renderD128"},
                  fdinfo={9: fh.xe_fdinfo(3, fh.BDF0, [fh.GiB], ino=685)})
    return h


def test_a_containers_pid_1_owns_what_it_launched_only_when_it_runs_vllm(tmp_path):
    for runs_vllm in (True, False):
        h = _container(tmp_path / str(runs_vllm), runs_vllm)
        code, doc = _json(h.root, "doctor", "--json")
        procs = _procs(doc)
        for pid in (10, 20):
            assert procs[pid]["orphan"] is not runs_vllm, (runs_vllm, procs[pid])
            assert (procs[pid]["embedded_in"] or {}).get("pid") == (1 if runs_vllm else None)
        assert code == (0 if runs_vllm else 1)


# -- the rule, on its own ---------------------------------------------------------------------
# Member(pid, ppid, session, role, run_id, zombie, pgrp, start_ticks), as host/scan.py reads
# them from /proc/<pid>/stat (fields 4 ppid, 5 pgrp, 6 session, 22 starttime: proc(5)).


def _m(pid, ppid, session, pgrp, ticks, role=None, zombie=False, run_id=None, vllm=False):
    return trees.Member(pid, ppid, session, role, run_id, zombie, pgrp, ticks, runs_vllm=vllm)


def _family(parent: trees.Member, engine_ppid: int | None = None, session=500, pgrp=500, ticks=200):
    """`parent` and an engine (pid 600, started at `ticks`) with a worker 610."""
    ppid = parent.pid if engine_ppid is None else engine_ppid
    return {parent.pid: parent,
            600: _m(600, ppid, session, pgrp, ticks, ENGINE_CORE),
            610: _m(610, 600, session, pgrp, ticks + 5, WORKER)}


def test_a_live_launcher_of_any_kind_owns_its_tree():
    members = _family(_m(500, 400, 500, 500, 100))  # a script, its own job's group and session
    placed = trees.resolve(members)
    assert {pid: (p.orphan, p.owner, p.top) for pid, p in placed.items()} == {
        600: (False, 500, 600), 610: (False, 500, 600)}


def test_a_tree_whose_launcher_is_gone_is_orphaned():
    cases = {
        # reparented to a subreaper (systemd --user, containerd-shim, xpuctl serve): its
        # session and group are those of its dead launcher, not the reaper's
        "subreaper": _family(_m(300, 1, 300, 300, 50), engine_ppid=300),
        # its parent is a zombie: gone (it holds nothing, and may never be reaped)
        "zombie": _family(_m(500, 400, 500, 500, 100, zombie=True)),
        # the parent pid names a process younger than the engine: the pid was reused
        "reused": _family(_m(500, 400, 500, 500, 900)),
        # reparented to init
        "init": _family(_m(1, 0, 1, 1, 1), engine_ppid=1),
        # init seen from a child PID namespace whose own session is led outside it (0)
        "pidns": _family(_m(1, 0, 0, 0, 1, vllm=True), engine_ppid=1, session=0, pgrp=0),
        # a container's PID 1 that does not reap (a harness, a shell): it started the dead
        # launcher in its own session and group, but runs no vLLM itself
        "container": _family(_m(1, 0, 1, 1, 1), engine_ppid=1, session=1, pgrp=1),
    }
    for name, members in cases.items():
        placed = trees.resolve(members)
        assert placed[600].orphan and placed[610].orphan, name
        assert placed[600].owner is None, name


def test_pid_1_running_vllm_launches_what_shares_its_session_and_group():
    """In a container whose PID 1 is the script itself (`docker run img python batch.py`:
    runc makes it lead session and group 1, and vLLM and torch are loaded in it), the engine
    it spawned shares both."""
    members = _family(_m(1, 0, 1, 1, 1, vllm=True), engine_ppid=1, session=1, pgrp=1)
    assert trees.launcher(members, 600) == 1 and not trees.resolve(members)[600].orphan


def test_a_younger_vllm_parent_is_not_climbed_into():
    """A worker whose EngineCore died, its pid now another run's EngineCore: the worker is
    the top of its own (orphaned) tree, never a member of the younger one."""
    members = {
        400: _m(400, 1, 400, 400, 10, API_SERVER),
        600: _m(600, 400, 400, 400, 900, ENGINE_CORE),  # the new engine, at the reused pid
        610: _m(610, 600, 300, 300, 500, WORKER),  # the old worker, older than "its" parent
    }
    placed = trees.resolve(members)
    assert placed[600].top == 400 and not placed[600].orphan
    assert placed[610].top == 610 and placed[610].orphan


def test_an_api_server_under_a_shell_is_a_top_never_an_orphan():
    members = {
        2001: _m(2001, 1995, 2001, 2001, 10),  # a login shell
        3000: _m(3000, 2001, 2001, 3000, 20, API_SERVER),
        3010: _m(3010, 3000, 2001, 3000, 25, ENGINE_CORE),
    }
    placed = trees.resolve(members)
    assert placed[3000] == placed[3000]._replace(top=3000, orphan=False, owner=None)
    assert placed[3010].top == 3000 and not placed[3010].orphan and placed[3010].owner is None


# -- real processes ---------------------------------------------------------------------------

_DRIVER = r"""
import json, os, signal, subprocess, sys
support, token, workdir, state = sys.argv[1:5]
sys.path.insert(0, support)
from proctools import StandInRoot, is_gone, token_env, wait_for
out = {"pid": os.getpid()}
root = StandInRoot(workdir, n_devices=2)
R = root.root
env = token_env(token, SPT_NOENV="1")
def xp(*args):
    p = subprocess.run([sys.executable, "-m", "xpuctl", "--root", R, *args], capture_output=True,
                       text=True, timeout=180, stdin=subprocess.DEVNULL, env=env)
    return {"code": p.returncode, "out": p.stdout, "err": p.stderr}
def pid(name):
    path = os.path.join(workdir, name + ".pid")
    wait_for(lambda: os.path.exists(path), 60)
    return int(open(path).read())
try:
    script = subprocess.Popen([sys.executable, os.path.join(support, "embedded_vllm.py"),
                               "script", workdir, "-", os.path.join(R, "dev/dri/renderD128")],
                              env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    out["script"], out["engine"], out["worker"] = script.pid, pid("engine"), pid("worker0")
    tree = [out["engine"], out["worker"]]
    out["doctor_live"] = xp("doctor", "--json")
    out["reset_live"] = xp("reset", "--yes", "--json", "--state-dir", state, "--kill-after", "1",
                           "--timeout", "5")
    out["alive_after_reset"] = [not is_gone(p) for p in tree]
    os.kill(script.pid, signal.SIGKILL)
    script.wait()
    out["reparented"] = wait_for(lambda: open(f"/proc/{out['engine']}/stat").read()
                                 .rsplit(")", 1)[1].split()[1] == "1", 30)
    out["doctor_dead"] = xp("doctor", "--json")
    out["reset_dead"] = xp("reset", "--yes", "--json", "--state-dir", state, "--kill-after", "1",
                           "--timeout", "5")
    out["gone"] = wait_for(lambda: all(is_gone(p) for p in tree), 30)
finally:
    root.close()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
def test_reset_leaves_a_live_library_job_and_stops_it_once_its_launcher_is_killed(tmp_path,
                                                                                   proc_token):
    """Real processes in a private PID namespace (reset stops every orphan it sees: here only
    ours exist): a script that spawned `VLLM::EngineCore` and `VLLM::Worker_TP0` with
    setproctitle and lives on. doctor: embedded, not orphaned, exit 0; `reset --yes` signals
    neither. After a SIGKILL of the script they are reparented to init: orphans, stopped."""
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PY, str(driver),
                        str(SUPPORT_DIR), proc_token, str(tmp_path), str(tmp_path / "state")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1, out
    engine, worker, script = out["engine"], out["worker"], out["script"]

    live = out["doctor_live"]
    doc = json.loads(live["out"])
    procs = _procs(doc)
    for pid in (engine, worker):
        assert not procs[pid]["orphan"] and procs[pid]["embedded_in"]["pid"] == script, procs[pid]
    assert "embedded_vllm.py script" in procs[engine]["embedded_in"]["command"]
    assert not [f for f in doc["findings"] if f["check"] == "orphans"]
    assert live["code"] == 0, live

    reset = json.loads(out["reset_live"]["out"])
    assert out["reset_live"]["code"] == 0, out["reset_live"]
    assert reset["plan"]["orphan_pids"] == [] and reset.get("stopped") is None, reset
    assert out["alive_after_reset"] == [True, True]

    assert out["reparented"], out
    dead = json.loads(out["doctor_dead"]["out"])
    procs = _procs(dead)
    for pid in (engine, worker):
        assert procs[pid]["orphan"] and procs[pid]["embedded_in"] is None, procs[pid]
    assert out["doctor_dead"]["code"] == 1
    reset = json.loads(out["reset_dead"]["out"])
    assert sorted(reset["plan"]["orphan_pids"]) == sorted([engine, worker]), reset["plan"]
    assert out["gone"], out
