"""Who adopted a vLLM process decides whether it is an orphan (core/trees, host/adoption).

1. A run whose API server died while its `xpuctl serve` supervisor lives (issue 38 §7). The
   supervisor stops what is left of the tree itself (serve/supervise reaps its API server and
   runs the ladder on the rest), so doctor says those processes are that run's, being stopped,
   never orphans, at every moment of that window: the API server an unreaped zombie (their
   parent), reaped (their parent the supervisor, a subreaper, whose session and group are not
   theirs), and whether the EngineCore leads its own process group or not. Once the
   supervisor is gone too, nothing will stop them: orphans. A copied tag under no live
   supervisor proves nothing. (The real-vLLM tier holds the same on a real run:
   tests/vllm_real/test_real_vllm_xpuctl.py.)
2. Orphans in containers (issue 37 §6): seen from the host a container's init is not pid 1,
   and an orphan it adopted shares its session and group. The init of any PID namespace
   (NSpid in /proc/PID/status ends in 1) is a launcher only when it runs vLLM itself: on a
   fake host, and in a real PID namespace whose init is a shell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import fakehost as fh
import pytest
from proctools import pidns_available, pids_with_token, token_env, wait_for
from typer.testing import CliRunner

from xpuctl.cli import app

runner = CliRunner()
SUP, API, ENGINE, WORKER = 6100, 6110, 6120, 6130
SPAWN = ["/usr/bin/python3", "-c",
         "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=33, pipe_handle=35)",
         "--multiprocessing-fork"]
RUN = "vllm-8011"


def _state(tmp_path: Path, supervisor: int = SUP, start: int | None = None) -> Path:
    from xpuctl.state.runs import RunRecord, write_record

    state = tmp_path / "state"
    if not state.exists():
        state.mkdir(mode=0o700)
        for sub in ("runs", "locks", "logs"):
            (state / sub).mkdir(mode=0o700)
    write_record(str(state), RunRecord(
        name=RUN, run_id=fh.RUN_ID, pid=API, start_ticks=start, session=API,
        command=[], devices=[], port=8011, bind="127.0.0.1", shutdown_timeout=40,
        drain_timeout=30.0, teardown_timeout=10.0, log_path="", state="ready",
        supervisor_pid=supervisor))
    return state


def _run_host(root: Path, moment: str, engine_leads_group: bool = False) -> fh.FakeHost:
    """A detached `xpuctl serve` run after `kill -9` of its API server, at one `moment`:
    `zombie` (not yet reaped: its children's parent), `reaped` (they were reparented to the
    supervisor, a subreaper), `no-supervisor` (the supervisor died too: reparented to 1)."""
    h = fh.clean_host(root)
    env = dict(fh.ALICE_ENV, XPUCTL_RUN_ID=fh.RUN_ID, SPT_NOENV="1")
    common = {"uid": 1000, "environ": env}
    if moment != "no-supervisor":
        # the detached supervisor: setsid (its own session), ppid 1
        h.add_process(SUP, 1, ["/usr/bin/python3", "-m", "xpuctl", "serve", "--detach",
                               "/models/llama", "--port", "8011"],
                      session=SUP, pgrp=SUP, start_ticks=h.ticks(4000), **common)
    if moment == "zombie":
        h.add_process(API, SUP, [], state="Z", comm="vllm", session=API, pgrp=API,
                      start_ticks=h.ticks(4001), uid=1000)
    parent = {"zombie": API, "reaped": SUP, "no-supervisor": 1}[moment]
    group = ENGINE if engine_leads_group else API
    h.add_process(ENGINE, parent, SPAWN, title="VLLM::EngineCore", session=API, pgrp=group,
                  start_ticks=h.ticks(4010), **common)
    h.add_process(WORKER, ENGINE, SPAWN, title="VLLM::Worker", session=API, pgrp=group,
                  start_ticks=h.ticks(4011), **common)
    return h


def _doctor(h: fh.FakeHost, state: Path) -> dict:
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json", "--state-dir",
                              str(state)])
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("leads", [False, True], ids=["api-group", "own-group"])
@pytest.mark.parametrize("moment", ["zombie", "reaped"])
def test_a_run_whose_supervisor_lives_is_being_stopped_not_orphaned(tmp_path, moment, leads):
    h = _run_host(tmp_path / "root", moment, engine_leads_group=leads)
    doc = _doctor(h, _state(tmp_path, start=h.ticks(4001)))
    procs = {p["pid"]: p for p in doc["processes"]}
    for pid in (ENGINE, WORKER):
        p = procs[pid]
        assert p["orphan"] is False and p["stopping_by"] == RUN, p
        assert p["embedded_in"] is None, p  # the supervisor adopted it: not its launcher
    notes = [f for f in doc["findings"] if f["check"] == "orphans"]
    assert [f["severity"] for f in notes] == ["info"], notes
    assert f"being stopped by run {RUN}" in notes[0]["message"], notes
    assert {ENGINE, WORKER} <= set(notes[0]["pids"])
    ps = runner.invoke(app, ["--root", str(h.root), "doctor", "--state-dir",
                             str(tmp_path / "state")])
    assert f"being stopped by run {RUN}" in ps.stdout, ps.stdout


@pytest.mark.parametrize("leads", [False, True], ids=["api-group", "own-group"])
def test_once_the_supervisor_is_gone_too_they_are_orphans(tmp_path, leads):
    h = _run_host(tmp_path / "root", "no-supervisor", engine_leads_group=leads)
    doc = _doctor(h, _state(tmp_path, start=h.ticks(4001)))
    procs = {p["pid"]: p for p in doc["processes"]}
    for pid in (ENGINE, WORKER):
        assert procs[pid]["orphan"] is True and procs[pid]["stopping_by"] is None, procs[pid]
    fails = [f for f in doc["findings"] if f["check"] == "orphans" and f["severity"] == "fail"]
    assert fails and {ENGINE, WORKER} <= set(fails[0]["pids"]), doc["findings"]


def test_a_younger_process_at_the_supervisors_pid_is_not_the_supervisor(tmp_path):
    """The record's supervisor pid now names a process started after the run's top: the pid
    was reused, the supervisor is gone, and the tagged remains are orphans."""
    h = _run_host(tmp_path / "root", "reaped")
    doc = _doctor(h, _state(tmp_path, start=h.ticks(3000)))  # the top started before SUP
    procs = {p["pid"]: p for p in doc["processes"]}
    assert procs[ENGINE]["stopping_by"] is None and procs[ENGINE]["orphan"] is True


def test_a_copied_tag_outside_the_supervisors_tree_is_an_orphan(tmp_path):
    """An EngineCore carrying the run's id, reparented to init (not under the supervisor):
    the live supervisor vouches only for its own descendants."""
    h = _run_host(tmp_path / "root", "reaped")
    env = dict(fh.ALICE_ENV, XPUCTL_RUN_ID=fh.RUN_ID, SPT_NOENV="1")
    h.add_process(6200, 1, SPAWN, title="VLLM::EngineCore", session=6190, pgrp=6190,
                  start_ticks=h.ticks(4020), uid=1000, environ=env)
    doc = _doctor(h, _state(tmp_path, start=h.ticks(4001)))
    procs = {p["pid"]: p for p in doc["processes"]}
    assert procs[6200]["orphan"] is True and procs[6200]["stopping_by"] is None
    assert procs[ENGINE]["stopping_by"] == RUN


# -- containers -----------------------------------------------------------------------------

INIT, ORPHAN = 7000, 7010


def _container_host(root: Path, init_runs_vllm: bool) -> fh.FakeHost:
    """A container whose init (host pid 7000, pid 1 inside: NSpid `7000 1`) adopted an
    EngineCore whose launcher died; it shares the init's session and group (the container's)."""
    h = fh.clean_host(root)
    torch = "/opt/venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so"
    maps = ([fh.maps_line(torch, 9100, 0x7F0000000000, 0x100000, perms="r-xp", dev="08:01")]
            if init_runs_vllm else None)
    h.add_process(INIT, 1, ["/bin/sh", "-c", "python3 /app/serve.py; sleep infinity"],
                  session=INIT, pgrp=INIT, start_ticks=h.ticks(5000), uid=1000,
                  nspid=(INIT, 1), maps=maps)
    h.add_process(ORPHAN, INIT, SPAWN, title="VLLM::EngineCore", session=INIT, pgrp=INIT,
                  start_ticks=h.ticks(5010), uid=1000, nspid=(ORPHAN, 12))
    return h


@pytest.mark.parametrize("runs_vllm", [False, True], ids=["init-is-a-shell", "init-runs-vllm"])
def test_a_containers_init_adopts_like_pid_1(tmp_path, runs_vllm):
    h = _container_host(tmp_path / "root", runs_vllm)
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json", "--state-dir",
                              str(tmp_path / "none")])
    procs = {p["pid"]: p for p in json.loads(res.stdout)["processes"]}
    p = procs[ORPHAN]
    if runs_vllm:  # vLLM as a library in the container's own program: its launcher
        assert p["orphan"] is False and p["embedded_in"]["pid"] == INIT, p
    else:
        assert p["orphan"] is True and p["embedded_in"] is None, p
        assert res.exit_code == 1


def test_an_ordinary_parent_sharing_session_and_group_stays_the_launcher(tmp_path):
    """The same tree with an init that is no namespace's init (NSpid one entry): the parent
    that shares the child's session and group launched it (vLLM as a library)."""
    h = fh.clean_host(tmp_path / "root")
    h.add_process(INIT, 1, ["/bin/sh", "-c", "python3 /app/serve.py"], session=INIT,
                  pgrp=INIT, start_ticks=h.ticks(5000), uid=1000)
    h.add_process(ORPHAN, INIT, SPAWN, title="VLLM::EngineCore", session=INIT, pgrp=INIT,
                  start_ticks=h.ticks(5010), uid=1000)
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json", "--state-dir",
                              str(tmp_path / "none")])
    p = {p["pid"]: p for p in json.loads(res.stdout)["processes"]}[ORPHAN]
    assert p["orphan"] is False and p["embedded_in"]["pid"] == INIT, p


_ORPHAN_PY = """\
import os, sys, time
import setproctitle
setproctitle.setproctitle("VLLM::EngineCore")
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
def test_a_real_pid_namespace_whose_init_is_a_shell(tmp_path, proc_token):
    """A real PID namespace (`unshare --pid --fork --mount-proc`, its own session): its init is
    a shell; a launcher inside starts an EngineCore-titled process in the background and
    exits, so the shell (pid 1 inside) adopts it. Seen from the host the init is not pid 1 and
    the orphan shares its session and group: doctor, run on the host, calls it an orphan."""
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN_PY)
    ready = tmp_path / "ready"
    inner = f"{sys.executable} {script} {ready} &"
    env = token_env(proc_token)
    outer = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
         f"sh -c '{inner}'; while :; do sleep 1; done"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    try:
        assert wait_for(lambda: ready.exists() and ready.read_text(), 60), outer.stderr
        tagged = pids_with_token(proc_token)
        orphans = [p for p in tagged if _title(p) == "VLLM::EngineCore"]
        assert len(orphans) == 1, tagged
        orphan = orphans[0]
        init = _stat(orphan)[1]
        assert _nspid(init)[-1] == "1" and init != 1, _nspid(init)  # the shell adopted it
        assert _stat(orphan)[2:] == _stat(init)[2:], "shares the init's group and session"
        res = subprocess.run([sys.executable, "-m", "xpuctl", "doctor", "--json",
                              "--state-dir", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "XPUCTL_ROOT"})
        procs = {p["pid"]: p for p in json.loads(res.stdout)["processes"]}
        assert procs[orphan]["role"] == "engine-core", procs.get(orphan)
        assert procs[orphan]["orphan"] is True and procs[orphan]["embedded_in"] is None
    finally:
        os.killpg(outer.pid, signal.SIGKILL)  # our child leads its own session: not reused
        outer.wait()


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[int, int, int, int]:
    """(pid, ppid, pgrp, session) from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return pid, int(fields[1]), int(fields[2]), int(fields[3])


def _nspid(pid: int) -> list[str]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return line.split()[1:]
    return []
