"""Tie Ray actor processes that hold devices to their vLLM run, through Ray's state.

On an existing cluster a vLLM worker actor is a child of the cluster's raylet, not of its run:
only Ray knows its job, and the job its driver (vLLM's EngineCore). The path is actor pid ->
job -> driver pid -> EngineCore -> run (docs/ray.md). Ray is asked only when a Ray actor
process holds a device and the process tree did not tie it (a run's own local Ray is tied
through the tree, for free). When Ray cannot be asked, the scan stays as it was and says so
once (an inspection finding with the fix).

`tie` is pure (a Scan and Ray's state in, a Scan out); `fetcher` is how Ray's state is read
(from a child Python that has ray); `attach` asks it when a scan needs it. `with_ray` is the
one way every command ties a scan it took: `with_ray(host, take_scan(host, ...), environ)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from xpuctl.core.model import Issue, Process, RayActor, Scan
from xpuctl.errors import RayError
from xpuctl.parse import roles

if TYPE_CHECKING:
    from xpuctl.host.seam import Host

StateFetch = Callable[[list[Process]], dict[str, Any]]


def untied(scan: Scan) -> list[Process]:
    """Processes running a Ray actor or task (titled `ray::…`, not Ray's own) that hold a
    device and that no tree placed in a run."""
    return [
        p for p in scan.processes
        if p.devices and p.role is None and roles.ray_actor_class(p.cmdline) is not None
        and not p.is_zombie
    ]


def _rank(name: str | None) -> str | None:
    """`TP1` (or `TP1_PP0`) from V2's actor name `vllm_Worker_<instance>_TP1[_PP0]`."""
    if not name or "_TP" not in name:
        return None
    return "TP" + name.rsplit("_TP", 1)[1]


def _actor(a: dict[str, Any], job: dict[str, Any] | None, alive: Callable[[int], bool],
           same_host: bool) -> RayActor:
    driver = job.get("driver_pid") if job else None
    status = str(job.get("status") or "") if job else ""
    gone = job is None or status not in ("RUNNING", "PENDING", "") or (
        same_host and driver is not None and not alive(driver))
    return RayActor(a["actor_id"], a.get("name"), a.get("class_name"), a.get("job_id"),
                    a.get("node_id"), a.get("namespace"), driver, gone)


def tie(scan: Scan, state: dict[str, Any], alive: Callable[[int], bool]) -> Scan:
    """Each untied actor process gets its Ray actor; vLLM's become workers of their run (or
    orphans, when their driver is orphaned or gone); other actors stay holders, named."""
    by_pid = {a.get("pid"): a for a in state.get("actors", []) if a.get("pid")}
    jobs = {j.get("job_id"): j for j in state.get("jobs", [])}
    node_ip = {n.get("node_id"): n.get("ip") for n in state.get("nodes", [])}
    procs = {p.pid: p for p in scan.processes}
    changed: dict[int, Process] = {}
    orphan_tops: dict[str, int] = {}  # job -> the first orphaned actor's pid (one tree per job)
    for p in untied(scan):
        a = by_pid.get(p.pid)
        if a is None or roles.ray_class_name(a.get("class_name")) != roles.ray_actor_class(p.cmdline):
            continue  # not this host's actor of that pid (pids repeat across hosts)
        job = jobs.get(a.get("job_id"))
        same_host = job is not None and job.get("driver_ip") == node_ip.get(a.get("node_id"))
        actor = _actor(a, job, alive, same_host)
        if not roles.is_vllm_actor(actor.class_name, actor.name):
            changed[p.pid] = p._replace(ray=actor)
            continue
        driver = procs.get(actor.driver_pid) if actor.driver_pid and same_host else None
        rank = _rank(actor.name)
        if driver is not None and driver.role is not None and not driver.is_zombie:
            changed[p.pid] = p._replace(role=roles.WORKER, rank=rank, top=driver.top or driver.pid,
                                        run_id=driver.run_id, orphan=driver.orphan, ray=actor,
                                        run_proven=driver.run_proven,
                                        embedded_in=driver.embedded_in)
        elif actor.driver_gone:
            top = orphan_tops.setdefault(actor.job_id or "", p.pid)
            changed[p.pid] = p._replace(role=roles.WORKER, rank=rank, top=top, orphan=True, ray=actor)
        else:  # its driver runs on another host: a worker of a run this host cannot see
            changed[p.pid] = p._replace(role=roles.WORKER, rank=rank, top=p.pid, ray=actor)
    if not changed:
        return scan
    return scan._replace(processes=tuple(changed.get(p.pid, p) for p in scan.processes))


def attach(scan: Scan, fetch: StateFetch, alive: Callable[[int], bool]) -> Scan:
    """`tie` with Ray's state, asked only when an untied Ray actor holds a device. A Ray that
    cannot be asked leaves the scan as it was, plus one issue with the fix."""
    waiting = untied(scan)
    if not waiting:
        return scan
    try:
        state = fetch(waiting)
    except RayError as exc:
        pids = ", ".join(str(p.pid) for p in waiting[:8])
        issue = Issue("ray", f"{len(waiting)} Ray actor process(es) hold devices (pids {pids}) and "
                             f"could not be tied to their run or job: {exc}")
        return scan._replace(issues=scan.issues + (issue,))
    return tie(scan, state, alive)


def fetcher(host: Host, environ: Mapping[str, str], address: str | None = None) -> StateFetch:
    """Ask Ray's state API from a child, in `environ` (the command's: it carries PATH, HOME
    and Ray's token variables): in XPUCTL_RAY_PYTHON, else the Python the actor itself runs
    (it has ray), else ours."""
    from xpuctl.ray import bridge

    env = dict(environ)

    def fetch(waiting: list[Process]) -> dict[str, Any]:
        hint = None
        if host.proc_is_live:
            try:
                hint = host.readlink(f"/proc/{waiting[0].pid}/exe")
            except OSError:
                hint = None
        python = bridge.ray_python(env, hint)
        return bridge.call("state", {}, bridge.ray_address(address, env), python,
                           timeout=15.0, environ=env)

    return fetch


def alive_on(host: Host) -> Callable[[int], bool]:
    from xpuctl.host.processes import stat_of

    def alive(pid: int) -> bool:
        st = stat_of(host, pid)
        return st is not None and st.state not in ("Z", "X")

    return alive


def with_ray(host: Host, scan: Scan, environ: Mapping[str, str], *,
             address: str | None = None, fetch: StateFetch | None = None) -> Scan:
    """`scan` (taken on `host`) with the Ray actors that hold devices tied to their run
    through Ray's state. `environ` is the command's own environment (the context's, or a Ray
    node's): where Ray is (RAY_ADDRESS, XPUCTL_RAY_PYTHON, the token). `address`: `--ray
    ADDRESS`; `fetch`: Ray's state another way (a Ray node's own connection). A fake tree's
    or an archive's pids are not the cluster's: Ray is asked for a live /proc only."""
    if not host.proc_is_live:
        return scan
    return attach(scan, fetch or fetcher(host, environ, address), alive_on(host))
