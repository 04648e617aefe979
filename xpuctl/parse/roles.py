"""Recognise vLLM processes from their argv (never from `comm`, which is cut to 15 bytes).

vLLM retitles its children with setproctitle to `<PREFIX>::<Name>[_<suffix>]` (PREFIX from
VLLM_PROCESS_NAME_PREFIX, default VLLM). The top server keeps its argv: `vllm serve …` or
`python -m vllm.entrypoints.openai.api_server …`. A process that merely mentions "vllm"
in its arguments (`tail -f vllm.log`, `grep vllm`) is not vLLM: only the program that runs
counts.
"""

from __future__ import annotations

import os
import re

API_SERVER = "api-server"
ENGINE_CORE = "engine-core"
WORKER = "worker"
DP_COORDINATOR = "dp-coordinator"
RESOURCE_TRACKER = "resource-tracker"
# Candidates: generic Python multiprocessing children that are vLLM's only when their
# parent (or run) is vLLM. Resolved in probes.vllm.
TRACKER_CANDIDATE = "tracker?"
SPAWN_CANDIDATE = "spawn?"
# Ray (docs/ray.md). Ray's own processes: raylet, gcs_server, the dashboard and its
# agents, log monitor, autoscaler monitor, pooled `ray::IDLE` workers. Never holders to fix;
# part of a run only when the run started them (a local Ray under its EngineCore).
RAY = "ray"
# A Ray worker process running vLLM's worker actor (`ray::RayWorkerProc.run` for the V2
# executor, `ray::RayWorkerWrapper…` for the older one): a vLLM worker once tied to its run,
# through the process tree (its raylet under the EngineCore) or Ray's state (trees, ray/).
RAY_WORKER_CANDIDATE = "ray-worker?"
_RAY_WORKER_CLASSES = ("RayWorkerProc", "RayWorkerWrapper")
_RAY_OWN_TITLES = ("IDLE", "DashboardAgent", "RuntimeEnvAgent", "JobSupervisor")
_RAY_BINARIES = ("raylet", "gcs_server")
# Ray's Python daemons, by the tail of their script path under the ray package
_RAY_SCRIPTS = (
    "/ray/dashboard/dashboard.py", "/ray/dashboard/agent.py", "/ray/_private/log_monitor.py",
    "/ray/autoscaler/_private/monitor.py", "/ray/_private/runtime_env/agent/main.py",
    "/ray/_private/workers/default_worker.py", "/ray/_private/workers/setup_worker.py",
)

_TITLES = {
    "EngineCore": ENGINE_CORE,
    "Worker": WORKER,
    "APIServer": API_SERVER,
    "DPCoordinator": DP_COORDINATOR,
}
_TITLE_RE = re.compile(
    r"^(?P<prefix>[A-Za-z0-9_.-]+)::(?P<name>EngineCore|Worker|APIServer|DPCoordinator)"
    r"(?:_(?P<suffix>[A-Za-z0-9_]+))?$"
)
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?[a-z]?$")
_API_MODULES = {"vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server"}
_CLI_MODULES = {"vllm", "vllm.entrypoints.cli.main"}
# Interpreter options that consume the next argument.
_PY_OPTS_WITH_ARG = {"-W", "-X", "-Q"}


def classify(argv: list[str]) -> tuple[str | None, str | None]:
    """(role, suffix) for a process, or (None, None) when it is not vLLM.

    The suffix is the title's rank part (`TP1`, `DP0_TP1`, `0` for APIServer_0).
    """
    if not argv:
        return None, None
    first = argv[0]
    if first.startswith("ray::"):
        return ray_title_role(first), None
    if "::" in first:
        m = _TITLE_RE.match(first.split(" ", 1)[0] if len(argv) == 1 else first)
        if m:
            return _TITLES[m.group("name")], m.group("suffix")
        return None, None
    prog = os.path.basename(first)
    if prog in _RAY_BINARIES:
        return RAY, None
    if prog == "vllm":
        return (API_SERVER, None) if len(argv) > 1 and argv[1] == "serve" else (None, None)
    if not _PYTHON_RE.match(prog):
        return None, None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            module = argv[i + 1]
            rest = argv[i + 2 :]
            if module in _API_MODULES:
                return API_SERVER, None
            if module in _CLI_MODULES and rest[:1] == ["serve"]:
                return API_SERVER, None
            return None, None
        if arg.startswith("-m") and len(arg) > 2:
            return (API_SERVER, None) if arg[2:] in _API_MODULES else (None, None)
        if arg == "-c" and i + 1 < len(argv):
            code = argv[i + 1]
            if code.startswith("from multiprocessing.resource_tracker import main"):
                return TRACKER_CANDIDATE, None
            if code.startswith("from multiprocessing.spawn import spawn_main"):
                return SPAWN_CANDIDATE, None
            return None, None
        if arg in _PY_OPTS_WITH_ARG:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        # the script
        if os.path.basename(arg) == "vllm" and argv[i + 1 : i + 2] == ["serve"]:
            return API_SERVER, None
        if arg.endswith(_RAY_SCRIPTS):
            return RAY, None
        return None, None
    return None, None


def ray_title_role(title: str) -> str | None:
    """Role of a process Ray titled `ray::<Class>[.<method>]`: Ray's own (RAY), vLLM's worker
    actor (a candidate until tied to its run), or None (another actor or task: a plain holder).
    """
    name = title[len("ray::"):].split(" ", 1)[0]
    cls = name.split(".", 1)[0]
    if cls in _RAY_OWN_TITLES:
        return RAY
    if cls.startswith(_RAY_WORKER_CLASSES):
        return RAY_WORKER_CANDIDATE
    return None


def ray_actor_class(argv: list[str] | tuple[str, ...]) -> str | None:
    """`RayWorkerProc` for `ray::RayWorkerProc.run`; None when Ray did not title it."""
    if not argv or not argv[0].startswith("ray::"):
        return None
    return argv[0][len("ray::"):].split(" ", 1)[0].split(".", 1)[0] or None


def ray_class_name(qualified: str | None) -> str | None:
    """The class as Ray titles its process: the last dotted part of the name Ray's state
    gives. Ray's state names a class by its qualified name (`make.<locals>.RayWorkerProc`
    for one defined in a function), the title by the class's own name
    (`ray::RayWorkerProc.run`): seen with Ray 2.60."""
    return (qualified.rsplit(".", 1)[-1] or None) if qualified else None


def is_vllm_actor(class_name: str | None, name: str | None) -> bool:
    """vLLM's Ray worker actor, by class (V1 and V2 executors, wherever the class is
    defined) or by V2's actor name."""
    cls = ray_class_name(class_name)
    return bool(
        (cls and cls.startswith(_RAY_WORKER_CLASSES))
        or (name and name.startswith("vllm_Worker_"))
    )
