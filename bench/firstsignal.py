"""Time from the start of `xpuctl shutdown NAME` to its first SIGTERM, on a busy host.

Set-up: N background processes (`sleep`), one CPU hog per core, and a run NAME started by
`xpuctl serve --detach` over the fake vLLM (tests/fake_vllm/), which the hogs keep from
running freely. Each round starts the run, then times `xpuctl shutdown NAME`: the first
SIGTERM is the fake vLLM's own "signal" event (wall clock, written in its handler), so the
figure is what the operator waits for, start-up and resolve included.

    .venv/bin/python bench/firstsignal.py --runs 20 --procs 1000

Prints p50, p95 and max (seconds) and the load average before and after. Everything started
here carries a token in its environment and is ended by it, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests" / "support"
sys.path.insert(0, str(TESTS))

import proctools as pt  # the tests' helpers, from the tree above

PY = sys.executable
HOG = "while True: pass"


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _first_signal(events: Path, after: float) -> float | None:
    try:
        lines = events.read_text().splitlines()
    except OSError:
        return None
    times = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "signal" and rec.get("signal") == "SIGTERM" and rec["t"] >= after:
            times.append(rec["t"])
    return min(times) if times else None


def one_round(i: int, root: str, state: str, events: Path, env: dict[str, str]) -> float:
    name = f"fs{i}"
    port = pt.free_port()
    serve = [PY, "-m", "xpuctl", "--root", root, "serve", "--vllm", f"{PY} {pt.FAKE_VLLM} serve",
             "--state-dir", state, "--drain-timeout", "1", "--teardown-timeout", "2",
             "--ready-timeout", "120", "--kill-after", "1", "--detach", "--force", "--name", name,
             "fake-model", "--port", str(port), "-tp", "2"]
    r = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"serve failed ({r.returncode}): {r.stderr[-800:]}")
    t0 = time.time()
    r = subprocess.run([PY, "-m", "xpuctl", "--root", root, "shutdown", name, "--state-dir", state],
                       env=env, capture_output=True, text=True, timeout=300)
    if not pt.wait_for(lambda: _first_signal(events, t0) is not None, 10):
        raise SystemExit(f"no SIGTERM seen (shutdown rc {r.returncode}): {r.stderr[-800:]}")
    first = _first_signal(events, t0)
    assert first is not None
    return first - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--procs", type=int, default=1000, help="background processes (default 1000)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="CPU hogs (default: one per core)")
    a = ap.parse_args()
    token = pt.new_token()
    stand_in = pt.StandInRoot(n_devices=2)
    state = tempfile.mkdtemp(prefix="xpuctl-firstsignal-")
    events = Path(state) / "events.jsonl"
    env = pt.token_env(token, FAKE_VLLM_EVENTS=str(events), FAKE_VLLM_STARTUP_S="0.2",
                       FAKE_VLLM_TEARDOWN_S="0")
    env = {k: v for k, v in env.items() if not k.startswith("XPUCTL_") or k == pt.TOKEN_VAR}
    env["SPT_NOENV"] = "1"
    background: list[subprocess.Popen[bytes]] = []
    times: list[float] = []
    try:
        for _ in range(a.procs):
            background.append(_spawn(["sleep", "infinity"], env))
        for _ in range(a.hogs):
            background.append(_spawn([PY, "-c", HOG], env))
        load_before = os.getloadavg()
        for i in range(a.runs):
            dt = one_round(i, stand_in.root, state, events, env)
            times.append(dt)
            print(f"run {i + 1:>2}: {dt:.3f} s to the first SIGTERM (load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr)
        load_after = os.getloadavg()
    finally:
        for p in background:
            p.kill()
        for p in background:
            p.wait()
        pt.reap_token(token)
        stand_in.close()
    print(json.dumps({
        "runs": len(times), "procs": a.procs, "hogs": a.hogs,
        "p50": statistics.median(times), "p95": _percentile(times, 0.95), "max": max(times),
        "load_before": load_before, "load_after": load_after, "samples": times,
    }, indent=1))


if __name__ == "__main__":
    main()
