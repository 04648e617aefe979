"""xpuctl driving real vLLM (CPU build): serve --detach, shutdown with requests in flight,
and the orphans a SIGKILLed API server leaves (doctor finds them, shutdown removes them).

Every xpuctl process runs with a unique XPUCTL_TEST_TOKEN in its environment; xpuctl hands
its environment to vLLM, so the token marks exactly our supervisor and vLLM tree. Only
those are ever signalled, and the fixture SIGKILLs whatever is left, even on failure.

The detached supervisor is a child subreaper: when its API server is SIGKILLed the orphans
reparent to it, and after --teardown-timeout it SIGTERMs them itself. The orphan test serves
with a teardown timeout (ORPHAN_TEARDOWN_S) far longer than its doctor and shutdown need on
a slow, loaded machine, so the orphans are still there for them to find;
`supervisor_escalated` in the timings says whether the supervisor got there first anyway.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from . import realvllm, workload
from .xpuctl_run import XpuctlRun, in_flight

pytestmark = pytest.mark.vllm

# The drain test sizes its in-flight work from the server under test (workload.py): a
# calibration completion of one full batch gives the decode rate, a `shutdown --dry-run`
# timed while that batch runs gives xpuctl's own time to a decision under load, and two
# requests of n x MAX_TOKENS sequences are sized to last max(40 s, 4 x that) at the
# measured rate (at most DRAIN_S / 4). The drain budget is several times the work, so
# vLLM's own deadline (drain + teardown) never cuts the drain: with a fixed n=384 and a
# 40 s deadline, a machine twice as slow lost its requests (issue 8).
DRAIN_S, TEARDOWN_S = 240, 10
MAX_TOKENS = 240
N_REQUESTS = 2
BATCH = 128  # --max-num-seqs: the calibration fills one batch (the batch the drain work runs at)
CALIB_TOKENS = 128  # tokens per sequence of the calibration (about 7 s of work here)
MIN_SEQS = 8  # below a full batch the work lasts at least MAX_TOKENS decode steps anyway
# The orphan test's window between the API server's death and the supervisor's own SIGTERM
# to the orphans: doctor, a dry run and the shutdown must fit in it (a few seconds here).
ORPHAN_TEARDOWN_S = 120
# vLLM's own count of what it drains, logged when its EngineCore gets the SIGTERM
DRAINING_RE = re.compile(r"\[shutdown\] EngineCore: draining in-flight requests count=(\d+)")
# Set to 1 to stop the orphans with a real `shutdown --all` (only when the dry run lists
# nothing but ours): it would also stop any other vLLM tree started meanwhile on this host.
ALLOW_ALL_VAR = "XPUCTL_REAL_VLLM_SHUTDOWN_ALL"


def _cmdline(pid: int) -> list[str]:
    raw = realvllm._read(f"/proc/{pid}/cmdline") or b""
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _environ(pid: int) -> dict[str, str]:
    raw = realvllm._read(f"/proc/{pid}/environ") or b""
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.decode(errors="replace").partition("=")
        if sep:
            out[k] = v
    return out


def _served_ok(run: XpuctlRun) -> dict:
    sr = run.serve_result
    # another vLLM tree on this host (orphans, a server on our device): serve's preflight
    # refuses, and the test fails saying so; nothing of that tree is ever signalled
    refused = sr is not None and sr.rc == 1 and "preflight failed" in sr.stderr
    assert not refused, (
        "another vLLM tree is already on this host: xpuctl serve's preflight refused to start "
        "(this test never stops processes it did not start; stop them, then re-run):\n"
        f"{sr.describe()}")
    assert sr is not None and sr.rc == 0, (
        f"xpuctl serve did not come up:\n{sr.describe() if sr else '-'}\n"
        f"--- log tail\n{run.log_tail()}"
    )
    rec = run.record()
    assert rec["state"] == "ready", rec
    assert rec["pid"] and rec["supervisor_pid"], rec
    return rec


def _tree_roles(run: XpuctlRun, rec: dict) -> dict[str, list[realvllm.ProcInfo]]:
    parts = run.parts()
    tree = run.describe_tree()
    assert [p.pid for p in parts["api"]] == [rec["pid"]], tree
    assert [p.pid for p in parts["supervisor"]] == [rec["supervisor_pid"]], tree
    assert len(parts["engine"]) == 1 and len(parts["worker"]) == 1, tree
    return parts


def _vllm_lines(events: list[dict]) -> list[str]:
    return [e["detail"] for e in events if e["phase"] == "vllm" and "[shutdown]" in e["detail"]]


def _echoed_phases(events: list[dict], log_text: str) -> dict[str, tuple[int, int]]:
    """Timeline `vllm` phases seen more often than vLLM itself logged them:
    detail -> (times in the timeline, times in vLLM's own log lines)."""
    own = [ln for ln in log_text.splitlines() if not ln.startswith("xpuctl:")]
    counts: dict[str, int] = {}
    for d in _vllm_lines(events):
        counts[d] = counts.get(d, 0) + 1
    out = {}
    for detail, n in counts.items():
        logged = sum(1 for ln in own if detail in ln)
        if n > logged:
            out[detail] = (n, logged)
    return out


def _wait(pred, timeout: float, poll: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(poll)
    return pred()


def _gone(pid: int, start_cmd: str) -> bool:
    """pid no longer runs the process we knew (exited, a zombie, or reused)."""
    info = realvllm.proc_info(pid)
    return info is None or info.zombie or info.cmdline != start_cmd


# --------------------------------------------------------------------------------------


def test_xpuctl_shutdown_drains_inflight(xpuctl_serve, vllm_timings, request, vllm_log):
    run = xpuctl_serve(drain=DRAIN_S, teardown=TEARDOWN_S,
                       vllm_args=("--max-num-seqs", str(BATCH)))
    rec = _served_ok(run)
    parts = _tree_roles(run, rec)
    api, engine = parts["api"][0], parts["engine"][0]

    # serve forced the drain deadline: drain + teardown, passed to vLLM exactly once
    argv = _cmdline(api.pid)
    assert argv.count("--shutdown-timeout") == 1, argv
    assert argv[argv.index("--shutdown-timeout") + 1] == str(DRAIN_S + TEARDOWN_S), argv
    assert rec["shutdown_timeout"] == DRAIN_S + TEARDOWN_S, rec
    # and set SPT_NOENV=1: the retitled EngineCore keeps a readable environment with the run id
    eng_env = _environ(engine.pid)
    assert eng_env.get("SPT_NOENV") == "1" and eng_env.get("XPUCTL_RUN_ID") == rec["run_id"], (
        sorted(eng_env)[:20])
    shm = realvllm.shm_files_open_by(p.pid for p in run.tree())

    # size the work from this server and this machine: a warm-up, then one full batch
    model = str(run.model)
    workload.measure_rate(run.base_url, model, 1, 8)
    dry_runs = []

    def dry_run() -> None:
        dry_runs.append(run.xpuctl("shutdown", run.name, "--state-dir", run.state_dir,
                                   "--dry-run", "--json", timeout=300))

    loaded = workload.measure_under_load(run.base_url, model, BATCH, CALIB_TOKENS,
                                  lambda: (in_flight(run.base_url) or 0) > 0, dry_run)
    assert dry_runs[0].rc == 0, dry_runs[0].describe()
    rate = loaded.rate
    plan = workload.plan(rate, loaded.lead_s, DRAIN_S, N_REQUESTS, MAX_TOKENS, min_seqs=MIN_SEQS)
    vllm_log(f"[vllm-real] drain plan: {rate.per_s:.0f} tok/s ({rate.tokens} in "
             f"{rate.seconds:.1f} s), dry run under load {loaded.lead_s:.1f} s"
             f"{'' if loaded.covered else ' (outlasted the calibration)'} -> {N_REQUESTS} x "
             f"n={plan.n_seqs} x {MAX_TOKENS} tokens, about {plan.target_s:.0f} s of work")
    # vLLM's deadline covers drain and teardown; the client waits for both and a margin
    request_timeout = DRAIN_S + TEARDOWN_S + 60

    # completions in flight
    results: list[tuple[int, object, float]] = []

    def complete() -> None:
        try:
            status, data = realvllm.http_json(run.base_url + "/v1/completions",
                                       workload.completion_body(model, plan.n_seqs, MAX_TOKENS),
                                       timeout=request_timeout)
        except Exception as e:
            status, data = -1, repr(e)
        results.append((status, data, time.monotonic()))

    threads = [threading.Thread(target=complete, daemon=True) for _ in range(N_REQUESTS)]
    t_req = time.monotonic()
    for t in threads:
        t.start()
    assert _wait(lambda: (in_flight(run.base_url) or 0) > 0, plan.target_s), (
        "no request ever in flight")
    t_stop = time.monotonic()
    res = run.xpuctl("shutdown", run.name, "--state-dir", run.state_dir, "--json",
                     timeout=request_timeout + 120)
    shutdown_s = time.monotonic() - t_stop
    for t in threads:
        t.join(timeout=request_timeout)

    assert res.rc == 0, res.describe() + "\n--- log tail\n" + run.log_tail()
    data = res.json
    assert data["verdict"] in ("clean", "escalated"), res.describe()
    events = data["events"]
    assert [t["top"] for t in data["targets"]] == [api.pid], data["targets"]
    phases = [e["phase"] for e in events]
    assert "sigterm" in phases and "timeout" not in phases, res.describe(6000)
    vllm_lines = _vllm_lines(events)
    assert vllm_lines, f"no vLLM [shutdown] phase in the timeline:\n{res.describe(6000)}"
    # requests were still in flight when the SIGTERM landed: xpuctl's first probe after it
    # counted them
    after_term = events[phases.index("sigterm"):]
    flights = [int(e["detail"].split()[0]) for e in after_term if e["phase"] == "in-flight"]
    assert flights and flights[0] > 0, f"xpuctl saw no request in flight:\n{res.describe(6000)}"
    # ... and so did vLLM itself when its EngineCore got the SIGTERM
    drained = [int(m.group(1)) for m in map(DRAINING_RE.search, vllm_lines) if m]
    assert drained and drained[0] > 0, f"vLLM drained nothing:\n{vllm_lines}"

    # every request finished, with every token, after the SIGTERM
    t_sigterm = t_stop + (data.get("resolve_seconds") or 0.0)
    assert len(results) == N_REQUESTS, results
    for status, body, t_end in results:
        assert status == 200, (status, str(body)[:500])
        assert body["usage"]["completion_tokens"] == plan.n_seqs * MAX_TOKENS, body["usage"]
        assert t_end > t_sigterm, "the completion finished before the SIGTERM"
    req_s = max(r[2] for r in results) - t_req

    # the tree is gone, and so is the detached supervisor (zombies count as gone)
    gone, secs = run.wait_gone(60)
    assert gone, f"still alive after shutdown:\n{run.describe_tree()}"
    assert not realvllm.port_is_listening(run.port)
    assert _wait(lambda: run.record().get("state") == "stopped", 30), run.record()
    shm_left = sorted(p for p in shm if os.path.exists(p))

    vllm_timings[request.node.name] = {
        "serve_detach": run.serve_result.seconds,
        "rate_tok_s": f"{plan.rate:.0f}",
        "calibration": rate.seconds,
        "dry_run_loaded": loaded.lead_s,
        "dry_run_covered": loaded.covered,
        "planned_work": plan.target_s,
        "n_seqs": plan.n_seqs,
        "requests": req_s,
        "sigterm_after_requests": t_sigterm - t_req,
        "drain_after_sigterm": max(r[2] for r in results) - t_sigterm,
        "resolve": float(data.get("resolve_seconds") or 0.0),
        "shutdown_cmd": shutdown_s,
        "verdict": data["verdict"],
        "vllm_phases": len(vllm_lines),
        "vllm_phases_distinct": len(set(vllm_lines)),
        "in_flight": "->".join(map(str, flights)),
        "vllm_drained": drained[0],
        "gone_after_shutdown": secs,
        "record": f"{run.record().get('state')}/{run.record().get('exit_code')}",
        "shm_left": len(shm_left),
    }
    assert not shm_left, f"shm left after a clean stop: {shm_left}"
    # last: each vLLM phase once, as vLLM logged it (not echoes of xpuctl's own log lines)
    echoed = _echoed_phases(events, run.log_text())
    assert not echoed, f"timeline repeats phases vLLM logged fewer times: {echoed}"


def test_xpuctl_orphans_after_api_sigkill(xpuctl_serve, vllm_timings, request, vllm_log):
    run = xpuctl_serve(teardown=ORPHAN_TEARDOWN_S)
    rec = _served_ok(run)
    parts = _tree_roles(run, rec)
    api, engine = parts["api"][0], parts["engine"][0]
    workers = parts["worker"]
    orphans = {p.pid: p.cmdline for p in [engine, *workers]}
    psm = realvllm.shm_files_open_by((p.pid for p in run.tree()), prefix="/dev/shm/psm_")
    assert psm and all(pids <= set(orphans) for pids in psm.values()), psm
    dist = sorted(run.dist_files())
    assert dist and all(os.path.exists(p) for p in dist), dist

    # SIGKILL the API server (pid from the run record): its EngineCore and worker stay
    t_kill = time.monotonic()
    assert realvllm.signal_if_token(api.pid, run.token, signal.SIGKILL)
    assert _wait(lambda: _gone(api.pid, api.cmdline), 60), run.describe_tree()

    doc = run.xpuctl("doctor", "--json", "--port", run.port, timeout=180)
    doctor_at = time.monotonic() - t_kill
    assert doc.rc == 1, doc.describe()
    d = doc.json
    procs = {p["pid"]: p for p in d["processes"]}
    assert engine.pid in procs, doc.describe(8000)
    assert procs[engine.pid]["role"] == "engine-core" and procs[engine.pid]["orphan"], procs[engine.pid]
    for w in workers:
        assert w.pid in procs and procs[w.pid]["role"] == "worker" and procs[w.pid]["orphan"], (
            procs.get(w.pid))
    orphan_findings = [f for f in d["findings"] if f["check"] == "orphans" and set(orphans) <= set(f["pids"])]
    assert orphan_findings and orphan_findings[0]["severity"] == "fail", d["findings"]
    arts = {a["path"]: a for a in d["artifacts"]}
    for path in psm:
        a = arts.get(path)
        assert a is not None, f"doctor does not list {path}"
        assert a["kind"] == "shm" and not a["stale"] and set(a["open_by"]) & set(orphans), a
    for path in dist:
        a = arts.get(path)
        assert a is not None, f"doctor does not list {path}"
        assert a["kind"] == "filestore" and not a["stale"], a
    port_rows = [p for p in d["ports"] if p["port"] == run.port]
    orphan_ports = [p["port"] for p in d["ports"] if p["pid"] in orphans and p["orphan"]]

    # `shutdown --all` would stop our orphaned tree (as one target, topped by EngineCore).
    dry = run.xpuctl("shutdown", "--all", "--dry-run", "--json", "--state-dir", run.state_dir)
    assert dry.rc == 0, dry.describe()
    targets = dry.json["targets"]
    mine = [t for t in targets if set(orphans) <= set(t["processes"])]
    assert len(mine) == 1 and mine[0]["top"] == engine.pid and mine[0]["orphan"], targets
    assert mine[0]["name"] == run.name and mine[0]["run_id"] == rec["run_id"], mine[0]
    # The real stop names EngineCore (what doctor's remedy says). A real `--all` stops
    # every vLLM tree on the machine, and other people's test trees come and go within
    # seconds (a dry run proves nothing about the next second), so it is opt-in.
    only_ours = all(realvllm.has_token(pid, run.token) for t in targets for pid in t["processes"])
    how = (["--all", "--yes"] if os.environ.get(ALLOW_ALL_VAR) == "1" and only_ours
           else ["--pid", str(engine.pid)])
    t_stop = time.monotonic()
    stop = run.xpuctl("shutdown", *how, "--state-dir", run.state_dir, "--json", timeout=300)
    stop_s = time.monotonic() - t_stop
    assert stop.rc == 0, stop.describe() + "\n--- log tail\n" + run.log_tail()
    sdata = stop.json
    assert sdata["verdict"] in ("clean", "escalated"), stop.describe()
    assert any(e["phase"] == "sigterm" and str(engine.pid) in e["detail"] for e in sdata["events"]), (
        stop.describe(6000))
    vllm_lines = _vllm_lines(sdata["events"])

    # the orphans are gone, and with them the shm they held
    left = [pid for pid, cmd in orphans.items() if not _gone(pid, cmd)]
    assert not left, f"orphans survive the shutdown: {left}\n{run.describe_tree()}"
    assert _wait(lambda: not any(os.path.exists(p) for p in psm), 30), (
        [p for p in psm if os.path.exists(p)])

    after = run.xpuctl("doctor", "--json", "--port", run.port, timeout=180)
    assert after.rc in (0, 1), after.describe()
    d2 = after.json
    still = [p for p in d2["processes"] if p["pid"] in orphans or p["run_id"] == rec["run_id"]]
    assert not [p for p in still if p["orphan"] or p["state"] != "Z"], still
    arts2 = {a["path"]: a for a in d2["artifacts"]}
    assert not set(psm) & set(arts2), [arts2[p] for p in set(psm) & set(arts2)]
    our_fail = [f for f in d2["findings"] if f["severity"] == "fail"
                and set(f["pids"]) & (set(orphans) | {api.pid})]
    assert not our_fail, our_fail

    # what doctor says about the FileStore and vLLM's ZMQ socket files (before/after)
    def verdict_of(path: str, artifacts: dict) -> str:
        if path in artifacts:
            a = artifacts[path]
            return ("stale: " if a["stale"] else "not stale: ") + a["reason"]
        return "exists, not listed" if os.path.lexists(path) else "gone"

    def summary(paths, artifacts: dict) -> str:
        counts: dict[str, int] = {}
        for p in paths:
            v = verdict_of(p, artifacts)
            counts[v] = counts.get(v, 0) + 1
        return "; ".join(f"{n}x {v}" for v, n in counts.items()) or "-"

    # the supervisor saw its API server die; it exits once the tree is gone
    sup_gone, _ = run.wait_gone(60)
    sup_lines = [ln for ln in run.log_text().splitlines() if ln.startswith("xpuctl:")]
    vllm_timings[request.node.name] = {
        "serve_detach": run.serve_result.seconds,
        "doctor_after_kill": doctor_at,
        "doctor_cmd": doc.seconds,
        "shutdown_how": " ".join(how),
        "all_targets_ours": only_ours,
        "shutdown_started_after_kill": t_stop - t_kill,
        "shutdown_cmd": stop_s,
        "verdict": sdata["verdict"],
        "vllm_phases": len(vllm_lines),
        "vllm_phases_distinct": len(set(vllm_lines)),
        "supervisor_escalated": any("sigterm-survivors" in ln or "sigkill" in ln for ln in sup_lines),
        "supervisor_gone": sup_gone,
        "record": f"{run.record().get('state')}/{run.record().get('exit_code')}",
        "serving_port_after_kill": ",".join(p["state"] for p in port_rows) or "-",
        "orphan_ports": len(orphan_ports),
        "psm_held": len(psm),
        "doctor_after_rc": after.rc,
        "dist_before_stop": summary(dist, arts),
        "dist_after_stop": summary(dist, arts2),
        "zmq_before_stop": summary(sorted(run.sockets_seen), arts),
        "zmq_after_stop": summary(sorted(run.sockets_seen), arts2),
    }
    echoes = [ln for ln in sup_lines if " vllm " in ln]
    vllm_log("[vllm-real] supervisor log after the kill (without its "
             f"{len(echoes)} 'vllm' phase lines):\n  "
             + "\n  ".join(ln for ln in sup_lines if ln not in echoes))
    assert sup_gone, f"the supervisor did not exit:\n{run.describe_tree()}"
    # last: each vLLM phase once, as vLLM logged it (not echoes of xpuctl's own log lines)
    echoed = _echoed_phases(sdata["events"], run.log_text())
    assert not echoed, f"timeline repeats phases vLLM logged fewer times: {echoed}"
