"""`doctor --ray` on a plain Ray 2.60 cluster (issue 31 §8): what the project's own Ray tests
(test_ray.py) did not see. Their cluster runs in token mode, in the venv's Python where xpuctl
is installed; a plain `ray.cluster_utils.Cluster` (or `ray start`) has neither, and every node
answered an error:

- `RayTaskError(Blocked)`: the nodes' Python has ray and nothing of xpuctl (docs/ray.md: the
  nodes need nothing but Ray). A node task imports xpuctl from the zip it is sent, and a Ray
  worker runs threads, so its bounded reader is spawned, not forked: the spawned reader found
  no xpuctl and ended at once. Here the nodes' Python finds a trap instead of xpuctl
  (PYTHONPATH), as on a node without it.
- `RayTaskError(OwnerDiedError)`: the cluster has no token authentication (Ray 2.60 turns it on
  for a local `ray.init()` only), while this host has a token on disk (`~/.ray/auth_token`,
  left by any earlier `ray.init()`; here RAY_AUTH_TOKEN_PATH). The driver turned token mode
  on from that file alone and refused the calls of the nodes' workers: a task whose argument
  (xpuctl's zip) had to be fetched from the driver failed (seen: the second node of two,
  every time).

Each node has one CPU (`num_cpus=1`); in the two-node cluster an actor of another driver
holds it, as a busy node's work does: the per-node task asks for none and still runs.
The nodes read this machine's real /proc (root /). The cluster and xpuctl work in a directory
of their own: Ray's workers work in their raylet's working directory, and `python -m` looks
there first; the repository's root, which holds xpuctl's sources, hid the first failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from proctools import new_token, reap_token, token_env
from raytools import RayCluster, ray_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ray_available(), reason="needs ray (the test extra)")]


def _without_ray_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


@pytest.mark.parametrize(("n_nodes", "busy"), [(1, False), (2, True)],
                         ids=["one-node", "two-busy-nodes"])
def test_doctor_ray_answers_for_every_node_of_a_plain_cluster(tmp_path, n_nodes, busy):
    token = new_token()
    trap = tmp_path / "trap" / "xpuctl"
    trap.mkdir(parents=True)
    (trap / "__init__.py").write_text("raise ImportError('this node has no xpuctl')\n")
    token_file = tmp_path / "auth_token"
    token_file.write_text(os.urandom(16).hex())
    nodes_env = token_env(token, _without_ray_settings(), PYTHONPATH=str(tmp_path / "trap"),
                          RAY_USAGE_STATS_ENABLED="0")
    cli_env = token_env(token, _without_ray_settings(), RAY_AUTH_TOKEN_PATH=str(token_file),
                        XPUCTL_STATE_DIR=str(tmp_path / "state"))
    cluster = None
    try:
        cluster = RayCluster(token, nodes_env, [{"num_cpus": 1}] * n_nodes, plain=True,
                             hold_cpus=busy, cwd=tmp_path)
        assert cluster.info["held"] == (n_nodes if busy else 0)
        res = subprocess.run([sys.executable, "-m", "xpuctl", "doctor", "--ray", cluster.address,
                              "--json"], capture_output=True, text=True, env=cli_env, timeout=120,
                             cwd=tmp_path)
    finally:
        if cluster is not None:
            cluster.stop()
        reap_token(token)
    assert res.returncode in (0, 1), res.stderr
    doc = json.loads(res.stdout)
    assert len(doc["nodes"]) == n_nodes
    for node in doc["nodes"]:
        assert "error" not in node, node["error"]
        assert node["doctor"]["schema"] == "xpuctl.doctor/1" and node["doctor"]["root"] == "/"
    assert doc["exit_code"] == max(n["exit_code"] for n in doc["nodes"])
