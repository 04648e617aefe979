"""What runs on every node of a Ray cluster for `doctor --ray`, `ps --ray`, `devices --ray`.

A Ray task pinned to its node, in the node's own Python: it has Ray, and xpuctl's package only
because the task shipped it (its sources as one zip, `xpuctl.ray.child.on_node`). So this
module and what it imports stay below the CLI: no typer, no rich. The node honours its own XPUCTL_ROOT (its raylet's
environment: a container that mounts the host at /host sets it there); the caller's --root is
not sent. Ray actors on the node are tied through the node's own connection to Ray.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any


def _state(waiting: Any) -> dict[str, Any]:
    """Ray's state from inside a task (already connected; no child needed)."""
    from xpuctl.errors import RayError
    from xpuctl.ray.child import classify, fetch_state

    try:
        return fetch_state(None, 10.0)
    except Exception as exc:
        raise RayError(classify(exc).args[0]) from None


def _doctor(host: Any, environ: dict[str, str], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any], int]:
    from xpuctl.core.cluster import family_to_data
    from xpuctl.doctor import blocking, diagnose
    from xpuctl.output.documents import doctor_dict
    from xpuctl.output.prometheus import families
    from xpuctl.state.statedir import resolve_state_dir

    # the environment check judges a caller's environment: a node's task has none ({})
    report = diagnose(host, list(options.get("devices") or []), options.get("port"),
                      bool(options.get("expect_idle")), {},
                      state_dir=resolve_state_dir(host, None, environ), ray_fetch=_state)
    code = 1 if blocking(report, bool(options.get("strict"))) else 0
    return doctor_dict(report), [family_to_data(f) for f in families(report)], code


def _scan(host: Any, environ: dict[str, str]) -> Any:
    from xpuctl.host.scan import take_scan
    from xpuctl.ray.actors import with_ray

    return with_ray(host, take_scan(host, port=None, want_env=False, artifacts=False), environ,
                    fetch=_state)


def _ps(host: Any, environ: dict[str, str], options: dict[str, Any]) -> dict[str, Any]:
    from xpuctl.output.documents import ps_document

    scan = _scan(host, environ)
    show_all = bool(options.get("all"))
    return ps_document([], [p for p in scan.processes if p.role is not None or show_all], scan)


def _devices(host: Any, environ: dict[str, str]) -> dict[str, Any]:
    from xpuctl.output.documents import devices_document, process_dict

    scan = _scan(host, environ)
    return {**devices_document(scan, None), "processes": [process_dict(p) for p in scan.processes]}


def run(command: str, options: dict[str, Any]) -> dict[str, Any]:
    """One node's answer: {hostname, root, document, metrics (doctor's families), exit_code,
    seconds}. The node's environment (its raylet's) is the command's environment here."""
    from xpuctl.host.seam import Host

    started = time.monotonic()
    environ = dict(os.environ)
    root = environ.get("XPUCTL_ROOT") or "/"
    host = Host(root)
    metrics: list[Any] = []
    code = 0
    if command == "doctor":
        doc, metrics, code = _doctor(host, environ, options)
    elif command == "ps":
        doc = _ps(host, environ, options)
    else:
        doc = _devices(host, environ)
    return {"hostname": socket.gethostname(), "root": root, "document": doc,
            "metrics": metrics, "exit_code": code,
            "seconds": round(time.monotonic() - started, 3)}
