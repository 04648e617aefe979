"""Real Ray for tests: clusters on this machine, started and stopped by the test itself.

* ``RayCluster``: a multi-node cluster (``ray.cluster_utils.Cluster``, one raylet per node, each
  node with its own environment, e.g. its own XPUCTL_ROOT) held by ``ray_cluster_host.py`` in a
  session of its own; ``stop()`` closes its stdin (the cluster shuts down), then kills its
  process group, then reaps by token whatever is left (Ray starts workers in process groups of
  their own). Never by name. The cluster's processes write under a temporary directory of
  the cluster's own (TMPDIR: Ray's session directory, `$TMPDIR/ray/session_*`, logs and
  sockets, 2-3 MiB a cluster; Python's `pymp-*` directories, which the dashboard's
  multiprocessing forkserver leaves when Ray kills it), removed once the cluster is gone: the
  suite left 6 `pymp-*` and 6 session directories in /tmp at every run.
* ``ray_env``: the environment of a cluster's processes and of its clients: a token of the
  test's own (RAY_AUTH_TOKEN_PATH), token mode, and the test's reaper token.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from proctools import reap_token, token_env

HERE = Path(__file__).resolve().parent


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def ray_env(token: str, auth_dir: str | os.PathLike, **extra: str) -> dict[str, str]:
    """Environment for cluster processes and their clients (the CLI finds the token the way
    Ray does: RAY_AUTH_TOKEN_PATH)."""
    path = Path(auth_dir) / "auth_token"
    if not path.exists():
        path.write_text(os.urandom(16).hex())
    env = token_env(token, RAY_AUTH_TOKEN_PATH=str(path), RAY_USAGE_STATS_ENABLED="0", **extra)
    env.pop("RAY_ADDRESS", None)
    return env


def _stop_group(proc: subprocess.Popen, token: str, grace: float) -> None:
    try:
        if proc.stdin:
            proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started, and only it
    except OSError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    reap_token(token)


class RayCluster:
    def __init__(self, token: str, env: dict[str, str], nodes: list[dict],
                 timeout: float = 180.0, plain: bool = False, hold_cpus: bool = False,
                 cwd: str | os.PathLike | None = None) -> None:
        """`nodes`: one {"env": {...}, "resources": {...}, "num_cpus": n} per node, the head
        first; `plain` and `hold_cpus`: see ray_cluster_host.py. `cwd`: where the cluster's
        processes work (its workers too: a task's relative imports look there)."""
        self.token = token
        self.env = env
        # short: Ray's unix sockets live under it (a socket's path has 107 bytes at most)
        self.tmp = tempfile.mkdtemp(prefix="xray-", dir="/tmp")
        cfg = {"nodes": nodes, "plain": plain, "hold_cpus": hold_cpus}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "ray_cluster_host.py"), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**env, "TMPDIR": self.tmp}, start_new_session=True, text=True, cwd=cwd,
        )
        try:
            self.info = json.loads(self._first_line(timeout))
            self.address = self.info["address"]
        except BaseException:
            self.stop()
            raise

    def _first_line(self, timeout: float) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RuntimeError(f"Ray cluster not up within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("Ray cluster host exited before the cluster was up")
        return line

    def stop(self) -> None:
        _stop_group(self.proc, self.token, 30.0)
        shutil.rmtree(self.tmp, ignore_errors=True)  # made by this cluster, which is gone
