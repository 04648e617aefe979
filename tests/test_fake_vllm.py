"""Tests of the fake vLLM (tests/fake_vllm/vllm) and of tests/support/proctools.py."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from proctools import (
    FAKE_VLLM,
    StandInRoot,
    cmdline,
    environ,
    free_port,
    holders,
    http_get,
    http_post,
    is_gone,
    metric,
    new_token,
    pids_with_token,
    ppid_of,
    proc_token,  # noqa: F401  (fixture)
    reap_token,
    sid_of,
    standin_root,  # noqa: F401  (fixture)
    start_fake_vllm,
    token_env,
    wait_for,
    wait_log,
)

DRAIN_PHASES = [
    "[shutdown] API server: shutdown triggered",
    "[shutdown] API server: stopping engine client mode=drain timeout=10s",
    "[shutdown] EngineCore: trigger received signal=SIGTERM",
    "[shutdown] EngineCore: start mode=drain timeout=10s",
    "[shutdown] EngineCore: draining in-flight requests count=1",
    "[shutdown] EngineCore: request processing complete; starting resource teardown",
    "XPUWorker shutdown: cleaning up (rank=0, local_rank=0)",
    "XPUWorker shutdown: done (rank=0, local_rank=0)",
    "[shutdown] Executor: all workers exited gracefully",
    "[shutdown] API server: shutting down FastAPI HTTP server",
]


def assert_in_order(log: str, phases: list[str]) -> None:
    pos = 0
    for ph in phases:
        i = log.find(ph, pos)
        assert i >= 0, f"missing (or out of order) {ph!r} after offset {pos}:\n{log}"
        pos = i + len(ph)


def title(pid: int) -> str:
    return (cmdline(pid) or [""])[0]


def tree_roles(fv):
    """(engine_core_pid, [worker pids by rank]) from the live tree below the top process."""
    core = [p for p in fv.tree() if title(p) == "VLLM::EngineCore"]
    assert len(core) == 1, [(p, cmdline(p)) for p in fv.tree()]
    workers = sorted((p for p in fv.tree() if title(p).startswith("VLLM::Worker")), key=title)
    return core[0], workers


def shm_files(root):
    return [f for f in root.shm() if f.startswith("psm_")]


def dist_files(root):
    return [f for f in root.tmp() if f.startswith("vllm_dist_")]


def nobody_holds(root, n):
    return all(not holders(root.node(i)) for i in range(n))


def send_request(fv, seconds, results, chat=False):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    results.append(http_post(fv.url + path, {"model": fv.model, "prompt": "hi",
                                             "fake_seconds": seconds}, timeout=30))


def start_bg_request(fv, seconds):
    results: list = []
    t = threading.Thread(target=send_request, args=(fv, seconds, results), daemon=True)
    t.start()
    assert wait_for(lambda: metric(http_get(fv.url + "/metrics")[1],
                                   "vllm:num_requests_running") == 1.0, 30), fv.log()
    return t, results


# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_drain_tp2(standin_root, proc_token):
    root = standin_root
    fv = start_fake_vllm(proc_token, root, tp=2, shutdown_timeout=10,
                         args=["--max-model-len", "256", "--enforce-eager"],
                         env={"XPUCTL_RUN_ID": "run-123"})
    assert fv.wait_ready(), fv.log()
    log = fv.log()
    assert "non-default args: {" in log and "'shutdown_timeout': 10" in log
    assert f"Starting vLLM API server on http://127.0.0.1:{fv.port}" in log
    assert "world_size=2 rank=1 local_rank=1 distributed_init_method=file://" in log
    assert "backend=xccl" in log and "Application startup complete." in log

    # tree, titles, session, environment
    top = cmdline(fv.pid)
    assert top[1:3] == [str(FAKE_VLLM), "serve"] and os.path.basename(top[1]) == "vllm"
    core, workers = tree_roles(fv)
    assert ppid_of(core) == fv.pid
    assert [title(w) for w in workers] == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert all(ppid_of(w) == core for w in workers)
    assert {sid_of(p) for p in [fv.pid, core, *workers]} == {sid_of(fv.pid)}
    for p in [core, *workers]:
        env = environ(p)
        assert env and env.get("XPUCTL_RUN_ID") == "run-123"
    assert sorted(pids_with_token(proc_token)) == sorted([fv.pid, core, *workers])

    # stand-in devices and artifacts
    assert holders(root.node(0)) == [workers[0]] and holders(root.node(1)) == [workers[1]]
    assert len(shm_files(root)) == 2 and len(dist_files(root)) == 1
    socks = [f for f in root.tmp() if len(f) == 36 and f.count("-") == 4]
    assert len(socks) == 1
    assert http_get(fv.url + "/v1/models")[1].count('"id": "fake-model"') == 1

    # drain: a slow request is running, SIGTERM the top only. The request outlasts the steps
    # below up to the late request (well under a second here) on a slow, loaded machine, and
    # the drain still ends inside the 10 s deadline.
    t, results = start_bg_request(fv, 5)
    text = http_get(fv.url + "/metrics")[1]
    assert 'vllm:num_requests_running{model_name="fake-model"} 1.0' in text
    assert 'vllm:num_requests_waiting{model_name="fake-model"} 0.0' in text
    os.kill(fv.pid, signal.SIGTERM)
    assert wait_log(fv, "draining in-flight requests count=1"), fv.log()
    assert http_get(fv.url + "/health")[0] == 200  # /health stays 200 while draining
    status, body = http_post(fv.url + "/v1/completions", {"prompt": "late"})
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert fv.proc.wait(30) == 0
    t.join(30)
    assert results and results[0][0] == 200, results
    assert results[0][1]["choices"][0]["finish_reason"] == "length"

    log = fv.log()
    assert_in_order(log, DRAIN_PHASES)
    assert "XPUWorker shutdown: done (rank=1, local_rank=1)" in log
    assert "force killing" not in log
    assert wait_for(lambda: all(is_gone(p) for p in [core, *workers]), 15)
    assert shm_files(root) == [] and dist_files(root) == []
    assert len([f for f in root.tmp() if len(f) == 36]) == 1  # uuid socket file left (like vLLM)
    assert nobody_holds(root, 2)
    ev = fv.events()
    assert sorted(e["code"] for e in ev if e["event"] == "exit") == [0, 0, 0, 0]
    assert [e["signal"] for e in ev if e["event"] == "signal"] == ["SIGTERM", "SIGTERM"]


@pytest.mark.slow
def test_sigkill_top_leaves_orphans(standin_root, proc_token):
    root = standin_root
    fv = start_fake_vllm(proc_token, root, tp=2, shutdown_timeout=5)
    assert fv.wait_ready(), fv.log()
    core, workers = tree_roles(fv)
    os.kill(fv.pid, signal.SIGKILL)
    fv.proc.wait(30)
    time.sleep(0.5)
    # EngineCore watches nobody: it and its workers survive, holding devices and files
    assert not is_gone(core) and all(not is_gone(w) for w in workers)
    assert ppid_of(core) != fv.pid
    assert all(ppid_of(w) == core for w in workers)
    assert holders(root.node(0)) == [workers[0]] and holders(root.node(1)) == [workers[1]]
    assert len(shm_files(root)) == 2 and len(dist_files(root)) == 1
    assert http_get(fv.url + "/health", 0.5)[0] is None  # the port is free at once
    # a SIGTERM to the orphaned EngineCore shuts the rest down cleanly
    os.kill(core, signal.SIGTERM)
    assert wait_for(lambda: all(is_gone(p) for p in [core, *workers]), 30), fv.log()
    assert shm_files(root) == [] and dist_files(root) == []
    assert nobody_holds(root, 2)
    ev = fv.events()
    assert {(e["role"], e["code"]) for e in ev if e["event"] == "exit"} == {
        ("engine-core", 0), ("worker", 0)}
    assert not [e for e in ev if e["role"] == "api-server" and e["event"] == "exit"]


@pytest.mark.slow
def test_abort_mode_kills_tree_and_leaves_files(standin_root, proc_token):
    """--shutdown-timeout 0 (vLLM's default): SIGTERM, then at once SIGKILL of the tree."""
    root = standin_root
    fv = start_fake_vllm(proc_token, root, tp=2)
    assert fv.wait_ready(), fv.log()
    assert "shutdown_timeout" not in fv.log().split("non-default args:")[1].split("\n")[0]
    core, workers = tree_roles(fv)
    os.kill(fv.pid, signal.SIGTERM)
    assert fv.proc.wait(30) == 0
    assert wait_for(lambda: all(is_gone(p) for p in [core, *workers]), 15)
    log = fv.log()
    assert "stopping engine client mode=abort timeout=0s" in log
    assert f"force killing remaining process EngineCore pid {core}" in log
    assert "XPUWorker shutdown: done" not in log
    assert len(shm_files(root)) == 2 and len(dist_files(root)) == 1  # the leak xpuctl cleans
    assert nobody_holds(root, 2)


@pytest.mark.slow
def test_shebang_fallback_titles_and_affinity(standin_root, proc_token):
    """Run the script directly (shebang python3); ZE_AFFINITY_MASK=1 selects renderD129.

    If that python3 lacks setproctitle, children are exec'd with argv[0] = title.
    """
    root = standin_root
    port = free_port()
    env = token_env(proc_token, FAKE_VLLM_ROOT=root.root, ZE_AFFINITY_MASK="1",
                    VLLM_PROCESS_NAME_PREFIX="VLLMX")
    log_path = os.path.join(root.root, "direct.log")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([str(FAKE_VLLM), "serve", "m", "--port", str(port),
                                 "--shutdown-timeout", "5"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    assert wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health", 0.5)[0] == 200, 60), \
        Path(log_path).read_text()
    kids = [p for p in pids_with_token(proc_token) if p != proc.pid]
    titles = sorted(title(p) for p in kids)
    assert titles == ["VLLMX::EngineCore", "VLLMX::Worker"], [cmdline(p) for p in kids]
    worker = next(p for p in kids if title(p) == "VLLMX::Worker")
    with open(f"/proc/{worker}/comm") as f:
        assert f.read().strip() == "VLLMX::Worker"
    assert holders(root.node(1)) == [worker] and holders(root.node(0)) == []
    assert "vllm" in os.path.basename(cmdline(proc.pid)[1]) and cmdline(proc.pid)[2] == "serve"
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 0
    assert wait_for(lambda: all(is_gone(p) for p in kids), 15)


@pytest.mark.slow
def test_missing_device_node_is_tolerated(standin_root, proc_token):
    fv = start_fake_vllm(proc_token, standin_root, tp=1, shutdown_timeout=5,
                         env={"ZE_AFFINITY_MASK": "7"})
    assert fv.wait_ready(), fv.log()
    assert "renderD135" in fv.log() and "continuing without a device" in fv.log()
    os.kill(fv.pid, signal.SIGTERM)
    assert fv.proc.wait(30) == 0


@pytest.mark.slow
def test_sigterm_to_worker_takes_the_server_down(standin_root, proc_token):
    """A worker exits on SIGTERM (after teardown); EngineCore fails, the API server follows."""
    root = standin_root
    fv = start_fake_vllm(proc_token, root, tp=2, shutdown_timeout=5,
                         env={"FAKE_VLLM_ENGINE_DEAD_EXIT_S": "0.2"})
    assert fv.wait_ready(), fv.log()
    core, (w0, w1) = tree_roles(fv)
    os.kill(w1, signal.SIGTERM)
    assert fv.proc.wait(30) == 1
    assert wait_for(lambda: all(is_gone(p) for p in (core, w0, w1)), 15)
    log = fv.log()
    assert_in_order(log, ["XPUWorker shutdown: done (rank=1, local_rank=1)",
                          "Worker proc VllmWorker-1 died unexpectedly (exit code: 0)",
                          "XPUWorker shutdown: done (rank=0, local_rank=0)",
                          "[shutdown] MPClient: engine core exited unexpectedly"])
    assert shm_files(root) == [] and len(dist_files(root)) == 1 and nobody_holds(root, 2)


@pytest.mark.slow
def test_group_sigterm_tears_down_in_parallel(standin_root, proc_token):
    """killpg(SIGTERM) (Ctrl-C style) reaches everyone; still a clean exit."""
    root = standin_root
    fv = start_fake_vllm(proc_token, root, tp=2, shutdown_timeout=5)
    assert fv.wait_ready(), fv.log()
    core, workers = tree_roles(fv)
    os.killpg(fv.pid, signal.SIGTERM)  # started with start_new_session: pgid == top pid
    assert fv.proc.wait(30) == 0
    assert wait_for(lambda: all(is_gone(p) for p in [core, *workers]), 15)
    assert "died unexpectedly" not in fv.log()
    ev = fv.events()
    got = sorted((e["role"], e["rank"] or 0) for e in ev if e["event"] == "signal")
    # EngineCore gets the group's SIGTERM and then the API server's own (ignored). Standard
    # signals do not queue: when the second arrives before the first was handled (a loaded
    # machine), the kernel merges them and one is recorded.
    engine = [g for g in got if g[0] == "engine-core"]
    assert 1 <= len(engine) <= 2, got
    assert [g for g in got if g[0] != "engine-core"] == [("api-server", 0), ("worker", 0), ("worker", 1)]
    assert sorted(e["code"] for e in ev if e["event"] == "exit") == [0, 0, 0, 0]
    assert shm_files(root) == [] and dist_files(root) == [] and nobody_holds(root, 2)


# ---------------------------------------------------------------------------------------------
# fault modes


@pytest.mark.slow
def test_fault_ignore_sigterm(standin_root, proc_token):
    fv = start_fake_vllm(proc_token, standin_root, tp=1, shutdown_timeout=5,
                         env={"FAKE_VLLM_FAULTS": "ignore-sigterm"})
    assert fv.wait_ready(), fv.log()
    os.kill(fv.pid, signal.SIGTERM)
    os.kill(fv.pid, signal.SIGINT)

    def sigs():
        return sorted(e["signal"] for e in fv.events() if e["event"] == "signal")

    # both pending: the kernel delivers SIGINT first; both are recorded, then ignored
    assert wait_for(lambda: sigs() == ["SIGINT", "SIGTERM"], 30), sigs()
    time.sleep(0.5)  # a chance to misbehave after the handlers ran
    assert fv.proc.poll() is None and http_get(fv.url + "/health")[0] == 200
    assert "[shutdown]" not in fv.log()
    core, workers = tree_roles(fv)
    os.kill(fv.pid, signal.SIGKILL)
    fv.proc.wait(30)
    assert not is_gone(core)  # and the SIGKILL leaves orphans, as usual
    reap_token(proc_token)
    assert all(is_gone(p) for p in [core, *workers])


@pytest.mark.slow
def test_fault_slow_teardown_hits_deadline(standin_root, proc_token):
    root = standin_root
    # the deadline (12 s) must fall after the test's own steps below (about a second here),
    # and before EngineCore's own grace for its workers ends (60 s here, 5 s by default)
    fv = start_fake_vllm(proc_token, root, tp=2, shutdown_timeout=12,
                         env={"FAKE_VLLM_FAULTS": "slow-teardown", "FAKE_VLLM_TEARDOWN_S": "120",
                              "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"})
    assert fv.wait_ready(), fv.log()
    core, (w0, w1) = tree_roles(fv)
    os.kill(fv.pid, signal.SIGTERM)
    assert wait_log(fv, "XPUWorker shutdown: cleaning up (rank=1, local_rank=1)"), fv.log()
    os.kill(w0, signal.SIGTERM)  # first SIGTERM during the teardown: ignored
    os.kill(w1, signal.SIGTERM)
    time.sleep(0.3)
    assert not is_gone(w0) and not is_gone(w1)
    os.kill(w1, signal.SIGTERM)  # a second one ends the teardown (dies by the signal)
    assert wait_for(lambda: is_gone(w1), 15)
    assert fv.proc.wait(60) == 0  # deadline (12 s) hits: kill_process_tree
    assert wait_for(lambda: all(is_gone(p) for p in (core, w0, w1)), 15)
    log = fv.log()
    assert f"[shutdown] Process manager: force killing remaining process EngineCore pid {core}" in log
    assert "XPUWorker shutdown: done" not in log
    assert len(shm_files(root)) == 2 and len(dist_files(root)) == 1
    ev = fv.events()
    assert [e["code"] for e in ev if e["event"] == "exit" and e["role"] == "worker"] == [-15]
    assert not [e for e in ev if e["event"] == "exit" and e["role"] == "engine-core"]  # SIGKILLed
    assert nobody_holds(root, 2)


@pytest.mark.slow
def test_fault_hang_startup(standin_root, proc_token):
    root = standin_root
    fv = start_fake_vllm(proc_token, root, tp=2, shutdown_timeout=1,
                         env={"FAKE_VLLM_FAULTS": "hang-startup", "FAKE_VLLM_STARTUP_S": "0.1"})
    assert wait_for(lambda: fv.log().count("backend=xccl") == 2, 60), fv.log()
    time.sleep(1.0)
    assert http_get(fv.url + "/health", 0.5)[0] is None  # never ready
    assert "Application startup complete." not in fv.log()
    core, workers = tree_roles(fv)
    # vLLM retitles to Worker_TP<r> only after init: a hung worker is still "VLLM::Worker"
    assert [title(w) for w in workers] == ["VLLM::Worker"] * 2
    held = holders(root.node(0)) + holders(root.node(1))  # hung workers hold the devices
    assert sorted(held) == sorted(workers)
    os.kill(workers[0], signal.SIGTERM)  # stuck in a collective: SIGTERM does nothing
    time.sleep(0.3)
    assert not is_gone(workers[0])
    os.kill(fv.pid, signal.SIGTERM)  # during start-up: abort init, deadline 1 s, kill tree
    assert fv.proc.wait(30) == 1
    assert wait_for(lambda: all(is_gone(p) for p in [core, *workers]), 15)
    assert "force killing remaining process EngineCore" in fv.log()
    assert nobody_holds(root, 2)


@pytest.mark.slow
def test_fault_setsid_worker(standin_root, proc_token):
    root = standin_root
    fv = start_fake_vllm(proc_token, root, tp=2, shutdown_timeout=5,
                         env={"FAKE_VLLM_FAULTS": "setsid-worker"})
    assert fv.wait_ready(), fv.log()
    status, body = http_post(fv.url + "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    core, (w0, w1) = tree_roles(fv)
    assert sid_of(w0) == w0 != sid_of(fv.pid)
    assert sid_of(w1) == sid_of(core) == sid_of(fv.pid)
    assert ppid_of(w0) == core
    os.kill(fv.pid, signal.SIGTERM)  # still a child of EngineCore: the death pipe still works
    assert fv.proc.wait(30) == 0
    assert wait_for(lambda: all(is_gone(p) for p in (core, w0, w1)), 15)
    assert shm_files(root) == [] and nobody_holds(root, 2)


def _crash_engine(token, root, tmp_path, tp, faults, dead_exit_s):
    """A ready fake vLLM with the crash-engine fault, its engine told to crash now: (the
    fake, its EngineCore pid, its worker pids)."""
    crash = tmp_path / "crash-now"
    fv = start_fake_vllm(token, root, tp=tp, shutdown_timeout=5,
                         env={"FAKE_VLLM_FAULTS": faults, "FAKE_VLLM_CRASH_FILE": str(crash),
                              "FAKE_VLLM_ENGINE_DEAD_EXIT_S": dead_exit_s})
    assert fv.wait_ready(), fv.log()
    core, workers = tree_roles(fv)
    crash.touch()
    return fv, core, workers


@pytest.mark.slow
def test_fault_crash_engine(standin_root, proc_token, tmp_path):
    root = standin_root
    fv, core, workers = _crash_engine(proc_token, root, tmp_path, tp=2, faults="crash-engine",
                                      dead_exit_s="5")
    assert wait_log(fv, "[shutdown] MPClient: engine core exited unexpectedly"), fv.log()
    assert http_get(fv.url + "/health")[0] == 503
    status, _ = http_post(fv.url + "/v1/completions", {"prompt": "x"})
    assert status == 500
    assert fv.proc.wait(30) == 1
    assert wait_for(lambda: all(is_gone(p) for p in [core, *workers]), 15)
    ev = fv.events()
    assert [e["code"] for e in ev if e["event"] == "exit" and e["role"] == "engine-core"] == [1]
    assert [e["code"] for e in ev if e["event"] == "exit" and e["role"] == "worker"] == [0, 0]
    assert shm_files(root) == []  # workers saw the death pipe and cleaned up
    assert len(dist_files(root)) == 1  # the dead engine left its FileStore file
    assert nobody_holds(root, 2)


@pytest.mark.slow
def test_fault_worker_ignores_sigterm(standin_root, proc_token):
    root = standin_root
    fv = start_fake_vllm(proc_token, root, tp=2, shutdown_timeout=5,
                         env={"FAKE_VLLM_FAULTS": "worker-ignores-sigterm"})
    assert fv.wait_ready(), fv.log()
    core, (w0, w1) = tree_roles(fv)
    os.kill(w0, signal.SIGTERM)
    os.kill(w0, signal.SIGINT)

    def sigs():
        return sorted(e["signal"] for e in fv.events() if e["event"] == "signal")

    assert wait_for(lambda: sigs() == ["SIGINT", "SIGTERM"], 30), sigs()
    time.sleep(0.5)  # a chance to misbehave after the handlers ran
    assert not is_gone(w0) and http_get(fv.url + "/health")[0] == 200
    os.kill(fv.pid, signal.SIGTERM)  # the death pipe still stops them
    assert fv.proc.wait(30) == 0
    assert wait_for(lambda: all(is_gone(p) for p in (core, w0, w1)), 15)
    assert "[shutdown] Executor: all workers exited gracefully" in fv.log()
    assert shm_files(root) == [] and nobody_holds(root, 2)


# ---------------------------------------------------------------------------------------------
# proctools


def test_reaper_only_kills_token_carriers():
    tok = new_token()
    mine = subprocess.Popen(["sleep", "60"], env=token_env(tok))
    other = subprocess.Popen(["sleep", "60"], env=token_env(new_token()))
    plain = subprocess.Popen(["sleep", "60"])
    try:
        assert wait_for(lambda: pids_with_token(tok) == [mine.pid], 30)
        assert reap_token(tok) == [mine.pid]
        assert mine.wait(30) == -signal.SIGKILL
        assert other.poll() is None and plain.poll() is None
        assert pids_with_token(tok) == []
    finally:
        for p in (mine, other, plain):
            p.kill()
            p.wait()


def test_standin_root_layout(tmp_path):
    with StandInRoot(tmp_path, n_devices=2) as r:
        R = r.root
        assert os.path.realpath(os.path.join(R, "proc")) == "/proc"
        assert len(os.path.join(R, "tmp", "0" * 36)) <= 107
        assert r.node(1) == os.path.join(R, "dev/dri/renderD129") and os.path.isfile(r.node(1))
        assert (r.bdf(0), r.bdf(1)) == ("0000:03:00.0", "0000:04:00.0")
        cls = os.path.join(R, "sys/class/drm/renderD129")
        assert Path(os.path.join(cls, "dev")).read_text() == "226:129\n"
        dev = os.path.realpath(os.path.join(cls, "device"))
        assert dev == os.path.realpath(os.path.join(R, "sys/devices/pci0000:00/0000:04:00.0"))
        assert Path(os.path.join(dev, "vendor")).read_text() == "0x8086\n"
        assert Path(os.path.join(dev, "device")).read_text() == "0xe20b\n"
        drv = os.path.join(dev, "driver")
        assert os.readlink(drv) == "../../../bus/pci/drivers/xe"
        assert os.path.realpath(drv) == os.path.realpath(os.path.join(R, "sys/bus/pci/drivers/xe"))
        assert os.path.isdir(os.path.join(R, "dev/shm"))
    assert not os.path.exists(R)


def test_fault_exit_0_on_engine_death(standin_root, proc_token, tmp_path):
    """vLLM #48966: the engine dies, the API server shuts uvicorn down and exits 0."""
    root = standin_root
    fv, core, workers = _crash_engine(proc_token, root, tmp_path, tp=1,
                                      faults="crash-engine,exit-0-on-engine-death", dead_exit_s="0.2")
    assert fv.proc.wait(30) == 0, fv.log()
    log = fv.log()
    assert "Engine core proc EngineCore_0 died unexpectedly, shutting down client." in log
    assert log.rstrip().endswith(f"Finished server process [{fv.proc.pid}]"), log
    assert wait_for(lambda: all(is_gone(p) for p in [core, *workers]), 15)
    assert nobody_holds(root, 1)
