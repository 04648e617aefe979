"""`doctor --ray`: can Ray give vLLM each node's Intel GPUs? (issue 37 §5)

Read in Ray 2.60's source (modules ray._private.accelerators and its intel_gpu, installed with
the test extra): `get_accelerator_manager_for_resource("GPU")` picks the Intel manager only
when `IntelGPUAcceleratorManager.get_current_node_num_accelerators()` is above 0, which needs
`import dpctl` and `dpctl.SyclContext("level_zero:gpu").device_count`; without dpctl the
"GPU" resource goes to the NVIDIA manager (Ray #66167). The Intel manager's accelerator type
is `Intel-GPU-` + the device name's last two words (a node resource
`accelerator_type:Intel-GPU-Max-1550`), and it sets ZE_AFFINITY_MASK for each worker unless
RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK (Ray PR #64440; vLLM PR #58079 sets it).

The node's part runs for real (`xpuctl.node.run` on fake hosts, `import dpctl` tried in a child
of this Python, a stand-in dpctl on PYTHONPATH or none); Ray's view of the node (its resources,
as `ray.nodes()` gives them) is given as the child would. The last test runs a real two-node
Ray cluster (slow).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import fakehost
import pytest

from xpuctl import node as ray_node
from xpuctl.core.cluster import ClusterResult, node_result
from xpuctl.output import cluster as cluster_output

DPCTL = Path(__file__).parent / "standins" / "dpctl"
INTEL = {"GPU": 2.0, "accelerator_type:Intel-GPU-Max-1550": 1.0}


def answer(tmp_path, monkeypatch, dpctl: bool, host=fakehost.clean_host, **env: str) -> dict:
    """One node's answer to doctor, as its task sends it."""
    h = host(tmp_path / "h")
    monkeypatch.setenv("XPUCTL_ROOT", str(h.root))
    monkeypatch.setenv("XPUCTL_STATE_DIR", str(tmp_path / "state"))
    if dpctl:
        monkeypatch.setenv("PYTHONPATH", str(DPCTL))
    else:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    for k in ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR",
              "RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ray_node.run("doctor", {})


def cluster(result: dict, resources: dict) -> ClusterResult:
    raw = {"node_id": "01" + "ab" * 27, "ip": "10.0.0.1", "hostname": "n1",
           "resources": resources, "result": result}
    return ClusterResult("doctor", "10.0.0.1:6379", (node_result("doctor", raw),), 1.0)


def ray_findings(result: ClusterResult) -> list:
    return [f for f in result.nodes[0].findings if f.check == "ray-gpus"]


def printed(result: ClusterResult) -> str:
    from rich.console import Console

    buf = io.StringIO()
    cluster_output.print_cluster(Console(file=buf, width=300, color_system=None), result)
    return " ".join(buf.getvalue().split())


def test_no_dpctl_on_an_intel_node_means_ray_never_gives_vllm_a_card(tmp_path, monkeypatch):
    got = answer(tmp_path, monkeypatch, dpctl=False)
    assert got["ray"]["dpctl"] is False and "dpctl" in got["ray"]["dpctl_error"]
    assert got["ray"]["python"] == sys.executable
    result = cluster(got, {"GPU": 2.0})  # `ray start --num-gpus 2`: the NVIDIA manager's
    warn, info = ray_findings(result)
    assert warn.severity == "warn" and "import dpctl" in warn.message
    assert "NVIDIA manager (Ray #66167)" in warn.message and "never gets" in warn.message
    assert "install dpctl" in (warn.remedy or "")
    assert info.severity == "info" and "Ray sets ZE_AFFINITY_MASK" in info.message
    n = cluster_output.cluster_dict(result)["nodes"][0]
    assert n["ray"]["dpctl"] is False and n["ray"]["gpu_is_intel"] is False
    assert n["ray"]["intel_gpus"] == 2 and n["ray"]["gpu_resource"] == 2.0
    assert "Ray #66167" in printed(result)


def test_dpctl_and_an_intel_gpu_resource_only_report_the_masks(tmp_path, monkeypatch):
    got = answer(tmp_path, monkeypatch, dpctl=True, ZE_AFFINITY_MASK="0,1",
                 RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK="1")
    assert got["ray"]["dpctl"] is True and got["ray"]["dpctl_error"] is None
    result = cluster(got, INTEL)
    (info,) = ray_findings(result)
    assert info.severity == "info"
    assert "RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK=1" in info.message
    assert "ZE_AFFINITY_MASK=0,1" in info.message and "PR #58079" in info.message
    n = cluster_output.cluster_dict(result)["nodes"][0]
    assert n["ray"]["gpu_is_intel"] is True and n["ray"]["accelerator_type"] == "Intel-GPU-Max-1550"
    assert n["ray"]["env"]["ZE_AFFINITY_MASK"] == "0,1"
    assert n["ray"]["env"]["ONEAPI_DEVICE_SELECTOR"] is None
    assert result.nodes[0].exit_code == 0 and result.exit_code == 0


@pytest.mark.parametrize(("resources", "words"), [
    ({}, 'Ray\'s "GPU" resource is none with no Intel type'),
    ({"GPU": 2.0, "accelerator_type:A100": 1.0}, "accelerator type A100"),
])
def test_dpctl_but_a_gpu_resource_that_is_not_intels(tmp_path, monkeypatch, resources, words):
    result = cluster(answer(tmp_path, monkeypatch, dpctl=True), resources)
    warn = ray_findings(result)[0]
    assert warn.severity == "warn" and words in warn.message and "gets none" in warn.message


def test_fewer_gpus_in_ray_than_on_the_node(tmp_path, monkeypatch):
    result = cluster(answer(tmp_path, monkeypatch, dpctl=True),
                     {**INTEL, "GPU": 1.0})
    warn = ray_findings(result)[0]
    assert warn.severity == "warn"
    assert 'Ray offers 1 "GPU" of the node\'s 2 Intel GPU(s)' in warn.message


def test_a_node_without_intel_gpus_has_nothing_to_map(tmp_path, monkeypatch):
    result = cluster(answer(tmp_path, monkeypatch, dpctl=False, host=fakehost.no_drm_host), {})
    assert ray_findings(result) == []
    assert cluster_output.cluster_dict(result)["nodes"][0]["ray"]["intel_gpus"] == 0


def test_an_older_node_that_sends_no_ray_part_is_judged_as_before(tmp_path, monkeypatch):
    got = answer(tmp_path, monkeypatch, dpctl=False)
    del got["ray"]
    result = cluster(got, {"GPU": 2.0})
    assert ray_findings(result) == [] and result.nodes[0].ray is None
    assert "ray" not in cluster_output.cluster_dict(result)["nodes"][0]


# -- a real Ray cluster -------------------------------------------------------------------------

@pytest.mark.slow
def test_doctor_ray_on_a_real_cluster_says_which_nodes_give_their_cards(tmp_path):
    from proctools import new_token, reap_token
    from raytools import RayCluster, ray_available, ray_env
    from test_ray import cli_env_without_ray

    if not ray_available():
        pytest.skip("needs ray (the test extra)")
    token = new_token()
    fakehost.clean_host(tmp_path / "clean")  # two idle Intel GPUs
    (tmp_path / "auth").mkdir()
    env = ray_env(token, tmp_path / "auth", RAY_AUTH_MODE="token")
    root = str(tmp_path / "clean")
    cluster_ = None
    try:
        cluster_ = RayCluster(token, env, [
            # dpctl in the node's Python; Ray's "GPU" as the Intel manager declares it
            {"env": {"XPUCTL_ROOT": root, "PYTHONPATH": str(DPCTL),
                     "RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK": "1"},
             "num_gpus": 2, "resources": {"accelerator_type:Intel-GPU-Max-1550": 1}},
            # no dpctl: `--num-gpus 2` goes to the NVIDIA manager
            {"env": {"XPUCTL_ROOT": root}, "num_gpus": 2},
        ])
        client = dict(env)
        client.pop("RAY_AUTH_MODE")
        res = subprocess.run([sys.executable, "-m", "xpuctl", "doctor", "--ray",
                              cluster_.address, "--json"], capture_output=True, text=True,
                             timeout=180, env=cli_env_without_ray(tmp_path, client))
    finally:
        if cluster_ is not None:
            cluster_.stop()
        reap_token(token)
    assert res.returncode == 0, res.stderr  # warnings: the nodes' own cards are clean
    nodes = json.loads(res.stdout)["nodes"]
    by_dpctl = {n["ray"]["dpctl"]: n["ray"] for n in nodes}
    assert set(by_dpctl) == {True, False}, nodes
    good, bad = by_dpctl[True], by_dpctl[False]
    assert good["gpu_is_intel"] and good["gpu_resource"] == 2.0 and good["intel_gpus"] == 2
    assert good["env"]["RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK"] == "1"
    assert [f["severity"] for f in good["findings"]] == ["info"]
    assert not bad["gpu_is_intel"] and bad["gpu_resource"] == 2.0
    first = bad["findings"][0]
    assert first["severity"] == "warn" and "Ray #66167" in first["message"]
    assert os.path.basename(bad["python"]).startswith("python")
