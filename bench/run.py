#!/usr/bin/env python3
"""xpuctl performance benchmark. See bench/README.md.

The command line; the scenarios are in scenarios.py, the report in report.py, the machinery
they share in harness.py.

Scenarios, all in one run on the same host state, every command timed as its own process
with Python's `time.perf_counter` (wall clock), rounds interleaved in rotating order:

  scan      N idle processes with K open fds each (10 of them hold a stand-in render node
            under a root R whose `proc` links to /proc): `xpuctl --root R doctor --json`,
            `fuser` and `lsof -w` on the node, and a bare Python loop (bench/floor.py) as
            the floor. N = 0 (idle)
            and every --sizes value.
  start     `xpuctl --version`, a completion request, `xpuctl doctor --json` on the idle
            host, against `python -c "import typer"` and `python -c pass`.
  memory    peak RSS of doctor (`/usr/bin/time -v`) at every N.
  shutdown  the fake vLLM (tests/fake_vllm/vllm) exiting at once on SIGTERM: SIGTERM to
            all-gone by itself, and `xpuctl shutdown --pid TOP` end to end.
  imports   every command run under a probe that lists sys.modules at exit: none may
            import torch, intel_extension_for_pytorch, pyzes or vllm.

Cleanup: every process this script starts is killed and reaped on exit, Ctrl-C, SIGTERM
or an error; nothing else is ever signalled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from harness import (
    CONTENTION,
    T0,
    BenchError,
    become_subreaper,
    entry,
    find_time,
    loadavg,
    med,
    preflight,
    pt,
    say,
)
from report import (
    build_report,
    host_facts,
    interpreter_of,
)
from scenarios import (
    Ctx,
    scenario_scan,
    scenario_shutdown,
    scenario_start,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="xpuctl performance benchmark (see bench/README.md)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds for scan and shutdown (default 5)")
    p.add_argument("--start-rounds", type=int, help="timed rounds for start-up commands (default 3 x --rounds)")
    p.add_argument("--sizes", default="1000,2000,4000",
                   help="process counts N (default 1000,2000,4000; N=0 is always run)")
    p.add_argument("--fds", type=int, default=35, help="open fds per process, 0-2 included (default 35)")
    p.add_argument("--holder-mode", choices=("exec", "fork"), default="exec",
                   help="holders exec `sleep infinity` (default, ~0.2 MiB each) "
                        "or stay forked Python copies (~0.6 MiB)")
    p.add_argument("--rss-runs", type=int, default=3, help="runs under /usr/bin/time -v per N (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 rounds, sizes 1000,2000")
    p.add_argument("--only", default="scan,start,shutdown", help="scenarios to run (comma list)")
    p.add_argument("--profile", action="store_true", help="also cProfile + importtime doctor at the N nearest 1000")
    p.add_argument("--xpuctl", help="the xpuctl executable (default: next to this Python, else on PATH)")
    p.add_argument("--json", action="store_true", help="print raw numbers as JSON on stdout (table on stderr)")
    p.add_argument("--save", metavar="PATH", help="also write the JSON to PATH")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--wait-quiet", type=float, default=30, metavar="S",
                   help="before each scenario, wait up to S seconds for the host to be quiet (default 30; 0: don't)")
    p.add_argument("--no-bytecode-cache", action="store_true",
                   help="run commands with PYTHONDONTWRITEBYTECODE=1 (modules without a .pyc compile on "
                        "every run); default: a private PYTHONPYCACHEPREFIX filled by the warm-up round")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds = min(a.rounds, 3)
        if a.sizes == p.get_default("sizes"):
            a.sizes = "1000,2000"
    a.sizes = sorted({int(x) for x in a.sizes.split(",") if x.strip() and int(x) > 0})
    a.start_rounds = a.start_rounds or 3 * a.rounds
    a.only = {x.strip() for x in a.only.split(",") if x.strip()}
    if a.rounds < 1 or not a.sizes:
        p.error("need --rounds >= 1 and at least one size")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    xpuctl = a.xpuctl or (str(Path(sys.executable).with_name("xpuctl"))
                          if Path(sys.executable).with_name("xpuctl").exists() else shutil.which("xpuctl"))
    if not xpuctl:
        raise BenchError("xpuctl not found: pass --xpuctl PATH")
    for tool in ("fuser", "lsof"):
        if not shutil.which(tool):
            raise BenchError(f"{tool} not found (apt-get install psmisc lsof)")
    if not find_time():
        say("note: /usr/bin/time not found (apt-get install time): peak RSS via getrusage instead")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XPUCTL_", "_XPUCTL_")) and k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    pyc_dir = None
    if a.no_bytecode_cache:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        # Cached bytecode, as after a normal install, written outside the source tree; the
        # warm-up round fills it (for xpuctl and typer alike).
        pyc_dir = tempfile.mkdtemp(prefix="xpuctl-bench-pyc-")
        env["PYTHONPYCACHEPREFIX"] = pyc_dir
    try:
        return _main(a, xpuctl, env)
    finally:
        if pyc_dir:
            shutil.rmtree(pyc_dir, ignore_errors=True)


def _main(a: argparse.Namespace, xpuctl: str, env: dict[str, str]) -> int:
    c = Ctx(a, xpuctl, interpreter_of(xpuctl), env)
    # measured: ~0.2 MiB per exec'd holder, ~0.6 MiB per forked one; estimate with a margin
    facts = preflight(max(a.sizes) if "scan" in a.only else 0, a.fds, 0.5 if a.holder_mode == "exec" else 1.0)
    c.results["host"] = host_facts(c) | {"limits": facts}
    c.results["config"] = {"rounds": a.rounds, "start_rounds": a.start_rounds, "sizes": a.sizes,
                           "holder_mode": a.holder_mode,
                           "fds": a.fds, "rss_runs": a.rss_runs, "xpuctl": xpuctl, "python": c.py}
    if os.getloadavg()[0] > 0.5:
        say(f"note: load average {os.getloadavg()[0]:.2f}: other work is running; "
            "interleaving spreads it over all commands, but figures will be noisier")
    become_subreaper()

    if "scan" in a.only:
        c.results["scan"] = {}
        root = pt.StandInRoot(n_devices=2)
        try:
            # Idle is measured before, between and after the populations. Each population's
            # "above idle" figures use the idle right before and right after it (pooled), so
            # a slow stretch of the host (this VM is slower for a while after large frees)
            # shifts a population and its own baseline together, not one of them alone.
            idles = [scenario_scan(c, 0, root)]
            for n in a.sizes:
                c.results["scan"][n] = scenario_scan(c, n, root)
                idles.append(scenario_scan(c, 0, root))
                c.results["scan"][n]["idle_samples"] = {
                    key: idles[-2]["samples"][key] + idles[-1]["samples"][key] for key in idles[-1]["samples"]}
            idle = idles[0]
            idle["doctor_by_stage"] = [med(x["samples"]["doctor"]) for x in idles]
            for again in idles[1:]:
                for key, xs in again["samples"].items():
                    idle["samples"][key].extend(xs)
                idle["rss_kib"].extend(again["rss_kib"])
            c.results["scan"][0] = idle
        finally:
            root.close()
    if "start" in a.only:
        c.results["start"] = scenario_start(c)
    if "shutdown" in a.only:
        c.results["shutdown"] = scenario_shutdown(c)
    c.results["host"]["load_end"] = loadavg()
    c.results["elapsed_s"] = round(time.monotonic() - T0, 1)
    c.results["contention"] = CONTENTION

    text, targets = build_report(c)
    c.results["targets"] = targets
    c.results["summary"] = summarise(c.results)
    text += f"\n\ntotal benchmark time {c.results['elapsed_s']:.0f}s"
    blob = json.dumps(c.results, indent=2, default=str)
    if a.save:
        Path(a.save).write_text(blob + "\n")
    if a.json:
        sys.stderr.write(text + "\n")
        sys.stdout.write(blob + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 1 if a.check and any(t["met"] is False for t in targets) else 0


def summarise(res: dict) -> dict:
    """Medians / min / max of every sample list, for scripts."""
    out: dict = {}
    for n, s in res.get("scan", {}).items():
        out[f"scan N={n}"] = {k: {"median": med(v), "min": min(v), "max": max(v)} for k, v in s["samples"].items()}
        out[f"scan N={n}"]["rss_mib"] = {"median": med(s["rss_kib"]) / 1024}
    for name in ("start", "shutdown"):
        if name in res:
            out[name] = {k: {"median": med(v), "min": min(v), "max": max(v)}
                         for k, v in res[name]["samples"].items()}
    return out


if __name__ == "__main__":
    entry(main)
