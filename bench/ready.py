#!/usr/bin/env python3
"""How fast `xpuctl serve` notices readiness, and how fast it stops a hung start (issue 10).

ready   `xpuctl serve --detach` on the fake vLLM (tests/fake_vllm/vllm), ROUNDS times. The fake
        writes a `ready` event (FAKE_VLLM_EVENTS, wall clock) right after its HTTP server
        starts answering /health. Measured from that event:
          notice  the run record's `ready_at` (the supervisor saw /health and /v1/models answer)
          return  `serve --detach` exited 0 (the parent got the answer through its pipe)
        Target: notice <= 0.5 s.
hung    `serve --detach --ready-timeout R --teardown-timeout T --kill-after K` on the fake with
        FAKE_VLLM_FAULTS=hang-startup (stuck after backend=xccl): wall time of the command,
        against R + T + K (the bound the issue sets, plus a few seconds).

Run from the repository root with the interpreter xpuctl is installed in:

    .venv/bin/python bench/ready.py [--rounds 10] [--phase-s 0.2] [--hung 1] [--json]

Only processes this script starts are signalled (by their XPUCTL_TEST_TOKEN); stand-in roots
and state directories are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
import proctools as pt  # (StandInRoot, free_port, tokens, reaping)

PY = sys.executable


def serve(root: pt.StandInRoot, state: str, token: str, events: str, extra_env: dict[str, str],
          opts: list[str], timeout: float = 300) -> tuple[int, float, float, str, int]:
    """(rc, wall start, wall end, stderr, port) of one `serve --detach`."""
    port = pt.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XPUCTL_", "FAKE_VLLM_"))}
    env.update({pt.TOKEN_VAR: token, "FAKE_VLLM_EVENTS": events, **extra_env})
    cmd = [PY, "-m", "xpuctl", "--root", root.root, "serve", "--vllm",
           f"{PY} {pt.FAKE_VLLM} serve", "--state-dir", state, "--detach", "--force", *opts,
           "fake-model", "--port", str(port), "-tp", "2"]
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    return p.returncode, t0, time.time(), p.stderr, port


def shutdown(root: pt.StandInRoot, state: str, name: str, token: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPUCTL_")}
    env[pt.TOKEN_VAR] = token
    subprocess.run([PY, "-m", "xpuctl", "--root", root.root, "shutdown", name, "--state-dir",
                    state, "--kill-after", "1", "--release-timeout", "5"],
                   env=env, capture_output=True, timeout=120)


def api_ready_at(events: str, since: float) -> float | None:
    for e in pt.read_events(Path(events)):
        if e["event"] == "ready" and e["role"] == "api-server" and e["t"] >= since:
            return float(e["t"])
    return None


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--phase-s", type=float, default=0.2, help="FAKE_VLLM_PHASE_S")
    ap.add_argument("--hung", type=int, default=1, help="hung-start rounds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    token = pt.new_token()
    root = pt.StandInRoot(None, n_devices=2)
    work = tempfile.mkdtemp(prefix="xpuctl-bench-ready-")
    state, events = os.path.join(work, "state"), os.path.join(work, "events.jsonl")
    notice: list[float] = []
    ret: list[float] = []
    hung: list[dict[str, float]] = []
    try:
        for i in range(args.rounds):
            rc, t0, t1, err, port = serve(root, state, token, events,
                                          {"FAKE_VLLM_PHASE_S": str(args.phase_s)}, [])
            if rc != 0:
                print(f"round {i}: serve exited {rc}:\n{err}", file=sys.stderr)
                return 1
            name = f"vllm-{port}"
            rec = json.loads(Path(state, "runs", f"{name}.json").read_text())
            t_api = api_ready_at(events, t0)
            if t_api is None:
                print(f"round {i}: no ready event", file=sys.stderr)
                return 1
            notice.append(rec["ready_at"] - t_api)
            ret.append(t1 - t_api)
            shutdown(root, state, name, token)
            # the supervisor keeps the device locks until it has seen its tree go
            pt.wait_for(lambda pid=rec["supervisor_pid"]: pt.is_gone(pid), 30, 0.05)
        R, T, K = 6, 4, 2
        for _ in range(args.hung):
            rc, t0, t1, err, port = serve(root, state, token, events,
                                          {"FAKE_VLLM_FAULTS": "hang-startup"},
                                          ["--ready-timeout", str(R), "--teardown-timeout", str(T),
                                           "--kill-after", str(K), "--drain-timeout", "30"])
            hung.append({"rc": rc, "seconds": t1 - t0, "bound": R + T + K,
                         "oneccl_named": float("oneCCL" in err)})
    finally:
        pt.reap_token(token)
        root.close()
        shutil.rmtree(work, ignore_errors=True)

    out = {"notice_s": stats(notice), "return_s": stats(ret), "hung": hung,
           "phase_s": args.phase_s, "loadavg": Path("/proc/loadavg").read_text().split()[:4]}
    if args.json:
        print(json.dumps(out, indent=2))
    n, r = out["notice_s"], out["return_s"]
    print(f"readiness noticed after /health first answered ({n['n']} rounds): median "
          f"{n['median'] * 1000:.0f} ms, min {n['min'] * 1000:.0f} ms, max {n['max'] * 1000:.0f} ms "
          f"(target <= 500 ms: {'MET' if n['max'] <= 0.5 else 'MISSED'})", file=sys.stderr)
    print(f"serve --detach returned after /health first answered: median {r['median'] * 1000:.0f} ms,"
          f" min {r['min'] * 1000:.0f} ms, max {r['max'] * 1000:.0f} ms", file=sys.stderr)
    for h in hung:
        print(f"hung start: exit {h['rc']} after {h['seconds']:.1f}s (ready + teardown + kill-after ="
              f" {h['bound']}s); oneCCL named: {bool(h['oneccl_named'])}", file=sys.stderr)
    print(f"load average / runnable: {' '.join(out['loadavg'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
