"""Real vLLM (CPU build) on this host: start, serve, stop; and the orphans a SIGKILL leaves.

These pin the facts xpuctl relies on (docs/vllm.md): the process
tree and its titles, drain on SIGTERM with --shutdown-timeout, and that a
SIGKILLed API server leaves EngineCore and its workers running with shm open.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from . import realvllm

pytestmark = pytest.mark.vllm


def _describe(tree: list[realvllm.ProcInfo]) -> str:
    return "\n".join(f"  {p.pid} ppid={p.ppid} {p.state} {p.cmdline[:90]}" for p in tree)


def test_real_vllm_smoke(vllm_server, vllm_timings, request):
    srv = vllm_server("--shutdown-timeout", "10")
    ready = srv.wait_ready()

    status, body = realvllm.http_json(srv.base_url + "/v1/models")
    assert status == 200, body
    ids = [m["id"] for m in body["data"]]
    assert ids == [str(srv.model)]

    status, body = realvllm.http_json(
        srv.base_url + "/v1/completions",
        {"model": ids[0], "prompt": "Hello, world", "max_tokens": 8,
         "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert status == 200, body
    assert isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] == 8

    # The tree: API server (keeps its argv), resource tracker, EngineCore, one worker,
    # all in the session we created, all carrying our token thanks to SPT_NOENV=1.
    tree = srv.tree()
    parts = realvllm.by_title(tree)
    assert [p.pid for p in parts["api"]] == [srv.proc.pid], _describe(tree)
    assert len(parts["engine"]) == 1, _describe(tree)
    assert len(parts["worker"]) == 1, _describe(tree)
    engine, worker = parts["engine"][0], parts["worker"][0]
    assert engine.ppid == srv.proc.pid and worker.ppid == engine.pid, _describe(tree)
    assert {p.sid for p in tree} == {srv.proc.pid}, _describe(tree)
    assert engine.comm == "VLLM::EngineCor"  # comm is cut to 15 bytes
    shm = realvllm.shm_files_open_by(p.pid for p in tree)

    # SIGTERM the top process only; the drain deadline covers the whole tree.
    t0 = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGTERM)  # our own unreaped child: pid cannot be reused
    rc = srv.proc.wait(timeout=60)
    top_exit = time.monotonic() - t0
    gone, _ = realvllm.wait_token_gone(srv.token, timeout=max(0.0, 60 - top_exit))
    tree_gone = time.monotonic() - t0
    left = srv.tree()
    assert gone, f"still alive {tree_gone:.1f} s after SIGTERM:\n{_describe(left)}"
    assert not realvllm.port_is_listening(srv.port)
    log = srv.log_text()
    assert "[shutdown]" in log
    shm_left = sorted(p for p in shm if os.path.exists(p))
    sockets_left = sorted(p for p in srv.sockets_seen if os.path.exists(p))

    vllm_timings[request.node.name] = {
        "ready": ready,
        "sigterm_to_top_exit": top_exit,
        "sigterm_to_tree_gone": tree_gone,
        "top_rc": rc,
        "processes": len(tree),
        "shm_held": len(shm),
        "shm_left_after_stop": len(shm_left),
        "zmq_sockets_bound": len(srv.sockets_seen),
        "zmq_sockets_left_after_stop": len(sockets_left),
        "forced_kill_logged": "force killing" in log,
    }
    assert not shm_left, f"shm left after a clean stop: {shm_left}"


def test_real_vllm_orphans(vllm_server, vllm_timings, request):
    dist_before = realvllm.glob_names("/tmp", "vllm_dist_")
    srv = vllm_server("--shutdown-timeout", "10")
    ready = srv.wait_ready()

    tree = srv.tree()
    parts = realvllm.by_title(tree)
    assert len(parts["engine"]) == 1 and parts["worker"], _describe(tree)
    engine = parts["engine"][0]
    workers = parts["worker"]
    shm = realvllm.shm_files_open_by(p.pid for p in tree)
    assert shm, f"no /dev/shm/psm_* open by the tree:\n{_describe(tree)}"
    worker_pids = {w.pid for w in workers}
    assert any(pids & worker_pids for pids in shm.values()), shm
    dist_new = realvllm.glob_names("/tmp", "vllm_dist_") - dist_before
    assert dist_new, "no new /tmp/vllm_dist_* FileStore while serving"

    # SIGKILL the API server: EngineCore and workers survive as orphans.
    t0 = time.monotonic()
    srv.note_artifacts()  # what the tree holds, noted by inode before the kill
    srv.proc.kill()
    srv.proc.wait(timeout=30)
    time.sleep(3)  # give anything that would notice the death a chance to exit
    orphans = srv.tree()
    alive = {p.pid: p for p in orphans}
    assert engine.pid in alive, f"EngineCore died with the API server:\n{_describe(orphans)}"
    assert worker_pids <= set(alive), f"workers died with the API server:\n{_describe(orphans)}"
    assert alive[engine.pid].ppid != srv.proc.pid
    assert not realvllm.port_is_listening(srv.port), "HTTP port still bound after SIGKILL"
    shm_after = realvllm.shm_files_open_by(alive)
    assert set(shm) <= set(shm_after), (shm, shm_after)
    assert all(os.path.exists(p) for p in dist_new)
    tracker_survived = bool(realvllm.by_title(orphans)["tracker"])

    # SIGTERM to the orphaned EngineCore shuts the rest down.
    assert realvllm.signal_if_token(engine.pid, srv.token, signal.SIGTERM)
    gone, secs = realvllm.wait_token_gone(srv.token, timeout=60)
    assert gone, f"orphans still alive 60 s after SIGTERM:\n{_describe(srv.tree())}"
    time.sleep(0.5)
    shm_left = sorted(p for p in shm if os.path.exists(p))
    dist_left = sorted(p for p in dist_new if os.path.exists(p))
    zombie_state = realvllm.proc_info(engine.pid)

    vllm_timings[request.node.name] = {
        "ready": ready,
        "orphans_alive_after_kill": len(orphans),
        "engine_ppid_after_kill": alive[engine.pid].ppid,
        "tracker_survived": tracker_survived,
        "sigterm_engine_to_gone": secs,
        "kill_to_clean": time.monotonic() - t0,
        "shm_held": len(shm),
        "shm_left": len(shm_left),
        "vllm_dist_left": len(dist_left),
        "engine_after": zombie_state.state if zombie_state else "reaped",
    }
    assert not shm_left, f"orphan shutdown left shm: {shm_left}"
