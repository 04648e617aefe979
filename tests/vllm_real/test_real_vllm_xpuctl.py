"""xpuctl driving real vLLM (CPU build): serve --detach, shutdown with requests in flight,
and the orphans a SIGKILLed API server leaves (doctor finds them, shutdown removes them).

Every xpuctl process runs with a unique XPUCTL_TEST_TOKEN in its environment; xpuctl hands
its environment to vLLM, so the token marks exactly our supervisor and vLLM tree. Only
those are ever signalled, and the fixture SIGKILLs whatever is left, even on failure.

The detached supervisor is a child subreaper: when its API server is SIGKILLed it reaps it,
adopts the rest of the tree and stops it (SIGTERM at once). doctor calls those processes
the run's, being stopped, while the supervisor lives, and orphans once it is gone too
(core/trees). The orphan test holds that window open with a pause point in the supervisor's
stop (`shutdown-found`: tree found, nothing sent), asks doctor there, then SIGKILLs the
supervisor before its first signal, and asks again: orphans, stopped by `xpuctl shutdown`.
Nothing in it waits on the supervisor's speed.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from proctools import pause_env

from . import realvllm, workload
from .xpuctl_run import XpuctlRun, XResult, in_flight

pytestmark = pytest.mark.vllm

# The drain test's work (workload.py): FEEDERS threads each send one request of n x
# MAX_TOKENS after another until vLLM logs that its shutdown began, so requests are in flight
# whenever xpuctl's SIGTERM lands, on any machine. What vLLM must drain is at most one
# request per thread; n is the largest (from FEED_SEQS, halving) whose request, timed on
# this server, fits DRAIN_S with a margin of DRAIN_MARGIN: a machine that many times slower
# than at the timing still drains in time (vLLM's own deadline is DRAIN_S + TEARDOWN_S).
DRAIN_S, TEARDOWN_S = 240, 10
DRAIN_MARGIN = 10.0
FEEDERS = 2
MAX_TOKENS = 240
# --max-num-seqs. Large, so that a request of FEED_SEQS sequences lasts seconds (5.3 s here;
# on a slower machine the sizing halves n, so 6-12 s): the feeders are held before `xpuctl
# shutdown` starts, and its SIGTERM must still find their requests running. With 128 a request
# took 1.3 s, and one CI run in about ten saw both finish before the SIGTERM ("vLLM drained
# nothing", 2026-12-06). The tiny model's context (256) bounds the tokens, not the sequences.
BATCH = 1024
FEED_SEQS = BATCH // 2  # a request fills at most half a batch: both feeders run at once
MIN_SEQS = 4
# vLLM's own lines (vllm/v1/engine/core.py, _handle_shutdown, vLLM 0.32): the count it
# drains when its EngineCore gets the SIGTERM, and that it finished them before its teardown
DRAINING_RE = re.compile(r"\[shutdown\] EngineCore: draining in-flight requests count=(\d+)")
DRAINED_LINE = "[shutdown] EngineCore: request processing complete"
# vllm/entrypoints/launchers/launcher.py, signal_handler: logged as the SIGTERM arrives
TRIGGERED_LINE = "[shutdown] API server: shutdown triggered"
# The orphan test's teardown budget (the supervisor is paused before its first signal and then
# SIGKILLed: it never waits this out)
ORPHAN_TEARDOWN_S = 120
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
    # serve runs with --force (XpuctlRun.serve_argv): another session's vLLM tree on this
    # host is reported by the preflight, never a refusal; nothing of it is ever signalled
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

    # size the work from the drain budget: a warm-up, then requests of the feeders' shape
    model = str(run.model)
    workload.measure_rate(run.base_url, model, 1, 8)
    sizing = workload.size_for_budget(run.base_url, model, DRAIN_S, FEEDERS, DRAIN_MARGIN,
                                      MAX_TOKENS, FEED_SEQS, MIN_SEQS)
    vllm_log(f"[vllm-real] drain work: {FEEDERS} feeders x n={sizing.n_seqs} x {MAX_TOKENS} "
             f"tokens, one request {sizing.request_s:.1f} s here (timings {sizing.tries}); "
             f"drain budget {DRAIN_S} s")
    # vLLM's deadline covers drain and teardown; a client waits for both and a margin
    request_timeout = DRAIN_S + TEARDOWN_S + 60
    feeder = workload.Feeder(run.base_url, model, sizing.n_seqs, MAX_TOKENS, FEEDERS,
                             lambda: TRIGGERED_LINE in run.log_text(), request_timeout).start()
    try:
        assert _wait(lambda: (in_flight(run.base_url) or 0) > 0, 120), "no request in flight"
        # no request is sent once the stop is asked for: vLLM promises nothing to one that
        # arrives after its SIGTERM (CI run of 2026-12-06: accepted during the drain, then
        # aborted with 240 of 15,360 tokens), and the SIGTERM follows xpuctl's own start-up,
        # so every request sent before this moment was in flight when it came
        feeder.hold()
        t_stop = time.monotonic()
        res = run.xpuctl("shutdown", run.name, "--state-dir", run.state_dir, "--json",
                         timeout=request_timeout + 120)
        shutdown_s = time.monotonic() - t_stop
    finally:
        settled = feeder.stop(request_timeout)
    assert settled, "a request was still running after vLLM's deadline"

    assert res.rc == 0, res.describe() + "\n--- log tail\n" + run.log_tail()
    data = res.json
    assert data["verdict"] in ("clean", "escalated"), res.describe()
    events = data["events"]
    assert [t["top"] for t in data["targets"]] == [api.pid], data["targets"]
    phases = [e["phase"] for e in events]
    assert "sigterm" in phases and "timeout" not in phases, res.describe(6000)
    vllm_lines = _vllm_lines(events)
    assert vllm_lines, f"no vLLM [shutdown] phase in the timeline:\n{res.describe(6000)}"
    # xpuctl watched the drain (its in-flight probes after the SIGTERM)
    after_term = events[phases.index("sigterm"):]
    flights = [int(e["detail"].split()[0]) for e in after_term if e["phase"] == "in-flight"]
    # what vLLM itself says: requests were in flight when its EngineCore got the SIGTERM,
    # and it finished them before its teardown (not cut at its deadline)
    drained = [int(m.group(1)) for m in map(DRAINING_RE.search, vllm_lines) if m]
    assert drained and drained[0] > 0, f"vLLM drained nothing:\n{vllm_lines}"
    assert any(DRAINED_LINE in ln for ln in vllm_lines), (
        f"vLLM did not finish its requests before its teardown:\n{vllm_lines}")

    # every request vLLM took is whole: every token, every sequence ended by length (vLLM's
    # finish reasons); one it refused because its shutdown had begun produced nothing and
    # was sent after `xpuctl shutdown` started. None is cut short.
    t_sigterm = t_stop + (data.get("resolve_seconds") or 0.0)
    whole = [r for r in feeder.sent if r.status == 200
             and workload.tokens_of(r.body) == sizing.n_seqs * MAX_TOKENS
             and set(workload.finish_reasons(r.body)) == {"length"}]
    refused = [r for r in feeder.sent if r not in whole]
    for r in refused:
        assert workload.tokens_of(r.body) == 0 and r.t_submit >= t_stop, (
            f"a request was cut short: status {r.status}, {workload.tokens_of(r.body)} of "
            f"{sizing.n_seqs * MAX_TOKENS} tokens, finish reasons "
            f"{sorted(set(map(str, workload.finish_reasons(r.body))))}: {str(r.body)[:300]}")
    drained_whole = [r for r in whole if r.t_end > t_sigterm]
    assert drained_whole, "no request was in flight across the SIGTERM and finished whole"
    req_s = max(r.t_end for r in feeder.sent) - min(r.t_submit for r in feeder.sent)

    # the tree is gone, and so is the detached supervisor (zombies count as gone)
    gone, secs = run.wait_gone(60)
    assert gone, f"still alive after shutdown:\n{run.describe_tree()}"
    assert not realvllm.port_is_listening(run.port)
    assert _wait(lambda: run.record().get("state") == "stopped", 30), run.record()
    shm_left = sorted(p for p in shm if os.path.exists(p))

    vllm_timings[request.node.name] = {
        "serve_detach": run.serve_result.seconds,
        "n_seqs": sizing.n_seqs,
        "one_request": sizing.request_s,
        "requests_sent": len(feeder.sent),
        "requests_refused_at_shutdown": len(refused),
        "requests_drained_whole": len(drained_whole),
        "feeding": req_s,
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


def _doctor(run: XpuctlRun) -> XResult:
    """doctor as an operator runs it, with the run's state directory (where its record is)."""
    return run.xpuctl("doctor", "--json", "--port", run.port, "--state-dir", run.state_dir,
                      timeout=180)


def _assert_being_stopped(doc: XResult, run: XpuctlRun, ours: set[int]) -> None:
    """Our tree's processes (API server dead, supervisor alive) are the run's, being stopped:
    no orphan, no failing finding on them, one note that names the run."""
    assert doc.rc in (0, 1), doc.describe()
    d = doc.json
    procs = {p["pid"]: p for p in d["processes"]}
    for pid in ours:
        p = procs.get(pid)
        assert p is not None and not p["orphan"] and p["stopping_by"] == run.name, (
            p, doc.describe(8000))
    fails = [f for f in d["findings"] if f["severity"] == "fail" and set(f["pids"]) & ours]
    assert not fails, fails
    notes = [f for f in d["findings"] if f["check"] == "orphans" and ours <= set(f["pids"])]
    assert notes and notes[0]["severity"] == "info", d["findings"]
    assert f"being stopped by run {run.name}" in notes[0]["message"], notes


def test_xpuctl_orphans_after_api_sigkill(xpuctl_serve, vllm_timings, request, vllm_log,
                                          tmp_path):
    # The supervisor pauses where its own stop has found what is left of the tree and sent
    # nothing yet (pausepoint `shutdown-found`, reached once it has reaped its dead API
    # server): the window between the API server's death and the supervisor's first signal,
    # held open, so doctor is asked at a moment the test chose, never racing the supervisor.
    marker = tmp_path / "supervisor-paused"
    run = xpuctl_serve(teardown=ORPHAN_TEARDOWN_S,
                       extra_env=pause_env(marker, "shutdown-found"))
    rec = _served_ok(run)
    parts = _tree_roles(run, rec)
    api, engine = parts["api"][0], parts["engine"][0]
    sup = parts["supervisor"][0]
    workers = parts["worker"]
    orphans = {p.pid: p.cmdline for p in [engine, *workers]}
    psm = realvllm.shm_files_open_by((p.pid for p in run.tree()), prefix="/dev/shm/psm_")
    assert psm and all(pids <= set(orphans) for pids in psm.values()), psm
    dist = sorted(run.dist_files())
    assert dist and all(os.path.exists(p) for p in dist), dist

    # SIGKILL the API server (pid from the run record): its EngineCore and worker stay
    t_kill = time.monotonic()
    run.note_artifacts()  # what the tree holds, noted by inode before the kills
    assert realvllm.signal_if_token(api.pid, run.token, signal.SIGKILL)
    assert _wait(lambda: _gone(api.pid, api.cmdline), 60), run.describe_tree()

    # its supervisor lives and will stop them: they are that run's, being stopped, at once
    # (the API server perhaps still an unreaped zombie) and once the supervisor has reaped it
    # and adopted them (their parent is then the supervisor: a subreaper, not their launcher)
    early = _doctor(run)
    _assert_being_stopped(early, run, set(orphans))
    assert _wait(lambda: marker.exists() and marker.read_text().strip(), 180), (
        f"the supervisor never reached its stop:\n{run.describe_tree()}\n{run.log_tail()}")
    adopted = realvllm.proc_info(engine.pid)
    assert adopted is not None and adopted.ppid == sup.pid, (adopted, run.describe_tree())
    _assert_being_stopped(_doctor(run), run, set(orphans))

    # the supervisor dies too, before its first signal: nothing will stop them now (orphans)
    run.note_artifacts()
    assert realvllm.signal_if_token(sup.pid, run.token, signal.SIGKILL)
    assert _wait(lambda: _gone(sup.pid, sup.cmdline), 60), run.describe_tree()
    doc = _doctor(run)
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

    # everything of the run is gone (the supervisor was SIGKILLed; zombies count as gone)
    sup_gone, _ = run.wait_gone(60)
    sup_lines = [ln for ln in run.log_text().splitlines() if ln.startswith("xpuctl:")]
    vllm_timings[request.node.name] = {
        "serve_detach": run.serve_result.seconds,
        "doctor_being_stopped": early.seconds,
        "doctor_orphans_after_kill": doctor_at,
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
    assert sup_gone, f"the run's processes did not exit:\n{run.describe_tree()}"
    # last: each vLLM phase once, as vLLM logged it (not echoes of xpuctl's own log lines)
    echoed = _echoed_phases(sdata["events"], run.log_text())
    assert not echoed, f"timeline repeats phases vLLM logged fewer times: {echoed}"
