"""What runs on every node of a Ray cluster for `doctor --ray`, `ps --ray`, `devices --ray`.

A Ray task pinned to its node, in the node's own Python: it has Ray, and xpuctl's package only
because the task shipped it (its sources as one zip, `xpuctl.ray.child.on_node`). So this
module and what it imports stay below the CLI: no typer, no rich. The node honours its own XPUCTL_ROOT (its raylet's
environment: a container that mounts the host at /host sets it there); the caller's --root is
not sent. Ray actors on the node are tied through the node's own connection to Ray. doctor
also says whether `import dpctl` works in the node's Python, and the variables that decide
which cards Ray's workers see (core/raynode.py judges them with Ray's view of the node).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

DPCTL_TIMEOUT = 8.0  # `import dpctl` in a child; the node's whole task has 20 s


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
    from xpuctl.diagnosis import blocking, diagnose
    from xpuctl.output.documents import doctor_dict
    from xpuctl.output.prometheus import families
    from xpuctl.state.statedir import resolve_state_dir

    # the environment check judges a caller's environment: a node's task has none ({})
    report = diagnose(host, list(options.get("devices") or []), options.get("port"),
                      bool(options.get("expect_idle")), {},
                      state_dir=resolve_state_dir(host, None, environ), ray_fetch=_state)
    code = 1 if blocking(report, bool(options.get("strict"))) else 0
    return doctor_dict(report), [family_to_data(f) for f in families(report)], code


def _ray_env(environ: dict[str, str]) -> dict[str, Any]:
    """This node's part of whether Ray can give vLLM its Intel GPUs (core/raynode.py): does
    `import dpctl` work in this Python (tried in a child: a pooled worker keeps no SYCL
    runtime of ours), and the variables that decide which cards Ray's workers see."""
    import subprocess
    import sys

    from xpuctl.core.raynode import MASK_VARS

    ok: bool | None
    try:
        p = subprocess.run([sys.executable, "-c", "import dpctl"], capture_output=True,
                           text=True, timeout=DPCTL_TIMEOUT, stdin=subprocess.DEVNULL)
        ok = p.returncode == 0
        last = ([ln for ln in p.stderr.splitlines() if ln.strip()] or [""])[-1][:300]
    except (OSError, subprocess.TimeoutExpired) as exc:
        ok, last = None, f"{type(exc).__name__}: {exc}"[:300]
    return {"python": sys.executable, "dpctl": ok, "dpctl_error": None if ok else last,
            "env": {k: environ.get(k) for k in MASK_VARS}}


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
    extra: dict[str, Any] = {}
    if command == "doctor":
        doc, metrics, code = _doctor(host, environ, options)
        extra["ray"] = _ray_env(environ)
    elif command == "ps":
        doc = _ps(host, environ, options)
    else:
        doc = _devices(host, environ)
    return {"hostname": socket.gethostname(), "root": root, "document": doc,
            "metrics": metrics, "exit_code": code,
            "seconds": round(time.monotonic() - started, 3), **extra}
