"""The child side of a Ray call: runs in a Python that has ray, answers with one JSON line.

Run by path: `python .../xpuctl/ray/child.py OP PACKAGE_PARENT`, the request as JSON on stdin;
xpuctl is loaded from PACKAGE_PARENT/xpuctl (`load_xpuctl`).
The node's Python may have ray but not xpuctl, typer or rich: this file imports only the
standard library and ray at the top, and xpuctl's lower layers where an operation needs them.
Ray's own log lines go to stderr; stdout carries only the answer, `{"ok": true, ...}` or
`{"ok": false, "kind": ..., "detail": ...}` (kind: no-ray, no-cluster, unreachable, auth,
error). The parent kills the child's session at its deadline.

Operations:
  state    the cluster's alive actors, jobs (driver pids) and nodes, from Ray's state API
  cluster  one task per alive node, pinned there, running xpuctl.node with xpuctl's own
           sources shipped as one object (a zip; the nodes need nothing but Ray)
  kill     ray.kill named actors of one job (by name and namespace)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any


class Failure(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def enable_token() -> bool:
    """Ray's own token discovery, for a cluster that refused a call without a token: token
    mode when RAY_AUTH_MODE is unset and a token is found (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token). True when token mode is now on and was not."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return False  # the user's own choice, already in force
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # an older Ray without token authentication
        return False
    try:
        return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))
    except Exception:
        return False


def resolve(address: str) -> str:
    """host:port of the cluster, checked to accept a TCP connection within 3 s (ray.init
    retries an address where nothing listens for about 81 s)."""
    from ray._private import services

    try:
        resolved = services.canonicalize_bootstrap_address(address)
    except ConnectionError as exc:
        raise Failure("no-cluster", str(exc)) from None
    except ValueError as exc:
        raise Failure("unreachable", str(exc)) from None
    if not resolved:
        raise Failure("no-cluster", "no address found")
    target = resolved.split("://", 1)[-1].rstrip("/")
    check_listening(target)
    _check_gcs(resolved)
    return str(resolved)


def check_listening(target: str) -> None:
    """Failure("unreachable") unless HOST:PORT accepts a TCP connection within 3 s."""
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=3.0):
            pass
    except ValueError:
        raise Failure("unreachable", f"not HOST:PORT: {target}") from None
    except OSError as exc:
        raise Failure("unreachable", f"{target}: {exc.strerror or exc}") from None


def _explicit(address: str) -> str | None:
    """HOST:PORT when the address names one (not `auto`, not a `ray://` client address)."""
    a = (address or "").strip()
    if not a or a == "auto" or "://" in a or ":" not in a:
        return None
    return a


def _check_gcs(address: str) -> None:
    """One GCS read with a short timeout: a rejected token fails here at once (ray.init
    retries it for 20 s and then reports a plain connection error).

    A token is sent only to a cluster that asks for one, as Ray's own ray.init does for an
    explicit address: the read is made without one first. A driver in token mode refuses the
    calls of a cluster's workers that have none, so on a cluster without token
    authentication every task but those that find their arguments locally fails with
    OwnerDiedError (the owner of its arguments, this driver, refused it), while a token
    found on disk (~/.ray/auth_token, left by any earlier `ray.init()`) says nothing about
    the cluster."""
    try:
        _gcs_read(address)
    except Failure as failure:
        if failure.kind != "auth" or not enable_token():
            raise
        _gcs_read(address)


def _gcs_read(address: str) -> None:
    from ray._raylet import GcsClient

    try:
        GcsClient(address=address).internal_kv_get(b"__xpuctl__", None, timeout=3)
    except Exception as exc:
        failure = classify(exc)
        raise Failure("unreachable" if failure.kind == "error" else failure.kind,
                      failure.args[0]) from None


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, Failure):
        return exc
    exc = _cause(exc)
    name = type(exc).__name__
    if isinstance(exc, ImportError) and (getattr(exc, "name", None) or "ray").startswith("ray"):
        return Failure("no-ray", f"{name}: {exc}")
    text = f"{name}: {exc}".splitlines()[0][:300] if str(exc) else name
    if name == "AuthenticationError" or "InvalidAuthToken" in text or "Unauthenticated" in text:
        return Failure("auth", text.split(". ", 1)[0])
    if isinstance(exc, ConnectionError) or name in ("RpcError", "RayStateApiException"):
        return Failure("unreachable", text)
    return Failure("error", text)


def _cause(exc: BaseException) -> BaseException:
    """What went wrong in a task (a RayTaskError's cause) rather than Ray's wrapper around it,
    whose text starts with Ray's own coloured header (`ray::on_node() (pid=.., ip=..)`) and
    goes on with the remote traceback."""
    cause = getattr(exc, "cause", None)
    if type(exc).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        return cause
    return exc


def fetch_state(address: str | None, timeout: float) -> dict[str, Any]:
    """Alive actors (pid, name, class, job, node), jobs (driver pid) and nodes (ip)."""
    from ray.util.state import list_actors, list_jobs, list_nodes

    wait = max(1, int(timeout))
    actors = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=10000,
                         timeout=wait, raise_on_missing_output=False)
    jobs = list_jobs(address=address, timeout=wait)
    nodes = list_nodes(address=address, limit=10000, timeout=wait, raise_on_missing_output=False)
    return {
        "actors": [
            {"actor_id": a.actor_id, "name": a.name or None, "class_name": a.class_name,
             "pid": a.pid, "job_id": a.job_id, "node_id": a.node_id,
             "namespace": getattr(a, "ray_namespace", None)}
            for a in actors
        ],
        "jobs": [_job(j) for j in jobs],
        "nodes": [{"node_id": n.node_id, "ip": n.node_ip, "alive": n.state == "ALIVE",
                   "name": n.node_name} for n in nodes],
    }


def _job(job: Any) -> dict[str, Any]:
    info = getattr(job, "driver_info", None)
    pid = getattr(info, "pid", None)
    status = getattr(job, "status", None)
    return {
        "job_id": job.job_id,
        "driver_pid": int(pid) if pid not in (None, "") else None,
        "driver_ip": getattr(info, "node_ip_address", None),
        "status": getattr(status, "value", status),
    }


def op_state(req: dict[str, Any]) -> dict[str, Any]:
    address = resolve(req["address"])
    return fetch_state(address, req.get("deadline", 20) / 2)


def _connect(req: dict[str, Any]) -> None:
    import logging

    import ray

    address = resolve(req["address"])
    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False,
             namespace=req.get("namespace"))


def package_zip(package: str) -> bytes:
    """xpuctl's own sources (`package` is its directory) as one zip, in memory: what a node
    imports from. Sources only, in a fixed order and with fixed dates, so that the same
    sources give the same bytes (and the same digest)."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for top, dirs, files in os.walk(package):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(top, name)
                    arc = os.path.join("xpuctl", os.path.relpath(path, package))
                    info = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
                    with open(path, "rb") as f:
                        z.writestr(info, f.read(), zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def on_node(package: bytes, digest: str, runner: str, command: str,
            options: dict[str, Any]) -> Any:
    """The task on a node (sent by value: this file runs as __main__): import xpuctl from
    the zip of the caller's sources, written once per digest into a directory of this user's
    own under the node's temporary directory (mode 0700: a file another user put there first
    is never imported), and run `runner.run(command, options)`. A pooled worker keeps the
    modules of the same digest imported from one call to the next; those of another xpuctl
    (another digest, an installed one) are dropped first."""
    import importlib
    import stat
    import sys
    import tempfile

    base = os.path.join(tempfile.gettempdir(), f"xpuctl-ray-{os.getuid()}")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        base = tempfile.mkdtemp(prefix="xpuctl-ray-")  # not ours: one of our own, this once
    path = os.path.join(base, f"{digest}.zip")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(package)
        os.replace(tmp, path)
    loaded = sys.modules.get("xpuctl")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(path):
        for name in [m for m in sys.modules if m == "xpuctl" or m.startswith("xpuctl.")]:
            del sys.modules[name]
    if path not in sys.path:
        sys.path.insert(0, path)
    started = time.monotonic()
    module = importlib.import_module(runner)
    imported = time.monotonic() - started
    answer = module.run(command, options)
    if isinstance(answer, dict):
        answer["import_seconds"] = round(imported, 3)  # xpuctl's modules, on that node
    return answer


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [
        {"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress"),
         "hostname": n.get("NodeManagerHostname"),
         # Ray's view of the node: its "GPU" and accelerator_type:* (doctor --ray's ray-gpus)
         "resources": {str(k): v for k, v in (n.get("Resources") or {}).items()
                       if k == "GPU" or str(k).startswith("accelerator_type:")}}
        for n in ray.nodes()
        if n.get("Alive")
    ]


def op_cluster(req: dict[str, Any]) -> dict[str, Any]:
    """One pinned task per alive node; a node that fails or does not answer in time is
    reported with its reason, the others still count."""
    import hashlib

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # the task: `run(command, options)` of the module the caller names (xpuctl.node),
    # imported on the node from xpuctl's sources shipped as one object: no runtime_env, so
    # a node runs it in one of its pooled workers (ray already imported) instead of
    # starting a worker of its own for the runtime env, and nothing is unpacked per call
    t0 = time.monotonic()
    package = package_zip(os.path.join(req["package_parent"], "xpuctl"))
    digest = hashlib.sha256(package).hexdigest()[:16]
    zipped = time.monotonic() - t0
    _connect(req)
    t1 = time.monotonic()
    nodes = _alive_nodes()
    shipped = ray.put(package)
    task = ray.remote(num_cpus=0, max_retries=0)(on_node)
    refs = {}
    for n in nodes:
        strategy = NodeAffinitySchedulingStrategy(node_id=n["node_id"], soft=False)
        refs[n["node_id"]] = task.options(scheduling_strategy=strategy).remote(
            shipped, digest, req["runner"], req["command"], req.get("options") or {})
    # the nodes get what is left of the parent's deadline, less a margin for the answer
    left = float(req.get("deadline") or 25.0) - (time.monotonic() - STARTED) - 3.0
    budget = max(1.0, min(float(req.get("node_timeout") or 20.0), left))
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=budget)
    done = set(ready)
    for n in nodes:
        ref = refs[n["node_id"]]
        if ref not in done:
            n["error"] = f"no answer within {budget:g}s"
            ray.cancel(ref, force=True)
            continue
        try:
            n["result"] = ray.get(ref, timeout=1.0)
        except Exception as exc:
            n["error"] = classify(exc).args[0]
    return {"nodes": nodes, "timing": {"zip": round(zipped, 3), "init": round(t1 - t0 - zipped, 3),
                                       "tasks": round(time.monotonic() - t1, 3)}}


def op_kill(req: dict[str, Any]) -> dict[str, Any]:
    """ray.kill each named actor; only actors of the given job (a name is not proof)."""
    import ray

    _connect(req)
    out = []
    for item in req.get("actors", []):
        name, namespace, job = item.get("name"), item.get("namespace"), item.get("job_id")
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            out.append({"name": name, "killed": False, "reason": "not found"})
            continue
        actual = handle._actor_id.job_id.hex() if hasattr(handle, "_actor_id") else None
        if job and actual and actual != job:
            out.append({"name": name, "killed": False, "reason": f"belongs to job {actual}"})
            continue
        ray.kill(handle, no_restart=True)
        out.append({"name": name, "killed": True, "reason": "ray.kill"})
    return {"actors": out}


OPS = {"state": op_state, "cluster": op_cluster, "kill": op_kill}
STARTED = time.monotonic()


def main(argv: list[str]) -> int:
    answer_fd = os.dup(1)
    os.dup2(2, 1)  # Ray's prints go to stderr; stdout carries only the answer
    started = time.monotonic()
    try:
        op = OPS[argv[0]]
        req = json.loads(sys.stdin.read() or "{}")
        req["package_parent"] = argv[1] if len(argv) > 1 else ""
        try:
            import ray  # noqa: F401 (is ray importable at all?)
            from ray._private import services  # noqa: F401 (a ray that is Ray)

            req["import_seconds"] = round(time.monotonic() - started, 3)
        except ImportError as exc:
            raise Failure("no-ray", str(exc)) from None
        explicit = _explicit(req.get("address", ""))
        if explicit is not None:
            # before Ray's address resolution and token (which may look up this host's own
            # address): an address where nothing listens is refused at once
            check_listening(explicit)
        answer: dict[str, Any] = {"ok": True, **op(req),
                                  "import_seconds": req.get("import_seconds")}
    except BaseException as exc:
        failure = classify(exc)
        answer = {"ok": False, "kind": failure.kind, "detail": failure.args[0]}
    answer["child_seconds"] = round(time.monotonic() - started, 3)
    os.write(answer_fd, (json.dumps(answer) + "\n").encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no ray.shutdown: the driver's exit is its disconnect, and it is faster


def load_xpuctl(parent: str) -> None:
    """Import xpuctl from `parent`/xpuctl without putting `parent` on sys.path: for an
    installed xpuctl that is its venv's site-packages, whose typer, rich or compiled modules
    must not shadow those of this Python (which may be another version)."""
    import importlib.util

    package = os.path.join(parent, "xpuctl")
    spec = importlib.util.spec_from_file_location(
        "xpuctl", os.path.join(package, "__init__.py"), submodule_search_locations=[package])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["xpuctl"] = module
    spec.loader.exec_module(module)


if __name__ == "__main__":
    # run by path: our own directory (xpuctl/ray) must not shadow anything
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    if len(sys.argv) > 2:
        load_xpuctl(sys.argv[2])
    main(sys.argv[1:])
