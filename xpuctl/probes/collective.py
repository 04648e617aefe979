"""The collective check (`doctor --collective`, serve's `--preflight collective`): will the
next launch's oneCCL/XCCL init and first all_reduce on these devices finish?

    result = run_collective(host, bdfs, env, timeout)   # -> core.collective.CollectiveResult

One rank per device (`probes/children/collective_rank`), all started by one leader
(`probes/children/collective_group`) in one new session; the leader's process group is
SIGKILLed as a whole at the deadline, when a rank failed (after a short grace, so the others
can say where they were), and after a clean run too, so no rank survives. When a group of two
or more hangs or fails, every device runs alone (world size 1, all at once, one more timeout)
so that the card at fault is named (each alone still runs the group's all_reduce, in a group
of one: the launch it stands for is the group's). The check of one device runs no collective:
its rank allocates and computes on the card through torch.xpu and synchronizes (`proof`
"compute"), as vLLM skips its warm-up all_reduce at world size 1 (vLLM PR #52389, after an
all_reduce in a group of one segfaulted in oneCCL on an Arc B390 iGPU, vLLM #52386), so the
check never refuses a launch vLLM itself would run. The ranks run on `runner.probe_python()`,
the Python of `--deep`'s torch probe.

Rank r uses the device torch sees at index i: its doctor index (Level Zero order, Intel GPUs
by PCI address) when the environment has no ZE_AFFINITY_MASK (doctor drops it), else its
position in that mask (serve keeps the run's own). `env` is the ranks' whole environment
except MASTER_ADDR (127.0.0.1), MASTER_PORT (a free one), RANK, LOCAL_RANK, WORLD_SIZE and
XPUCTL_COLLECTIVE_PROOF, set here. The files in /tmp and /dev/shm that appeared during the
check under a name the stale-file rules know (`core.rules`) and carry a rank's pid, or that a rank held (it says
what it holds after each phase it passes; a rank still running at the kill is looked at
before it), are returned in `files`; removing them is not done here (only actions/ deletes:
`doctor.remove_collective_files`, once the ranks are gone).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

from xpuctl.core import rules, waits
from xpuctl.core.collective import AloneRun, CollectiveRank, CollectiveResult
from xpuctl.core.model import Device
from xpuctl.core.waits import Wait
from xpuctl.host.devices import scan_devices
from xpuctl.host.seam import Host
from xpuctl.parse.collective import (
    FILE_DIRS,
    RankReport,
    earliest_phase,
    held_files,
    parse_events,
)
from xpuctl.probes.runner import probe_python, xpuctl_path
from xpuctl.state import audit

DEFAULT_TIMEOUT = 30.0
GRACE = 1.0  # after a rank failed: the others' last word, then the group is killed
RANK_MODULE = "xpuctl.probes.children.collective_rank"
GROUP_MODULE = "xpuctl.probes.children.collective_group"
OUTPUT_LIMIT = 1 << 20
FIXED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
             "XPUCTL_COLLECTIVE_PROOF")
#: what a rank proves: an all_reduce across its group (two or more devices, and each device
#: alone after such a group failed), or, for the check of one device, a computation on it
ALL_REDUCE, COMPUTE = "all_reduce", "compute"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torch_index(device: Device, env: dict[str, str]) -> int:
    """The index torch gives `device` in `env`: its position in ZE_AFFINITY_MASK when there
    is one (plain indices; a sub-device entry `i.j` counts as device i), else its doctor index."""
    index = device.index if device.index is not None else 0
    mask = env.get("ZE_AFFINITY_MASK", "").strip()
    if not mask:
        return index
    shown = [part.strip().split(".", 1)[0] for part in mask.split(",")]
    return shown.index(str(index)) if str(index) in shown else index


def _spec(slot: int, rank: int, world: int, device: int, port: int,
          env: dict[str, str], proof: str = ALL_REDUCE) -> dict[str, object]:
    e = {k: v for k, v in env.items() if k not in FIXED_ENV}
    e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
             WORLD_SIZE=str(world), XPUCTL_COLLECTIVE_DEVICE=str(device),
             XPUCTL_COLLECTIVE_SLOT=str(slot), XPUCTL_COLLECTIVE_PROOF=proof)
    return {"slot": slot, "argv": [probe_python(), "-m", RANK_MODULE], "env": e}


class _Outcome:
    def __init__(self, reports: dict[int, RankReport], timed_out: bool, stuck: tuple[int, ...],
                 held: tuple[str, ...] = ()) -> None:
        self.reports = reports
        self.timed_out = timed_out
        self.stuck = stuck  # ranks still alive after SIGKILL (in the kernel)
        # files in /tmp and /dev/shm the ranks said they hold (after each phase they passed),
        # and those the ranks still running had open, mapped or bound right before the kill
        self.held = held


def open_paths(host: Host, pids: tuple[int, ...]) -> tuple[str, ...]:
    """Files directly in /tmp or /dev/shm that these processes have open, mapped or bound
    (a unix socket: its inode in /proc/net/unix), read through the host's bounded reader;
    () when the reads do not answer."""
    try:
        found: tuple[str, ...] = host.call(_open_paths, pids)  # one round trip to the reader
    except OSError:  # a read that did not answer (Blocked is an OSError)
        return ()
    return found


def _open_paths(host: Host, pids: tuple[int, ...]) -> tuple[str, ...]:
    links: list[str] = []
    maps: list[str] = []
    for pid in pids:
        try:
            links += [link for _fd, link in
                      host.fd_links(pid, ("socket:[", *(d + "/" for d in FILE_DIRS)))]
        except OSError:
            pass
        try:
            maps.append(host.read_text(f"/proc/{pid}/maps", 8 << 20))
        except OSError:
            pass

    def unix() -> str:
        try:
            return host.read_text("/proc/net/unix", 8 << 20)
        except OSError:
            return ""

    return tuple(sorted(held_files(links, maps, unix)))


def _alive_in_group(pid: int, pgid: int) -> bool:
    """Is `pid` a live (not zombie) process of process group `pgid`? Always the live /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096).decode("ascii", "replace")
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    return len(fields) > 3 and fields[0] != "Z" and fields[0] != "X" and fields[2] == str(pgid)


OnWait = Callable[[Wait | None], None]


def _tell(on_wait: OnWait | None, phase: str, subject: str, deadline: float,
          reports: dict[int, RankReport], slots: set[int]) -> None:
    """What the group waits for: the least advanced phase of its ranks still running."""
    if on_wait is None:
        return
    running = [reports[s].phase if s in reports else None for s in sorted(slots)
               if s not in reports or not reports[s].exited]
    on_wait(Wait(phase, subject, deadline, step=earliest_phase(running) if running else None))


def _run_group(specs: list[dict[str, object]], env: dict[str, str], timeout: float,
               on_wait: OnWait | None = None, wait: tuple[str, str] = ("", "")) -> _Outcome:
    """Start the leader in a new session, collect its events until every rank exited, one
    failed (plus GRACE), or the deadline; then kill the leader's group and see it gone.
    `on_wait` hears the phase the slowest rank is in as it moves (`wait`: the Wait's phase
    and subject), and None at the end."""
    slots = {int(str(s["slot"])) for s in specs}
    proc = subprocess.Popen([probe_python(), "-m", GROUP_MODULE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True, close_fds=True)
    out = bytearray()
    timed_out = False
    try:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"ranks": specs}).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        timed_out = _collect(proc.stdout.fileno(), out, slots, time.monotonic() + timeout,
                             on_wait, wait)
    finally:
        if on_wait is not None:
            on_wait(None)
        reports = parse_events(out.decode("ascii", "replace"))
        running = tuple(r.pid for r in reports.values() if r.pid and not r.exited)
        opened = open_paths(Host("/"), running) if running else ()
        _kill(proc.pid)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    reports = parse_events(out.decode("ascii", "replace"))
    pids = [r.pid for r in reports.values() if r.pid]
    end = time.monotonic() + 1.0
    while any(_alive_in_group(p, proc.pid) for p in pids) and time.monotonic() < end:
        time.sleep(0.01)
    stuck = tuple(r.slot for r in reports.values() if r.pid and _alive_in_group(r.pid, proc.pid))
    said = (p for r in reports.values() for p in r.files)
    return _Outcome(reports, timed_out, stuck, tuple(sorted({*opened, *said})))


def _collect(fd: int, out: bytearray, slots: set[int], deadline: float,
             on_wait: OnWait | None, wait: tuple[str, str]) -> bool:
    """Read the leader's events from `fd` into `out` until every slot exited, one failed
    (the deadline then moves to GRACE from now), the pipe closed, or the deadline; True
    when the deadline came with a slot not exited."""
    told: tuple[object, ...] = ()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            if on_wait is not None:
                shown = parse_events(out.decode("ascii", "replace"))
                now_told = (*((r.phase, r.exited) for r in shown.values()), deadline)
                if now_told != told:
                    told = now_told
                    _tell(on_wait, *wait, deadline, shown, slots)
            now = time.monotonic()
            if now >= deadline:
                reports = parse_events(out.decode("ascii", "replace"))
                return not all(s in reports and reports[s].exited for s in slots)
            if not sel.select(deadline - now):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return False  # the leader and every rank have closed the pipe
            if len(out) < OUTPUT_LIMIT:
                out += chunk
            reports = parse_events(out.decode("ascii", "replace"))
            if all(s in reports and reports[s].exited for s in slots):
                return False
            if any(r.failed or r.unavailable for r in reports.values()):
                deadline = min(deadline, time.monotonic() + GRACE)


def _kill(pgid: int) -> None:
    """SIGKILL the group's session (its leader's process group: the leader is our child,
    unreaped until after this, so the group id cannot have been reused)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    audit.record("signal", {"pgid": pgid, "label": "collective check group"}, "sent",
                 signal="SIGKILL")


def _verdict(reports: list[RankReport], timeout: float) -> tuple[str, str | None, str | None]:
    """(verdict, stuck phase, reason) of one group."""
    gone = [r for r in reports if r.unavailable]
    if gone:
        return "unavailable", None, gone[0].unavailable
    if reports and all(r.done for r in reports):
        return "ok", None, None
    failed = [r for r in reports if r.failed]
    if failed:
        phase = earliest_phase([r.phase for r in failed])
        first = next(r for r in failed if (r.phase or "import") == phase)
        why = first.error or first.stderr or f"exited with {first.returncode}"
        return "failed", phase, f"rank {first.slot} failed in {phase}: {why}"
    waiting = [r for r in reports if not r.done]
    phase = earliest_phase([r.phase for r in waiting]) if waiting else "import"
    return "hung", phase, f"no answer within {timeout:g} s (stuck in {phase})"


def _new_files(before: set[str], pids: set[int], held: set[str]) -> tuple[str, ...]:
    """The known-name files that appeared during the check and either carry one of the
    ranks' pids in their name (oneCCL names its fd-exchange sockets and handle files after
    the process) or were held by a rank: it said so after a phase, or had them open, mapped
    or bound right before the kill (libfabric's /dev/shm regions, oneCCL's handle sockets,
    names without a pid, left also by a rank that exited by itself); a file of another
    process that appeared meanwhile is never one of ours."""
    out = []
    for path in sorted(_known_files() - before):
        name = path.rsplit("/", 1)[-1]
        if path in held or any(re.search(rf"(?<![0-9]){pid}(?![0-9])", name) for pid in pids):
            out.append(path)
    return tuple(out)


def _known_files() -> set[str]:
    """Names in /tmp and /dev/shm (this machine's) that a stale-file rule knows."""
    found: set[str] = set()
    for d in FILE_DIRS:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        found.update(f"{d}/{n}" for n in names if (m := rules.match(d, n)) and m[0] != "cache")
    return found


def _unavailable(reason: str, world: int = 0) -> CollectiveResult:
    return CollectiveResult("unavailable", None, world, 0.0, None, reason)


def run_collective(host: Host, devices: Sequence[str] | None, env: dict[str, str],
                   timeout: float = DEFAULT_TIMEOUT,
                   on_wait: OnWait | None = None) -> CollectiveResult:
    """The check on `devices` (BDFs; None or empty: every Intel GPU of `host`), ranks in
    `env` (see the module's doc), bounded by `timeout` (and one more for the runs alone).
    `on_wait`: told the phase the ranks are in and the deadline as they move (a countdown)."""
    t0 = time.monotonic()
    seen, _ = scan_devices(host)
    intel = sorted((d for d in seen if d.is_intel and d.index is not None), key=lambda d: d.index or 0)
    chosen = [d for d in intel if not devices or d.bdf in devices]
    if not chosen:
        return _unavailable("no Intel GPU to check" if not devices else
                            f"no Intel GPU among {', '.join(devices)}")
    env = xpuctl_path(env)
    world = len(chosen)
    index = [torch_index(d, env) for d in chosen]
    before = _known_files()
    port = free_port()
    shown = ",".join(str(d.index) for d in chosen)
    proof = COMPUTE if world == 1 else ALL_REDUCE
    group = _run_group([_spec(r, r, world, index[r], port, env, proof) for r in range(world)], env,
                       timeout, on_wait, (waits.COLLECTIVE, shown))
    reports = [group.reports.get(r, RankReport(r)) for r in range(world)]
    verdict, phase, reason = _verdict(reports, timeout)
    if group.stuck:
        reason = (f"{reason}; " if reason else "") + (
            f"rank(s) {', '.join(map(str, group.stuck))} did not die on SIGKILL (stuck in the "
            "driver): they exit when the driver returns")
    backend = next((r.backend for r in reports if r.backend), None)
    ranks = tuple(CollectiveRank(r.slot, index[r.slot], chosen[r.slot].bdf, r.phase,
                                 r.returncode if r.exited else None, r.error or (
                                     r.stderr if r.failed else None))
                  for r in reports)
    alone: tuple[AloneRun, ...] = ()
    pids = {r.pid for r in reports if r.pid}
    held = set(group.held)
    if world > 1 and verdict in ("hung", "failed"):
        specs = [_spec(i, 0, 1, index[i], free_port(), env) for i in range(world)]
        solo = _run_group(specs, env, timeout, on_wait, (waits.COLLECTIVE_ALONE, shown))
        runs = []
        for i, d in enumerate(chosen):
            rep = solo.reports.get(i, RankReport(i))
            v, p, _ = _verdict([rep], timeout)
            runs.append(AloneRun(d.bdf, v, p))
            if rep.pid:
                pids.add(rep.pid)
        held.update(solo.held)
        alone = tuple(runs)
    return CollectiveResult(verdict, backend, world, round(time.monotonic() - t0, 3), phase,
                            reason, ranks, alone, _new_files(before, pids, held), proof)
