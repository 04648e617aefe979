"""What runs on every node of a Ray cluster for `doctor --ray`, `ps --ray`, `devices --ray`.

A Ray task pinned to its node, in the node's own Python: it has Ray, and xpuctl's package only
because the task shipped it (runtime_env py_modules). So this module and what it imports stay
below the CLI: no typer, no rich. The node honours its own XPUCTL_ROOT (its raylet's
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


def _doctor(host: Any, options: dict[str, Any]) -> tuple[dict[str, Any], str, int]:
    from xpuctl.doctor import blocking, diagnose
    from xpuctl.output.documents import doctor_dict
    from xpuctl.output.prometheus import prometheus
    from xpuctl.state.statedir import resolve_state_dir

    report = diagnose(host, list(options.get("devices") or []), options.get("port"),
                      bool(options.get("expect_idle")), {},
                      state_dir=resolve_state_dir(host, None, dict(os.environ)), ray_fetch=_state)
    code = 1 if blocking(report, bool(options.get("strict"))) else 0
    return doctor_dict(report), prometheus(report), code


def _scan(host: Any) -> Any:
    from xpuctl.host.scan import take_scan
    from xpuctl.ray.actors import with_ray

    snap = take_scan(host, port=None, want_env=False, artifacts=False)
    return with_ray(host, snap, {}, fetch=_state)


def _ps(host: Any, options: dict[str, Any]) -> dict[str, Any]:
    from xpuctl.output.documents import ps_document

    snap = _scan(host)
    show_all = bool(options.get("all"))
    return ps_document([], [p for p in snap.processes if p.role is not None or show_all])


def _devices(host: Any) -> dict[str, Any]:
    from xpuctl.output.documents import devices_document, process_dict

    snap = _scan(host)
    return {**devices_document(snap, None), "processes": [process_dict(p) for p in snap.processes]}


def run(command: str, options: dict[str, Any]) -> dict[str, Any]:
    """One node's answer: {hostname, root, document, prometheus, exit_code, seconds}."""
    from xpuctl.host.seam import Host

    started = time.monotonic()
    root = os.environ.get("XPUCTL_ROOT") or "/"
    host = Host(root)
    prometheus = None
    code = 0
    if command == "doctor":
        doc, prometheus, code = _doctor(host, options)
    elif command == "ps":
        doc = _ps(host, options)
    else:
        doc = _devices(host)
    return {"hostname": socket.gethostname(), "root": root, "document": doc,
            "prometheus": prometheus, "exit_code": code,
            "seconds": round(time.monotonic() - started, 3)}
