#!/usr/bin/env python3
"""serve's liveness watch (issue 30): how fast it decides, and what it costs.

latency  `serve --detach` on the fake vLLM (tests/fake_vllm/vllm) with a notify socket this
         script binds. Once ready, a fault starts (the script creates FAKE_VLLM_FAULT_FILE and
         notes the monotonic time); the decision is the `STATUS=unhealthy: ...` (or
         `stalled: ...`) datagram the supervisor sends the moment its watch decides, before
         the stop. Faults:
           death   die-inside: EngineCore's fatal error, /health 503 for good (at once)
           health  /health answers 503 for good, no engine-death line (--unhealthy-after)
           stall   a request running, the token counters frozen (--stall-after)
         Target: every decision within its window (--unhealthy-after, or --stall-after for a
         stall) plus two intervals.
cpu      two detached supervisors at the same time against idle fake vLLMs for --cpu-seconds
         (default 300): one at the default --health-interval (5 s), one at 3600 s (the watch
         as good as off: the supervisor's own loop). Their CPU time (utime + stime of
         /proc/PID/stat, the supervisor and its bounded reader) over the same window, as a
         share of one core. Target: the default watch costs under 0.2 % of one core.

    .venv/bin/python bench/watch.py [--rounds 3] [--interval 1] [--unhealthy-after 3]
        [--stall-after 4] [--faults death,health,stall] [--cpu-seconds 300]
        [--only latency,cpu] [--json]

Only processes this script starts are signalled (by their XPUCTL_TEST_TOKEN); stand-in roots,
state directories and sockets are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
import proctools as pt  # (StandInRoot, free_port, tokens, reaping)

PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Notify:
    """The service manager's end of NOTIFY_SOCKET: (monotonic time, text) of each datagram."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.got: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            self.got.append((time.monotonic(), data.decode(errors="replace")))

    def decision(self, since: float) -> tuple[float, str] | None:
        for t, text in list(self.got):
            for line in text.split("\n"):
                if t >= since and line.startswith(("STATUS=unhealthy:", "STATUS=stalled:")):
                    return t, line[len("STATUS="):]
        return None


def env_for(token: str, events: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XPUCTL_", "FAKE_VLLM_", "NOTIFY_", "WATCHDOG_"))}
    env.update({pt.TOKEN_VAR: token, "FAKE_VLLM_EVENTS": events, **extra})
    return env


def serve(root: pt.StandInRoot, state: str, name: str, env: dict[str, str],
          opts: list[str], tp: int = 2) -> tuple[int, str, int]:
    port = pt.free_port()
    cmd = [PY, "-m", "xpuctl", "--root", root.root, "serve", "--vllm",
           f"{PY} {pt.FAKE_VLLM} serve", "--state-dir", state, "--detach", "--force",
           "--name", name, "--drain-timeout", "2", "--teardown-timeout", "2", "--kill-after", "1",
           *opts, "fake-model", "--port", str(port), "-tp", str(tp)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    return p.returncode, p.stderr, port


def record(state: str, name: str) -> dict:
    return json.loads(Path(state, "runs", f"{name}.json").read_text())


def long_request(port: int) -> None:
    body = json.dumps({"prompt": "x", "fake_seconds": 600}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})

    def go() -> None:
        try:
            urllib.request.urlopen(req, timeout=900).read()
        except OSError:
            pass

    threading.Thread(target=go, daemon=True).start()


def running(port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return pt.metric(text, "vllm:num_requests_running") or 0.0


FAULTS = {
    "death": ({"FAKE_VLLM_FAULTS": "die-inside"}, "unhealthy_after"),
    "health": ({"FAKE_VLLM_FAULTS": "health-blip", "FAKE_VLLM_BLIP_S": "100000"}, "unhealthy_after"),
    "stall": ({"FAKE_VLLM_FAULTS": "stall"}, "stall_after"),
}


def latency(args: argparse.Namespace, root: pt.StandInRoot, work: str, token: str) -> list[dict]:
    out = []
    watch = ["--health-interval", f"{args.interval:g}", "--unhealthy-after",
             f"{args.unhealthy_after:g}", "--stall-after", f"{args.stall_after:g}"]
    state = os.path.join(work, "state")
    n = 0
    for fault, (faults, window) in FAULTS.items():
        if fault not in args.faults.split(","):
            continue
        for _ in range(args.rounds):
            n += 1
            d = tempfile.mkdtemp(prefix="xw", dir="/tmp")
            notify = Notify(d)
            trigger = os.path.join(work, f"fault-{n}")
            env = env_for(token, os.path.join(work, "events.jsonl"),
                          {**faults, "FAKE_VLLM_FAULT_FILE": trigger, "NOTIFY_SOCKET": notify.path})
            name = f"lat-{n}"
            try:
                rc, err, port = serve(root, state, name, env, watch)
                if rc != 0:
                    raise SystemExit(f"{fault}: serve exited {rc}:\n{err}")
                if fault == "stall":
                    long_request(port)
                    pt.wait_for(lambda port=port: running(port) >= 1, 30, 0.05)
                time.sleep(1.5 * args.interval)  # a check or two before the fault
                t0 = time.monotonic()
                Path(trigger).touch()
                pt.wait_for(lambda n=notify, t=t0: n.decision(t) is not None, 120, 0.02)
                got = notify.decision(t0)
                if got is None:
                    raise SystemExit(f"{fault}: no decision within 120 s")
                bound = getattr(args, window) + 2 * args.interval
                supervisor = record(state, name)["supervisor_pid"]
                pt.wait_for(lambda pid=supervisor: pt.is_gone(pid), 120, 0.05)
                out.append({"fault": fault, "seconds": got[0] - t0, "bound": bound,
                            "reason": got[1][:160], "state": record(state, name)["state"]})
            finally:
                notify.sock.close()
                shutil.rmtree(d, ignore_errors=True)
    return out


def cpu_ticks(pid: int) -> int:
    """utime + stime of pid and of its children that are xpuctl's bounded reader."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            data = Path(f"/proc/{p}/stat").read_bytes()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        total += int(fields[11]) + int(fields[12])
    return total


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            data = Path(f"/proc/{d}/stat").read_bytes()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(data[data.rfind(b")") + 2:].split()[1])
        if ppid == pid and b"xpuctl.host.reads" in cmd:
            out.append(int(d))
    return out


def cpu(args: argparse.Namespace, root: pt.StandInRoot, work: str, token: str) -> dict:
    state = os.path.join(work, "cpu-state")
    # one device each (the stand-in root has two), one worker each
    runs = {"default (5 s)": ["--devices", "0"],
            "watch off (3600 s)": ["--devices", "1", "--health-interval", "3600",
                                   "--unhealthy-after", "3600", "--stall-after", "0"]}
    pids = {}
    for label, opts in runs.items():
        name = "cpu-default" if "default" in label else "cpu-off"
        env = env_for(token, os.path.join(work, "cpu-events.jsonl"), {})
        rc, err, _ = serve(root, state, name, env, opts, tp=1)
        if rc != 0:
            raise SystemExit(f"cpu {label}: serve exited {rc}:\n{err}")
        pids[label] = record(state, name)["supervisor_pid"]
    time.sleep(6)  # past the first check
    before = {k: cpu_ticks(p) for k, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(args.cpu_seconds)
    wall = time.monotonic() - t0
    after = {k: cpu_ticks(p) for k, p in pids.items()}
    result = {}
    for k in pids:
        seconds = (after[k] - before[k]) / CLK_TCK
        result[k] = {"cpu_seconds": seconds, "wall_seconds": wall,
                     "percent_of_one_core": 100 * seconds / wall}
    healthy = record(state, "cpu-default").get("health") or {}
    result["default_health"] = healthy.get("state")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--unhealthy-after", type=float, default=3.0)
    ap.add_argument("--stall-after", type=float, default=4.0)
    ap.add_argument("--cpu-seconds", type=float, default=300.0)
    ap.add_argument("--only", default="latency,cpu")
    ap.add_argument("--faults", default=",".join(FAULTS), help="of: " + ", ".join(FAULTS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    only = set(args.only.split(","))

    token = pt.new_token()
    root = pt.StandInRoot(None, n_devices=2)
    work = tempfile.mkdtemp(prefix="xpuctl-bench-watch-")
    out: dict[str, object] = {"loadavg": Path("/proc/loadavg").read_text().split()[:4]}
    try:
        if "latency" in only:
            out["latency"] = latency(args, root, work, token)
        if "cpu" in only:
            out["cpu"] = cpu(args, root, work, token)
    finally:
        pt.reap_token(token)
        root.close()
        shutil.rmtree(work, ignore_errors=True)
    out["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:4]
    if args.json:
        print(json.dumps(out, indent=2))
    ok = True
    for fault in FAULTS:
        rows = [r for r in out.get("latency", []) if r["fault"] == fault]  # type: ignore[union-attr]
        if not rows:
            continue
        secs = [r["seconds"] for r in rows]
        bound = rows[0]["bound"]
        met = max(secs) <= bound
        ok &= met
        print(f"latency {fault:6s} ({len(rows)} rounds): median {statistics.median(secs):.2f} s, "
              f"max {max(secs):.2f} s (bound {bound:g} s: {'MET' if met else 'MISSED'}); "
              f"{rows[0]['reason'][:90]}", file=sys.stderr)
    if "cpu" in out:
        c = out["cpu"]
        assert isinstance(c, dict)
        for label in ("default (5 s)", "watch off (3600 s)"):
            r = c[label]
            print(f"cpu {label}: {r['cpu_seconds']:.2f} s in {r['wall_seconds']:.0f} s = "
                  f"{r['percent_of_one_core']:.3f} % of one core", file=sys.stderr)
        pct = c["default (5 s)"]["percent_of_one_core"]
        met = pct < 0.2
        ok &= met
        print(f"cpu target: the default watch (supervisor in all) < 0.2 % of one core: "
              f"{'MET' if met else 'MISSED'} ({pct:.3f} %; the watch's own share "
              f"{pct - c['watch off (3600 s)']['percent_of_one_core']:.3f} %); health "
              f"{c['default_health']}", file=sys.stderr)
    print(f"load average / runnable: {' '.join(out['loadavg'])} -> "  # type: ignore[arg-type]
          f"{' '.join(out['loadavg_after'])}", file=sys.stderr)  # type: ignore[arg-type]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
