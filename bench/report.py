"""The report of bench/run.py: the table for people, the targets met or missed, the host's facts."""

from __future__ import annotations

import itertools
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable

from harness import (
    CONTENTION,
    MIB,
    REPO,
    count_procs,
    loadavg,
    med,
    meminfo_kib,
)
from scenarios import (
    Ctx,
    profile_size,
)

# ---------------------------------------------------------------------------------------
# report


def row(scn: str, label: str, xs: list[float], unit: str = "s") -> str:
    if unit == "MiB":
        return f"  {scn:<11} {label:<44} {med(xs):>8.1f} {min(xs):>8.1f} {max(xs):>8.1f} {len(xs):>3}  MiB"
    return f"  {scn:<11} {label:<44} {med(xs):>8.3f} {min(xs):>8.3f} {max(xs):>8.3f} {len(xs):>3}"


def build_report(c: Ctx) -> tuple[str, list[dict]]:
    a, res = c.args, c.results
    L: list[str] = []
    h = res["host"]
    L.append(f"xpuctl benchmark — {h['date']}")
    L.append(f"host: {h['cpus']} CPUs, {h['mem_total_gib']:.1f} GiB, Linux {h['kernel']}; "
             f"{h['python']}; typer {h['typer']}; xpuctl {h['xpuctl_version']} (git {h['git']})")
    L.append(f"bytecode: {h['bytecode']}")
    L.append(f"rounds: scan/shutdown {a.rounds}, start {a.start_rounds} (+1 untimed warm-up each), "
             f"interleaved in rotating order; K={a.fds} fds per process ({a.holder_mode}'d holders); "
             "10 hold the node")
    L.append(f"load average at start {h['load_start']}, at end {h.get('load_end')}; "
             f"processes on the host before the run: {h['procs_before']}")
    if a.rounds < 5:
        L.append("NOTE: fewer than 5 rounds (--quick?): figures are indicative only")
    L.append("")
    what = "measurement (wall seconds unless noted)"
    L.append(f"  {'scenario':<11} {what:<44} {'median':>8} {'min':>8} {'max':>8} {'n':>3}")
    L.append("  " + "-" * 86)
    scans = res.get("scan", {})
    for n, s in sorted(scans.items()):
        scn = "idle N=0" if n == 0 else f"scan N={n}"  # N=0: every idle stage, pooled
        for key in ("doctor", "doctor_stale", "fuser", "lsof", "floor"):
            if key in s["samples"]:
                L.append(row(scn, s["labels"][key], s["samples"][key]))
        L.append(row(scn, "doctor peak RSS (/usr/bin/time -v)", [x / 1024 for x in s["rss_kib"]], "MiB"))
    st = res.get("start")
    if st:
        for key in ("version", "complete", "doctor_idle", "import_typer", "pass"):
            L.append(row("start", st["labels"][key], st["samples"][key]))
        L.append(row("start", "doctor --json (idle) peak RSS", [x / 1024 for x in st["doctor_idle_rss_kib"]], "MiB"))
    sd = res.get("shutdown")
    if sd:
        L.append(row("shutdown", "fake vLLM alone: SIGTERM -> all gone", sd["samples"]["alone"]))
        L.append(row("shutdown", "xpuctl --root R shutdown --pid TOP --json", sd["samples"]["xpuctl"]))
    L.append("")

    # ratios
    L.append("ratios (of medians)")
    idle = scans.get(0)
    for n, s in sorted(scans.items()):
        if n == 0:
            continue
        m = {k: med(v) for k, v in s["samples"].items()}
        d0 = baseline(scans, n, "doctor")
        extra = ""
        if d0 is not None:
            extra = (f"   doctor above idle {m['doctor'] - d0:.3f}s "
                     f"({(m['doctor'] - d0) / n * 1000:.3f}s per 1000 procs)")
        if "doctor_stale" in m:
            extra += f"   one stale file adds {m['doctor_stale'] - m['doctor']:+.3f}s"
        L.append(f"  N={n:<5} doctor/fuser {m['doctor'] / m['fuser']:.2f}   doctor/lsof {m['doctor'] / m['lsof']:.2f}"
                 f"   doctor/floor {m['doctor'] / m['floor']:.2f}   fuser/floor {m['fuser'] / m['floor']:.2f}"
                 f"   lsof/floor {m['lsof'] / m['floor']:.2f}{extra}")
    if idle and "doctor_by_stage" in idle:
        stages = ", ".join(f"{x:.3f}s" for x in idle["doctor_by_stage"])
        L.append(f"  idle N=0 is measured before, between and after the populations (doctor medians {stages}); "
                 "the table pools them; each N's figures above idle use the idle right before and after it")
    pairs = slopes(scans)
    if pairs:
        others = {k: {(a, b): x for a, b, x in slopes(scans, k)} for k in ("fuser", "lsof", "floor")}
        L.append("  cost of 1000 more processes (slope of the medians between sizes): " + "   ".join(
            f"N={a}..{b}: doctor {x:.3f}s, fuser {others['fuser'][a, b]:.3f}s, "
            f"lsof {others['lsof'][a, b]:.3f}s, floor {others['floor'][a, b]:.3f}s" for a, b, x in pairs))
    growth = growth_figure(scans)
    if growth:
        lo, hi, g, _lim = growth
        L.append(f"  growth: doctor's slope at the largest sizes / at the smallest (N={lo}..{hi}): {g:.2f}"
                 "   (1.00: each process costs the same at any N)")
        def fig(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.2f}"

        others_g = "   ".join(f"{k} {fig(growth_between(scans, lo, hi, k))}" for k in ("fuser", "lsof", "floor"))
        L.append(f"  time above idle, N={hi} / N={lo} ({hi / lo:g} x the processes): "
                 f"doctor {fig(growth_between(scans, lo, hi))}   {others_g}")
    if st:
        m = {k: med(v) for k, v in st["samples"].items()}
        L.append(f"  start: --version/import typer {m['version'] / m['import_typer']:.2f}   "
                 f"completion/import typer {m['complete'] / m['import_typer']:.2f}   "
                 f"doctor idle/import typer {m['doctor_idle'] / m['import_typer']:.2f}   "
                 f"import typer/pass {m['import_typer'] / m['pass']:.2f}")
    if sd:
        ov = med(sd["samples"]["xpuctl"]) - med(sd["samples"]["alone"])
        L.append(f"  shutdown overhead: median(xpuctl shutdown) - median(fake alone) = {ov:.3f}s")
    if CONTENTION:
        L.append("")
        L.append("contention: other runnable tasks on the host just before each timed run (median / max)")
        L.append("  " + "   ".join(f"{k}: {med(v):g}/{max(v)}" for k, v in CONTENTION.items() if v))
    if sd and sd.get("imports"):
        L.append("")
        L.append("imports (sys.modules at exit of each command)")
        for name, info in sd["imports"].items():
            L.append(f"  {name:<26} exit {info['exit']}  {info['modules']:>4} modules  "
                     f"rich {'yes' if info['rich'] else 'no ':<3}  psutil {'yes' if info['psutil'] else 'no ':<3}  "
                     f"forbidden: {', '.join(info['forbidden']) or 'none'}")

    targets = evaluate_targets(c)
    L.append("")
    L.append("targets")
    for t in targets:
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        L.append(f"  {verdict:<7} {t['name']:<58} {t['figure']:>20}  (limit {t['limit']})")
    missed = [t for t in targets if t["met"] is False]
    met = [t for t in targets if t["met"] is True]
    unmeasured = len(targets) - len(met) - len(missed)
    L.append(f"  {len(met)} of {len(targets)} met" + (f", {unmeasured} not measured" if unmeasured else "")
             + ("; missed: " + "; ".join(t["name"] for t in missed) if missed else ""))

    prof = next((s.get("profile") for s in scans.values() if s.get("profile")), None)
    if prof:
        L.append("")
        L.append(f"profile of doctor at N={profile_size(a)} (cProfile, cumulative; fastest of 3 runs)")
        L.extend("  " + x for x in prof["cprofile"])
        L.append(f"  -X importtime: top-level imports {prof['importtime_total_us'] / 1000:.1f} ms in total; largest:")
        for us, name in prof["importtime_top_us"]:
            L.append(f"    {us / 1000:8.1f} ms  {name}")
    return "\n".join(L), targets


def baseline(scans: dict, n: int, key: str, stat: Callable[[list[float]], float] = med) -> float | None:
    """The idle time of `key` around population N: the idle stages right before and after
    it, pooled (all idle stages pooled when the run has no per-stage record)."""
    around = scans.get(n, {}).get("idle_samples", {}).get(key)
    if around:
        return stat(around)
    idle = scans.get(0)
    return stat(idle["samples"][key]) if idle else None


def growth_between(scans: dict, lo: int, hi: int, key: str = "doctor",
                   stat: Callable[[list[float]], float] = med) -> float | None:
    """Time above idle at N=hi / at N=lo; None when the one at lo is not positive."""
    dl = stat(scans[lo]["samples"][key]) - baseline(scans, lo, key, stat)
    dh = stat(scans[hi]["samples"][key]) - baseline(scans, hi, key, stat)
    return dh / dl if dl > 0 else None


def slopes(scans: dict, key: str = "doctor", stat: Callable[[list[float]], float] = med
           ) -> list[tuple[int, int, float]]:
    """(N, next N, seconds per 1000 processes added between them) for each pair of
    consecutive sizes: what one more process costs, at that size."""
    sizes = sorted(n for n in scans if n)
    return [(a, b, (stat(scans[b]["samples"][key]) - stat(scans[a]["samples"][key])) / (b - a) * 1000)
            for a, b in itertools.pairwise(sizes)]


#: The cost grows no faster than the number of processes: what one more process costs at the
#: largest sizes is at most this much more than at the smaller ones (measuring noise).
GROWTH_SLACK = 18 / 16


def growth_figure(scans: dict, key: str = "doctor", stat: Callable[[list[float]], float] = med
                  ) -> tuple[int, int, float, float] | None:
    """(first pair's smaller N, last pair's larger N, seconds per added process in the last
    pair / in the first, limit).

    The slope between two sizes is the cost of each added process, whatever start-up costs
    (a head start once hid part of a small population's pass in it)."""
    pairs = slopes(scans, key, stat)
    if len(pairs) < 2 or pairs[0][2] <= 0:
        return None
    return pairs[0][0], pairs[-1][1], pairs[-1][2] / pairs[0][2], GROWTH_SLACK


#: doctor against fuser, lsof and the bare loop, by N (issue 32 §7): at N=4000 doctor must
#: beat a loop that reads everything.
TARGETS = {1000: {"fuser": 0.8, "lsof": 0.3, "floor": 1.5},
           4000: {"fuser": 0.4, "lsof": 0.15, "floor": 0.8}}


def evaluate_targets(c: Ctx) -> list[dict]:
    res = c.results
    scans, st, sd = res.get("scan", {}), res.get("start"), res.get("shutdown")
    out: list[dict] = []

    def add(name: str, value: float | None, limit: float, fmt: str, lim_fmt: str) -> None:
        out.append({"name": name, "value": value, "limit_value": limit,
                    "figure": "not measured" if value is None else fmt.format(value),
                    "limit": lim_fmt.format(limit), "met": None if value is None else value <= limit})

    for n, limits in TARGETS.items():
        s = scans.get(n)
        m = {k: med(v) for k, v in s["samples"].items()} if s else None
        for other, label in (("fuser", "fuser"), ("lsof", "lsof"), ("floor", "bare Python loop")):
            add(f"doctor / {label} at N={n}", m and m["doctor"] / m[other], limits[other],
                "{:.3f} x", "{:.2f} x")
    s = scans.get(1000)
    g = growth_figure(scans)
    add(f"growth: doctor's cost per process, N={g[0]}..{g[1]}" if g else "growth: doctor's cost per process",
        g and g[2], g[3] if g else GROWTH_SLACK, "{:.2f} x", "{:.3f} x")
    sm = {k: med(v) for k, v in st["samples"].items()} if st else None
    add("xpuctl --version / python -c 'import typer'", sm and sm["version"] / sm["import_typer"], 1.15,
        "{:.3f} x", "{:.2f} x")
    add("completion request / python -c 'import typer'", sm and sm["complete"] / sm["import_typer"], 1.3,
        "{:.3f} x", "{:.2f} x")
    add("xpuctl doctor --json on the idle host", sm and sm["doctor_idle"], 0.35, "{:.3f} s", "{:.2f} s")
    add("doctor peak RSS at N=1000", s and med(s["rss_kib"]) / 1024, 80.0, "{:.1f} MiB", "{:.0f} MiB")
    ov = (med(sd["samples"]["xpuctl"]) - med(sd["samples"]["alone"])) if sd else None
    add("shutdown overhead (xpuctl shutdown - fake alone)", ov, 0.3, "{:.3f} s", "{:.2f} s")
    imp = sd.get("imports") if sd else None
    bad = sorted({f"{n}: {m2}" for n, i in (imp or {}).items() for m2 in i["forbidden"]})
    out.append({"name": "no command imports torch/ipex/pyzes/vllm", "value": len(bad) if imp else None,
                "limit_value": 0, "figure": ("none imported" if not bad else "; ".join(bad)) if imp else "not measured",
                "limit": "none", "met": (not bad) if imp else None})
    return out


def host_facts(c: Ctx) -> dict:
    try:
        git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or "?"
        if subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "xpuctl"],
                          timeout=10).returncode:
            git += "+dirty"
    except (OSError, subprocess.SubprocessError):
        git = "?"
    ver = subprocess.run([c.xpuctl, "--version"], capture_output=True, text=True, env=c.env).stdout.split()
    pyver, typer_ver = (subprocess.run(
        [c.py, "-c", "import sys, importlib.metadata as m; print(sys.version.split()[0], m.version('typer'))"],
        capture_output=True, text=True).stdout.split() + ["?", "?"])[:2]
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count(),
            "mem_total_gib": meminfo_kib("MemTotal") / MIB, "kernel": platform.release(),
            "python": f"{c.py} (Python {pyver})", "typer": typer_ver, "xpuctl": c.xpuctl,
            "bytecode": "PYTHONDONTWRITEBYTECODE=1" if c.args.no_bytecode_cache else "private PYTHONPYCACHEPREFIX",
            "xpuctl_version": ver[-1] if ver else "?", "git": git, "load_start": loadavg(),
            "procs_before": count_procs()}


def interpreter_of(script: str) -> str:
    """The interpreter in a console script's #! line (so comparisons use the same Python)."""
    try:
        with open(script, "rb") as f:
            first = f.readline().decode().strip()
        if first.startswith("#!"):
            cand = shlex.split(first[2:])[0]
            if os.access(cand, os.X_OK) and "python" in os.path.basename(cand):
                return cand
    except (OSError, IndexError, UnicodeDecodeError):
        pass
    return sys.executable
