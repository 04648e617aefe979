"""serve's start-up phases (one table for the live view, the diagnosis and `last-run`), the
views, the relaunch advice and its probe. Pure or on temporary state directories."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xpuctl.core import advice
from xpuctl.core.checks import REGISTRY, last_run_findings
from xpuctl.output import progress
from xpuctl.parse import vllmlog
from xpuctl.state import lastrun

# vLLM 0.32.0 (CPU build) on this machine, in order (issue 12); XPU logs backend=xccl
REAL_0_32 = [
    "(APIServer pid=1) INFO 12-01 10:00:00 [utils.py:233] non-default args: {'model': '/m'}",
    ("(EngineCore pid=2) INFO 12-01 10:00:03 [core.py:95] Initializing a V1 LLM engine (v0.32.0) "
     "with config: model='/m', speculative_config=None, tokenizer='/m', kv_cache_dtype=auto"),
    ("(EngineCore pid=2) INFO 12-01 10:00:05 [parallel_state.py:1200] world_size=1 rank=0 "
     "local_rank=0 distributed_init_method=tcp://127.0.0.1:41234 backend=gloo"),
    "(EngineCore pid=2) INFO 12-01 10:00:06 [cpu_model_runner.py:80] Starting to load model /m...",
    "(EngineCore pid=2) INFO 12-01 10:00:06 [default_loader.py:300] Loading weights took 0.00 seconds",
    "(EngineCore pid=2) INFO 12-01 10:00:07 [cpu.py:150] Auto set (1.00/16.0) GiB for KV cache on node 0",
    ("(EngineCore pid=2) INFO 12-01 10:00:09 [core.py:250] init engine (profile, create kv cache, "
     "warmup model) took 1.83 s"),
    ("(APIServer pid=1) INFO 12-01 10:00:10 [api_server.py:1900] Starting vLLM server on "
     "http://0.0.0.0:18555"),
]


def test_the_0_32_lines_name_the_phases_in_order():
    got = [p.key for p in map(vllmlog.phase_of, REAL_0_32) if p is not None]
    assert got == ["engine", "distributed", "loading", "profiling", "profiling", "http", "http"]
    assert vllmlog.phase_of(REAL_0_32[2].replace("backend=gloo", "backend=xccl")).key == "oneccl"
    ranks = [vllmlog.BY_KEY[k].rank for k in got]
    assert ranks == sorted(ranks)
    assert vllmlog.furthest_phase(REAL_0_32[:4]).key == "loading"
    assert vllmlog.furthest_phase(REAL_0_32[:1]) is vllmlog.STARTING


def test_short_line_drops_vllms_prefix():
    assert vllmlog.short_line(REAL_0_32[3]) == "EngineCore: Starting to load model /m..."
    assert vllmlog.short_line("WARNING 12-01 10:00:00 [x.py:1] careful") == "WARNING careful"
    assert vllmlog.short_line("plain text [x]") == "plain text [x]"


def test_tracker_moves_forward_only_and_times_each_phase():
    t = progress.Tracker(100.0)
    xccl = REAL_0_32[2].replace("backend=gloo", "backend=xccl")
    assert t.feed(REAL_0_32[1], 101.0).key == "engine"
    assert t.feed(xccl, 103.0).key == "oneccl"
    # a second TP rank logging its (earlier) world_size line does not move the start back
    assert t.feed(REAL_0_32[2], 103.5) is None and t.phase.key == "oneccl"
    assert t.feed(REAL_0_32[3], 110.0).key == "loading"
    assert t.feed("some unknown line", 111.0) is None and t.last_line == "some unknown line"
    t.ready(120.0)
    assert t.phase is vllmlog.READY
    assert t.spent == [("starting", 1.0), ("engine start", 2.0), ("oneCCL init (xccl)", 7.0),
                       ("loading model", 10.0)]
    assert t.summary() == ("starting 1.0s, engine start 2.0s, oneCCL init (xccl) 7.0s, "
                           "loading model 10.0s")


def test_an_unknown_version_stays_starting_with_its_last_line():
    t = progress.Tracker(0.0)
    for i, line in enumerate(["booting the thing", "still booting", ""]):
        assert t.feed(line, float(i)) is None
    assert t.phase is vllmlog.STARTING and t.last_line == "still booting"


def test_plain_view_one_line_per_phase_no_control_characters():
    err = io.StringIO()
    v = progress.PlainView(err, "r1")
    v.line("whatever \x1b[31m")
    v.phase(1.25, "engine start")
    v.tick()
    v.phase(3.5, "loading model")
    v.ready("xpuctl: r1 is ready")
    assert err.getvalue().splitlines() == ["xpuctl: r1:    1.2s engine start",
                                           "xpuctl: r1:    3.5s loading model",
                                           "xpuctl: r1 is ready"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_view_redraws_one_line_and_ends_with_the_summary(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    err = _Tty()
    v = progress.LiveView(err, "r1")
    v.MIN_REDRAW = 0.0
    v.phase(0.5, "engine start")
    v.line("a vLLM line with an escape \x1b]0;title\x07 and more text " + "x" * 100)
    v.say("xpuctl: a message")
    v.tick()
    v.ready("xpuctl: r1 is ready on port 1 after 2.0s: engine start 1.0s")
    v.tick()  # after ready: nothing more is drawn
    out = err.getvalue()
    frames = out.split("\r\x1b[2K")
    assert len(frames) >= 4
    status = [f for f in frames if f.startswith("xpuctl: r1 ")]
    assert status and all(len(f.split("\n")[0]) <= 59 for f in status), status
    assert "\x07" not in out and "\x1b]" not in out  # vLLM's text is escaped (safetext)
    assert "xpuctl: a message\n" in out
    assert out.endswith("xpuctl: r1 is ready on port 1 after 2.0s: engine start 1.0s\n")


def test_live_view_finish_leaves_no_status_line():
    err = _Tty()
    v = progress.LiveView(err, "r1")
    v.tick()
    v.finish()
    v.say("xpuctl: r1 was not ready in time")
    assert err.getvalue().endswith("\r\x1b[2Kxpuctl: r1 was not ready in time\n")


def test_choose_picks_by_terminal_and_quiet():
    assert isinstance(progress.choose(io.StringIO(), "n", quiet=False), progress.PlainView)
    assert isinstance(progress.choose(_Tty(), "n", quiet=True), progress.QuietView)
    assert isinstance(progress.choose(_Tty(), "n", quiet=False), progress.LiveView)


def test_pipe_sink_replays_into_a_view():
    r, w = os.pipe()
    logged: list[str] = []
    sink = progress.PipeSink(w, logged.append)
    sink.say("xpuctl: hello")
    sink.phase(1.0, "engine start")
    sink.line("last line")
    sink.ready("xpuctl: ready")
    sink.end("ready")
    sink.say("after the end: only logged")
    err = io.StringIO()
    assert progress.replay(r, progress.PlainView(err, "n")) == "ready"
    os.close(r)
    assert err.getvalue().splitlines() == ["xpuctl: hello", "xpuctl: n:    1.0s engine start",
                                           "xpuctl: ready"]
    assert logged[-1] == "after the end: only logged"


def test_replay_reports_a_supervisor_that_died():
    r, w = os.pipe()
    os.write(w, b'["say", "x"]\nnot json\n')
    os.close(w)
    assert progress.replay(r, progress.QuietView(io.StringIO(), "n")) == ""
    os.close(r)


# -- relaunch advice ------------------------------------------------------------------------

SIGNATURE_LINES = {
    "ipc-handle": "(Worker_TP1 pid=9) ERROR 12-01 [xpu_worker.py:1] |CCL_ERROR| ze_call.cpp:43 "
                  "do_call: ze error at zeMemOpenIpcHandle, code: ZE_RESULT_ERROR_INVALID_ARGUMENT",
    "kvs": "(Worker_TP0 pid=8) ERROR 12-01 [xpu_worker.py:1] |CCL_ERROR| internal_kvs.cpp:529 "
           "kvs_init: connection to KVS server failed: connection refused",
    "device-lost": "(Worker_TP0 pid=8) ERROR 12-01 [xpu_worker.py:1] RuntimeError: level_zero "
                   "backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)",
}


@pytest.mark.parametrize("key", sorted(SIGNATURE_LINES))
def test_each_signature_is_found(key):
    lines = [REAL_0_32[0], SIGNATURE_LINES[key], "later line"]
    sigs = vllmlog.hang_signatures(lines, ever_ready=True)
    assert [s.key for s in sigs] == [key] and sigs[0].line == SIGNATURE_LINES[key].strip()


def test_stuck_after_xccl_only_when_never_ready():
    xccl = REAL_0_32[2].replace("backend=gloo", "backend=xccl")
    lines = REAL_0_32[:2] + [xccl]
    assert [s.key for s in vllmlog.hang_signatures(lines, ever_ready=False)] == ["xccl-stuck"]
    assert vllmlog.hang_signatures(lines, ever_ready=True) == []
    # a start that got past the warm-up is not stuck in it
    assert vllmlog.hang_signatures(lines + REAL_0_32[3:5], ever_ready=False) == []
    assert vllmlog.hang_signatures(["kv cache usage 0.1, KVS-less line"], ever_ready=True) == []


def test_every_signature_has_mitigations_each_with_a_cost():
    for key in ("not-ready", "xccl-stuck", "ipc-handle", "kvs", "device-lost"):
        ms = advice.mitigations([key])
        assert ms and all(m.cost for m in ms), key
    settings = [m.setting for m in advice.mitigations(["xccl-stuck"])]
    for wanted in ("CCL_ALLREDUCE=ring", "CCL_ZE_IPC_EXCHANGE=drmfd|sockets", "CCL_KVS_IFACE=lo"):
        assert wanted in settings


def _state_dir(tmp_path: Path) -> Path:
    sd = tmp_path / "state"
    for sub in ("runs", "logs", "locks"):
        (sd / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(sd, 0o700)
    return sd


def write_run(sd: Path, name: str, lines: list[str], state: str = "stopped",
              notes: list[str] = (), ready_at: float | None = None, mtime: float | None = None):
    rec = {"name": name, "run_id": "0" * 16, "pid": None, "start_ticks": None, "session": None,
           "command": ["vllm", "serve", "m"], "devices": [], "port": 8000, "host": "127.0.0.1",
           "shutdown_timeout": 30, "drain_timeout": 20, "teardown_timeout": 10,
           "log_path": "/nonexistent/elsewhere.log", "state": state, "notes": list(notes),
           "ready_at": ready_at, "started_at": time.time() - 60, "stopped_at": time.time()}
    path = sd / "runs" / f"{name}.json"
    path.write_text(json.dumps(rec))
    (sd / "logs" / f"{name}.log").write_text("\n".join(lines) + "\n")
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def test_probe_reads_only_the_newest_run(tmp_path):
    sd = _state_dir(tmp_path)
    write_run(sd, "old", [SIGNATURE_LINES["kvs"]], mtime=time.time() - 100)
    write_run(sd, "new", REAL_0_32, ready_at=time.time() - 30)
    lr = lastrun.last_run(str(sd))
    assert lr.name == "new" and lr.signatures == () and not lr.not_ready
    assert lr.log_path == str(sd / "logs" / "new.log")  # by name, not the record's path
    assert last_run_findings(lr) == []
    assert lastrun.last_run(str(tmp_path / "missing")) is None
    assert lastrun.last_run(None) is None


def test_probe_reads_only_the_tail_of_a_long_log(tmp_path):
    sd = _state_dir(tmp_path)
    filler = ["(APIServer pid=1) INFO 12-01 request done " + "y" * 100] * 2000
    write_run(sd, "big", [SIGNATURE_LINES["device-lost"]] + filler + [SIGNATURE_LINES["kvs"]],
              ready_at=time.time())
    lr = lastrun.last_run(str(sd))
    assert [s.key for s in lr.signatures] == ["kvs"]  # the early line is beyond the tail


def test_not_ready_run_gives_a_warn_finding_with_the_mitigations(tmp_path):
    sd = _state_dir(tmp_path)
    xccl = REAL_0_32[2].replace("backend=gloo", "backend=xccl")
    write_run(sd, "hung", REAL_0_32[:2] + [xccl, "xpuctl: not ready after 6s; stuck in: x"],
              state="failed", notes=["not ready after 6s: oneCCL init (xccl)"])
    lr = lastrun.last_run(str(sd))
    assert lr.not_ready and lr.phase == "oneCCL init (xccl)"
    assert [s.key for s in lr.signatures] == ["xccl-stuck"]
    (f,) = last_run_findings(lr)
    assert f.check == "last-run" and f.severity == "warn"
    assert "hung was not ready in time (stuck in: oneCCL init (xccl))" in f.message
    for wanted in ("CCL_ALLREDUCE=ring", "CCL_ZE_IPC_EXCHANGE=drmfd|sockets", "CCL_KVS_IFACE=lo",
                   "cost:"):
        assert wanted in f.remedy
    assert "last-run" in REGISTRY


def test_a_live_start_is_not_flagged_as_stuck(tmp_path):
    sd = _state_dir(tmp_path)
    xccl = REAL_0_32[2].replace("backend=gloo", "backend=xccl")
    write_run(sd, "now", REAL_0_32[:2] + [xccl], state="starting")
    assert last_run_findings(lastrun.last_run(str(sd))) == []


def _xpuctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("XPUCTL_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "xpuctl", *args], capture_output=True,
                          text=True, timeout=60, env=e, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("key", sorted(SIGNATURE_LINES))
def test_doctor_and_reset_show_last_run_for_each_signature(tmp_path, key):
    sd = _state_dir(tmp_path)
    write_run(sd, f"r-{key}", REAL_0_32 + [SIGNATURE_LINES[key]], ready_at=time.time() - 50)
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "sys/class/drm").mkdir(parents=True)
    (root / "dev/dri").mkdir(parents=True)
    p = _xpuctl("--root", str(root), "doctor", "--json", "--state-dir", str(sd))
    found = [f for f in json.loads(p.stdout)["findings"] if f["check"] == "last-run"]
    assert len(found) == 1 and found[0]["severity"] == "warn", p.stdout
    assert SIGNATURE_LINES[key][:60] in found[0]["message"]
    assert found[0]["remedy"].startswith("before the next launch, try")
    # the table escapes the quoted log line (no rich markup eaten, no escapes passed)
    t = _xpuctl("--root", str(root), "doctor", "--state-dir", str(sd), env={"COLUMNS": "400"})
    assert "WARN last-run" in t.stdout and "[xpu_worker.py:1]" in t.stdout, t.stdout
    # a re-rooted host reads no state directory unless one is named
    p2 = _xpuctl("--root", str(root), "doctor", "--json")
    assert not [f for f in json.loads(p2.stdout)["findings"] if f["check"] == "last-run"]
    r = _xpuctl("--root", str(root), "reset", "--dry-run", "--state-dir", str(sd))
    assert r.returncode == 0, r.stderr
    assert "warn last-run: the last run r-" in r.stdout and "cost:" in r.stdout, r.stdout
    rj = _xpuctl("--root", str(root), "reset", "--dry-run", "--json", "--state-dir", str(sd))
    assert [a["check"] for a in json.loads(rj.stdout)["plan"]["advice"]] == ["last-run"]


def test_a_tree_that_never_became_ready_gets_the_teardown_budget_only():
    from xpuctl.actions.signals import Target
    from xpuctl.shutdown.ladder import DRAIN_MARGIN, exit_budget
    from xpuctl.shutdown.targets import ServerTree
    from xpuctl.state.runs import RunRecord

    rec = RunRecord(name="r", run_id="1" * 16, pid=10, start_ticks=1, session=10, command=[],
                    devices=[], port=8000, bind="127.0.0.1", shutdown_timeout=50,
                    drain_timeout=40, teardown_timeout=7, log_path="/x", state="starting")
    top = Target(10, 1, "api-server")
    ready = ServerTree(top=top, role="api-server", orphan=False, shutdown_timeout=50, record=rec)
    assert exit_budget(ready) == 50 + DRAIN_MARGIN
    assert exit_budget(ServerTree(
        top=top, role="api-server", orphan=False, shutdown_timeout=50, record=rec,
        never_ready=True)) == 7
