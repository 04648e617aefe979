"""The parent side of every Ray call: which Python, which address, a hard deadline, one answer.

xpuctl never imports ray (0.3-0.7 s, and a cluster's Python is often not xpuctl's): a child
runs `xpuctl/ray/child.py` by path, with xpuctl's parent directory on its sys.path, in the
Python that has ray. The child runs in its own session and the whole group is killed at the
deadline: `ray.init` to an address where nothing listens retries for about 81 s.

The Python: `XPUCTL_RAY_PYTHON`, else the interpreter of the vLLM command when it is known,
else this interpreter (the child reports "no ray" when it has none). The address: `--ray
ADDRESS`, else `RAY_ADDRESS`, else Ray's `auto` (the cluster this host runs). The token: Ray's
own discovery (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from xpuctl.errors import RayError

PYTHON_VAR = "XPUCTL_RAY_PYTHON"
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TIMEOUT = 25.0  # every Ray error is reported within 30 s


def ray_address(given: str | None, environ: dict[str, str]) -> str:
    """`--ray ADDRESS`, else RAY_ADDRESS, else `auto`."""
    return (given or "").strip() or environ.get("RAY_ADDRESS", "").strip() or "auto"


def ray_python(environ: dict[str, str], vllm_python: str | None = None) -> str:
    """The Python the child runs in."""
    return environ.get(PYTHON_VAR, "").strip() or vllm_python or sys.executable


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: only what it started
    except OSError:
        pass


def _message(kind: str, detail: str, address: str, python: str, timeout: float) -> str:
    fixes = {
        "no-ray": f"{python} has no ray; set {PYTHON_VAR} to a Python that has it "
        "(the one vLLM runs with)",
        "no-cluster": "no running Ray cluster found on this host (address auto); pass "
        "--ray ADDRESS or set RAY_ADDRESS",
        "unreachable": f"Ray at {address} does not answer ({detail}); check the address "
        "(--ray ADDRESS or RAY_ADDRESS) and that the cluster runs (ray status)",
        "auth": f"Ray at {address} refused the token ({detail}); set RAY_AUTH_TOKEN or "
        "RAY_AUTH_TOKEN_PATH to the cluster's token (`ray get-auth-token` on its head node)",
        "timeout": f"Ray at {address} did not answer within {timeout:g}s; check the cluster "
        "(ray status)",
    }
    return fixes.get(kind) or f"Ray at {address}: {detail}"


def call(op: str, request: dict[str, Any], address: str, python: str,
         timeout: float = DEFAULT_TIMEOUT, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one child operation and return its answer; RayError (exit 6) with the fix when
    Ray cannot be asked. `request` is sent on stdin as JSON."""
    env = dict(os.environ if environ is None else environ)
    env.pop("PYTHONSTARTUP", None)
    payload = json.dumps({**request, "address": address, "deadline": timeout}).encode()
    try:
        proc = subprocess.Popen(
            [python, CHILD, op, PACKAGE_PARENT], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
        )
    except OSError as exc:
        raise RayError(f"{PYTHON_VAR}={python}: cannot run it ({exc.strerror or exc}); set it "
                       "to a Python that has ray") from None
    started = time.monotonic()
    try:
        out, err = proc.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)  # before the reap: the group id is still the child's
        proc.communicate()
        raise RayError(_message("timeout", "", address, python, timeout)) from None
    answer = _answer(out)
    if answer is None:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise RayError(f"Ray child ({python}) gave no answer: {tail[0][:300]}")
    if not answer.get("ok"):
        raise RayError(_message(str(answer.get("kind")), str(answer.get("detail", ""))[:300],
                                address, python, timeout))
    answer["elapsed"] = time.monotonic() - started
    return answer


def _answer(out: bytes) -> dict[str, Any] | None:
    """The child's one JSON document (its last line: Ray may print before it)."""
    for line in reversed(out.decode("utf-8", "surrogateescape").splitlines()):
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None
