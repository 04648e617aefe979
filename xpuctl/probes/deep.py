"""`--deep`: the device's own view (Sysman, torch.xpu, xpu-smi, the kernel's memory query),
run in child processes and reconciled with what fdinfo shows.

Interface (also for storing and replaying probe results, e.g. `xpuctl snapshot --deep`):

    running = start(environ, timeout)        # every probe at once, each in its own session
    snap = take_snapshot(..., exclude_pids=running.pids)   # scan /proc meanwhile
    results = running.finish()               # tuple[ProbeResult]; stragglers killed at the timeout
    doc = results_to_json(results)           # {"schema": "xpuctl.probes/1", "probes": [...]}
    results = results_from_json(doc)         # back again (ProbeOutputError for a bad document)
    snap = attach(host, snap, results, load_baseline(state_dir), running.pids)

`attach` fills `snap.deep` (model.Deep) and the devices' missing memory totals. Probes always
describe the live machine (`live: true`), whatever --root says. The probe environment is the
caller's minus ZE_AFFINITY_MASK and ONEAPI_DEVICE_SELECTOR, plus PCI device order, COMPOSITE
hierarchy and Sysman, so one probe device is one PCI device and indices follow PCI order.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from xpuctl.host.seam import Host
from xpuctl.core.model import Deep, Issue, RuntimeView, Snapshot
from xpuctl.parse import kmd as kmd_parse
from xpuctl.parse import xpusmi as smi_parse
from xpuctl.parse.probes import (
    ProbeOutputError,
    ProbeProcess,
    ProbeResult,
    parse_probe_output,
    result_from_dict,
    result_to_dict,
)

SCHEMA = "xpuctl.probes/1"
PROBES = ("sysman", "torch", "xpu-smi", "kmd")
MODULES = {"sysman": "xpuctl.probes.children.sysman", "torch": "xpuctl.probes.children.torch_xpu",
           "kmd": "xpuctl.probes.children.kmd"}
USED_ORDER = ("kmd", "sysman", "torch")  # best source of used memory first (then a process list)
DROP_ENV = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")
SET_ENV = {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1", "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE",
           "ZES_ENABLE_SYSMAN": "1"}
DEFAULT_TIMEOUT = 10.0
DEFAULT_THRESHOLD = 1 << 30
OUTPUT_LIMIT = 4 << 20
BASELINE_FILE = "baseline.json"
BASELINE_SCHEMA = "xpuctl.baseline/1"


def probe_env(environ: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in DROP_ENV}
    env.update(SET_ENV)
    # the child imports xpuctl itself: make sure it finds this copy (appended: stand-ins and
    # the caller's own path entries keep precedence)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in parts:
        env["PYTHONPATH"] = os.pathsep.join([*parts, here])
    return env


class _Job:
    """One child: its own session (process group), stdout/stderr collected, exit seen by pidfd."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.t0 = time.monotonic()
        self.t1: float | None = None
        self.out = bytearray()
        self.err = bytearray()
        self.rc: int | None = None
        self.timed_out = False
        self.stuck = False
        self.pidfd: int | None = None
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True, close_fds=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        """Has the leader exited? (not reaped: its pid, hence its group, cannot be reused yet)"""
        if self.t1 is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = True  # reaped already
        if info:
            self.t1 = time.monotonic()
            self.kill_group()  # anything it left behind in its group goes with it
        return self.t1 is not None

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def seconds(self) -> float:
        return round((self.t1 or time.monotonic()) - self.t0, 3)

    def text(self) -> str:
        return self.out.decode("utf-8", "replace")

    def last_error_line(self) -> str:
        lines = [ln for ln in self.err.decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1].strip()[:200] if lines else ""


class Running:
    """Probes started by `start`; `finish` collects them (at most until the deadline)."""

    def __init__(self, jobs: list[_Job], missing: list[ProbeResult], timeout: float,
                 since: float | None = None) -> None:
        self.jobs = jobs
        self.missing = missing
        self.timeout = timeout
        first = min((j.t0 for j in jobs), default=time.monotonic())
        # `since`: when the command started (monotonic), so that the command as a whole stays
        # within the timeout; a probe still gets at least half of it
        start = first if since is None else max(min(since, first), first - timeout / 2)
        self.deadline = start + timeout

    @property
    def pids(self) -> frozenset[int]:
        return frozenset(j.pid for j in self.jobs)

    def _collect(self) -> None:
        sel = selectors.DefaultSelector()
        for j in self.jobs:
            sel.register(j.proc.stdout, selectors.EVENT_READ, (j, j.out))  # type: ignore[arg-type]
            sel.register(j.proc.stderr, selectors.EVENT_READ, (j, j.err))  # type: ignore[arg-type]
            try:
                j.pidfd = os.pidfd_open(j.pid)
                sel.register(j.pidfd, selectors.EVENT_READ, (j, None))
            except (AttributeError, OSError):
                j.pidfd = None
        try:
            while True:
                pending = [j for j in self.jobs if j.t1 is None]
                pipes = [k for k in sel.get_map().values() if k.data[1] is not None]
                if not pending and not pipes:
                    return
                left = self.deadline - time.monotonic()
                if left <= 0:
                    return
                polled = any(j.pidfd is None for j in pending)
                for key, _ in sel.select(min(left, 0.01) if polled else left):
                    j, buf = key.data
                    if buf is None:
                        sel.unregister(key.fileobj)
                        j.exited()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif len(buf) < OUTPUT_LIMIT:
                        buf += chunk
                for j in pending:
                    if j.pidfd is None:
                        j.exited()
        finally:
            sel.close()

    def finish(self) -> tuple[ProbeResult, ...]:
        try:
            self._collect()
        finally:
            for j in self.jobs:
                if not j.exited():
                    j.timed_out = True
                    j.kill_group()
                try:
                    j.rc = j.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    j.stuck = True  # in the kernel (D state): SIGKILL lands when it returns
                for f in (j.proc.stdout, j.proc.stderr):
                    if f is not None:
                        f.close()
                if j.pidfd is not None:
                    os.close(j.pidfd)
        by_name = {j.name: j for j in self.jobs}
        results = list(self.missing)
        for name in PROBES:
            if name == "xpu-smi":
                if "xpu-smi discovery" in by_name:
                    results.append(self._xpusmi(by_name["xpu-smi discovery"], by_name["xpu-smi ps"]))
            elif name in by_name:
                results.append(self._child(by_name[name]))
        order = {n: i for i, n in enumerate(PROBES)}
        return tuple(sorted(results, key=lambda r: order.get(r.name, len(order))))

    def _timed_out(self, name: str, jobs: list[_Job]) -> ProbeResult:
        why = f"no answer within {self.timeout:g} s; killed with its process group"
        if any(j.stuck for j in jobs):
            why += " (a process is stuck in the kernel and will exit when the driver returns)"
        return ProbeResult(name, False, why, None, round(self.timeout, 3), True, timed_out=True)

    def _child(self, j: _Job) -> ProbeResult:
        if j.timed_out:
            return self._timed_out(j.name, [j])
        text = j.text()
        try:
            if j.name == "kmd":
                return kmd_parse.probe_result(text, j.seconds, True)
            return parse_probe_output(text, j.name, j.seconds, True)
        except ValueError as exc:  # ProbeOutputError, KmdReplyError
            why = f"unreadable output ({exc})"
            if j.rc:
                why = f"exited with {j.rc}" + (f": {j.last_error_line()}" if j.last_error_line() else "")
            return ProbeResult(j.name, False, why, None, j.seconds, True)

    def _xpusmi(self, disc: _Job, ps: _Job) -> ProbeResult:
        if disc.timed_out or ps.timed_out:
            return self._timed_out("xpu-smi", [disc, ps])
        seconds = max(disc.seconds, ps.seconds)
        return smi_parse.probe_result((disc.rc, disc.text()), (ps.rc, ps.text()), seconds, True)


def start(environ: dict[str, str], timeout: float = DEFAULT_TIMEOUT,
          names: tuple[str, ...] = PROBES, since: float | None = None) -> Running:
    """Start every probe now, each in its own session; nothing waits here. `since`
    (time.monotonic() of the command's own start) makes the deadline count from there."""
    env = probe_env(environ)
    jobs: list[_Job] = []
    missing: list[ProbeResult] = []

    def launch(name: str, argv: list[str]) -> bool:
        try:
            jobs.append(_Job(name, argv, env))
            return True
        except OSError as exc:
            missing.append(ProbeResult(name.split(" ")[0], False, f"could not start: {exc}", None, None, True))
            return False

    try:
        for name in names:
            if name in MODULES:
                launch(name, [sys.executable, "-m", MODULES[name]])
            elif name == "xpu-smi":
                exe = shutil.which("xpu-smi", path=env.get("PATH", os.defpath))
                if exe is None:
                    missing.append(ProbeResult("xpu-smi", False, "xpu-smi is not on PATH", None, None, True))
                elif launch("xpu-smi discovery", [exe, "discovery", "-j"]) and not launch(
                    "xpu-smi ps", [exe, "ps", "-j"]
                ):
                    gone = jobs.pop()  # half a probe is none: stop the discovery just started
                    gone.kill_group()
                    gone.proc.wait()
    except BaseException:
        for j in jobs:
            j.kill_group()
            j.proc.wait()
        raise
    return Running(jobs, missing, timeout, since)


def run_probes(environ: dict[str, str], timeout: float = DEFAULT_TIMEOUT) -> tuple[ProbeResult, ...]:
    return start(environ, timeout).finish()


# -- one JSON document for storing and replaying -------------------------------------------


def results_to_json(results: tuple[ProbeResult, ...] | list[ProbeResult],
                    probe_pids: frozenset[int] | tuple[int, ...] = ()) -> dict[str, Any]:
    return {"schema": SCHEMA, "probe_pids": sorted(probe_pids),
            "probes": [result_to_dict(r) for r in results]}


def results_from_json(doc: Any) -> tuple[ProbeResult, ...]:
    """The document `results_to_json` made (a dict, or its JSON text) → results."""
    if isinstance(doc, (str, bytes)):
        try:
            doc = json.loads(doc)
        except (ValueError, RecursionError) as exc:
            raise ProbeOutputError(f"probe document is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("probes"), list):
        raise ProbeOutputError(f"not a {SCHEMA} document")
    return tuple(result_from_dict(p) for p in doc["probes"])


def probe_pids_from_json(doc: dict[str, Any]) -> tuple[int, ...]:
    pids = doc.get("probe_pids", [])
    return tuple(p for p in pids if isinstance(p, int) and not isinstance(p, bool)) if isinstance(pids, list) else ()


# -- reconciliation --------------------------------------------------------------------------


def _bdf_for(snap: Snapshot, bdf: str | None, index: int | None) -> str | None:
    if bdf:
        return bdf
    if index is not None:
        for d in snap.devices:
            if d.is_intel and d.index == index:
                return d.bdf
    return None


def reconcile(host: Host, snap: Snapshot, results: tuple[ProbeResult, ...],
              baseline: dict[str, int] | None = None,
              probe_pids: frozenset[int] | tuple[int, ...] = ()) -> Deep:
    """Per device: used memory from the best source, minus what visible holders have in
    fdinfo, minus the idle baseline. Pure arithmetic apart from the /proc existence checks."""
    baseline = baseline or {}
    own = frozenset(probe_pids)
    seen: dict[str, dict[str, Any]] = {}
    unplaced: list[str] = []
    for r in results:
        if not r.available:
            continue
        for n, pd in enumerate(r.devices):
            bdf = _bdf_for(snap, pd.bdf, pd.index)
            if bdf is not None:
                seen.setdefault(bdf, {}).setdefault(r.name, pd)
            elif pd.state == "lost":
                unplaced.append(f"{r.name} device #{n}: {pd.reason or 'device lost'}")
    order = [d.bdf for d in snap.devices if d.is_intel] + sorted(set(seen) - {d.bdf for d in snap.devices})
    views = []
    for bdf in order:
        entries = seen.get(bdf, {})
        source = next((n for n in USED_ORDER if n in entries and entries[n].memory_used_bytes is not None), None)
        used = entries[source].memory_used_bytes if source else None
        total = next((entries[n].memory_total_bytes for n in USED_ORDER
                      if n in entries and entries[n].memory_total_bytes), None)
        procs: dict[int, ProbeProcess] = {}
        psources = []
        own_bytes = 0
        for n in ("sysman", "xpu-smi"):
            listed = entries[n].processes if n in entries else None
            if listed is None:
                continue
            psources.append(n)
            for p in listed:
                if p.pid in own:
                    if n == psources[0]:
                        own_bytes += p.memory_bytes or 0
                    continue
                procs.setdefault(p.pid, p)
        if used is not None and source != "torch":
            used = max(0, used - own_bytes)  # the probes' own contexts
        if used is None and psources:
            # no memory figure: the listed processes' memory is a lower bound of what is used
            used = sum(p.memory_bytes or 0 for p in procs.values())
            source = psources[0]
        lost = tuple(f"{n}: {e.reason or 'device lost'}" for n, e in sorted(entries.items()) if e.state == "lost")
        visible = snap.memory_used(bdf) or 0
        base = baseline.get(bdf, 0)
        views.append(RuntimeView(
            bdf=bdf,
            source=source,
            memory_used_bytes=used,
            memory_total_bytes=total,
            processes=tuple(sorted(procs.values())),
            process_source="+".join(psources) or None,
            state="lost" if lost else "ok",
            lost_reasons=lost,
            visible_bytes=visible,
            baseline_bytes=base,
            unattributed_bytes=max(0, used - visible - base) if used is not None else None,
            invisible_pids=tuple(sorted(pid for pid in procs if not host.exists(f"/proc/{pid}"))),
        ))
    return Deep(tuple(results), tuple(views), tuple(sorted(own)), tuple(unplaced))


def attach(host: Host, snap: Snapshot, results: tuple[ProbeResult, ...],
           baseline: dict[str, int] | None = None,
           probe_pids: frozenset[int] | tuple[int, ...] = ()) -> Snapshot:
    """The snapshot with `deep` set and memory totals from a probe where sysfs has none."""
    deep = reconcile(host, snap, results, baseline, probe_pids)
    devices = tuple(
        d._replace(memory_total_bytes=v.memory_total_bytes)
        if d.memory_total_bytes is None and (v := deep.device(d.bdf)) and v.memory_total_bytes
        else d
        for d in snap.devices
    )
    return snap._replace(devices=devices, deep=deep)


# -- the idle baseline -----------------------------------------------------------------------


def _baseline_records(state_dir: str) -> tuple[dict[str, Any], Issue | None]:
    """The baseline file's per-device records as stored ({} when none is recorded), and why
    it could not be used, if so."""
    path = os.path.join(state_dir, BASELINE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as exc:
        return {}, Issue(path, f"baseline unreadable, taken as 0: {exc}")
    devices = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(devices, dict):
        return {}, Issue(path, "baseline is not a xpuctl.baseline/1 document, taken as 0")
    return devices, None


def _used_bytes(devices: dict[str, Any]) -> dict[str, int]:
    out = {}
    for bdf, rec in devices.items():
        value = rec.get("memory_used_bytes") if isinstance(rec, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[bdf] = value
    return out


def load_baseline(state_dir: str | None) -> tuple[dict[str, int], Issue | None]:
    """{bdf: bytes} from the state directory; none recorded is {} (a baseline of 0)."""
    if not state_dir:
        return {}, None
    devices, problem = _baseline_records(state_dir)
    return _used_bytes(devices), problem


def record_baseline(state_dir: str, snap: Snapshot) -> list[tuple[str, int | None, str]]:
    """Record the used memory of every device nothing holds. [(bdf, bytes or None, note)]."""
    from xpuctl.state.runs import ensure_state_dir

    assert snap.deep is not None
    state_dir = ensure_state_dir(state_dir)
    path = os.path.join(state_dir, BASELINE_FILE)
    devices, _ = _baseline_records(state_dir)  # one read: kept records and the current figures
    current = _used_bytes(devices)
    out: list[tuple[str, int | None, str]] = []
    for v in snap.deep.devices:
        holders = set(snap.holders(v.bdf)) | {p.pid for p in v.processes}
        used = v.memory_used_bytes
        if holders:
            out.append((v.bdf, None, f"not recorded: held by pid(s) {', '.join(map(str, sorted(holders)))}"))
        elif used is None:
            out.append((v.bdf, None, "not recorded: no probe reports its used memory"))
        elif v.state == "lost":
            out.append((v.bdf, None, "not recorded: the device is lost"))
        else:
            devices[v.bdf] = {"memory_used_bytes": used, "source": v.source, "recorded_at": time.time()}
            out.append((v.bdf, used, f"recorded from {v.source}"
                        + (f" (was {current[v.bdf]})" if v.bdf in current else "")))
    from xpuctl.state import atomic

    atomic.replace(path, json.dumps({"schema": BASELINE_SCHEMA, "devices": devices}, indent=2).encode())
    return out
