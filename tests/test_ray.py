"""vLLM on Ray, with real Ray 2.60 (issue 16): the bridge, `doctor|ps|devices --ray`, and
Ray actors tied to their run.

One 3-node cluster serves the whole module (a cluster start-up costs ~6-10 s of a 2-core
machine). Its nodes see different hosts through their own XPUCTL_ROOT (the raylet's
environment): node 0 a stand-in root whose proc is the real /proc (runs put their Ray actors
there, through a custom resource), node 1 a healthy fake host, node 2 a switch (a symlink)
between a clean and an orphaned fake host. The cluster runs with token authentication on and a
token of the module's own; the CLI finds it the way Ray does (RAY_AUTH_TOKEN_PATH).

The CLI runs in a subprocess whose Python cannot import ray (a trap on its PYTHONPATH raises
ImportError) and reaches Ray only through XPUCTL_RAY_PYTHON, as on a host whose xpuctl venv
has no ray. Everything a test starts carries the module's reaper token and is killed by it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fakehost
import pytest
from proctools import (
    TOKEN_VAR,
    StandInRoot,
    holders,
    is_gone,
    new_token,
    reap_token,
    start_fake_vllm,
    wait_for,
)
from raytools import RayCluster, ray_available, ray_env

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ray_available(), reason="needs ray (the test extra)")]


class Rig:
    def __init__(self, cluster: RayCluster, live: StandInRoot, switch: Path, base: Path,
                 token: str, env: dict[str, str], cli_env: dict[str, str]) -> None:
        self.cluster = cluster
        self.live = live
        self.switch = switch
        self.base = base
        self.token = token
        self.env = env  # Ray's processes and vLLM's
        self.cli_env = cli_env  # xpuctl's: no ray importable, XPUCTL_RAY_PYTHON

    def node2(self, which: str) -> None:
        """Point node 2's root at the clean or the orphaned fake host."""
        tmp = self.switch.with_name("node2.new")
        os.symlink(self.base / which, tmp)
        os.replace(tmp, self.switch)

    def cli(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "xpuctl", *args], capture_output=True,
                              text=True, env=env or self.cli_env, timeout=timeout)


def cli_env_without_ray(base: Path, env: dict[str, str]) -> dict[str, str]:
    """The CLI's environment: `import ray` fails in its Python; the child runs a Python that
    has ray through XPUCTL_RAY_PYTHON (a wrapper that drops the trap)."""
    trap = base / "trap" / "ray"
    trap.mkdir(parents=True, exist_ok=True)
    (trap / "__init__.py").write_text("raise ImportError('xpuctl must not import ray')\n")
    wrapper = base / "ray-python"
    wrapper.write_text(f"#!/bin/sh\nexec env -u PYTHONPATH {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return {**env, "PYTHONPATH": f"{base / 'trap'}{os.pathsep}{REPO}",
            "XPUCTL_RAY_PYTHON": str(wrapper), "XPUCTL_STATE_DIR": str(base / "state")}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    token = new_token()
    base = tmp_path_factory.mktemp("ray")
    live = StandInRoot(n_devices=2)
    # the local Ray a run starts writes its session (and Python's pymp-*) under TMPDIR: one of
    # the rig's own, short (Ray's unix sockets live there), removed with the rig
    local_tmp = tempfile.mkdtemp(prefix="xray-local-", dir="/tmp")
    cluster = None
    try:
        fakehost.healthy_host(base / "healthy")
        fakehost.clean_host(base / "clean")
        fakehost.orphan_host(base / "orphans")
        switch = base / "node2"
        os.symlink(base / "clean", switch)
        (base / "auth").mkdir()
        env = ray_env(token, base / "auth", RAY_AUTH_MODE="token", TMPDIR=local_tmp)
        client = dict(env)
        client.pop("RAY_AUTH_MODE")  # the CLI finds the token the way Ray does
        cluster = RayCluster(token, env, [
            {"env": {"XPUCTL_ROOT": live.root}, "resources": {"live": 100}},
            {"env": {"XPUCTL_ROOT": str(base / "healthy")}},
            {"env": {"XPUCTL_ROOT": str(switch)}},
        ])
        yield Rig(cluster, live, switch, base, token, env, cli_env_without_ray(base, client))
    finally:
        if cluster is not None:
            cluster.stop()
        reap_token(token)
        live.close()
        shutil.rmtree(local_tmp, ignore_errors=True)  # the rig's own; its processes are gone


def doc_of(res: subprocess.CompletedProcess[str]) -> dict:
    assert res.stdout, res.stderr
    return json.loads(res.stdout)


def one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


# -- the bridge ---------------------------------------------------------------------------


def test_unreachable_address_is_one_line_exit_6_within_30s(rig):
    from proctools import free_port

    t0 = time.monotonic()
    res = rig.cli("doctor", "--ray", f"127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 30
    assert res.returncode == 6
    line = one_line_error(res)
    assert "does not answer" in line and "--ray ADDRESS" in line


def test_no_ray_in_the_chosen_python_names_the_fix(rig):
    env = {**rig.cli_env}
    del env["XPUCTL_RAY_PYTHON"]  # this Python: its ray is the trap
    res = rig.cli("ps", "--ray", rig.cluster.address, env=env)
    assert res.returncode == 6
    assert "XPUCTL_RAY_PYTHON" in one_line_error(res)


def test_missing_or_wrong_token_is_exit_6(rig):
    env = {k: v for k, v in rig.cli_env.items() if k != "RAY_AUTH_TOKEN_PATH"}
    env.update(RAY_AUTH_TOKEN="0" * 32)
    res = rig.cli("doctor", "--ray", rig.cluster.address, env=env)
    assert res.returncode == 6
    assert "token" in one_line_error(res)


def test_child_past_its_deadline_is_killed_with_its_group(tmp_path):
    from xpuctl.errors import RayError
    from xpuctl.ray import bridge

    pidfile = tmp_path / "pid"
    slow = tmp_path / "slow-python"
    slow.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    slow.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(RayError, match="did not answer within 1s"):
        bridge.call("state", {}, "127.0.0.1:1", str(slow), timeout=1.0)
    assert time.monotonic() - t0 < 10
    assert wait_for(lambda: is_gone(int(pidfile.read_text())), 10)


# -- doctor, ps, devices --ray --------------------------------------------------------------


def test_doctor_ray_nodes_see_different_hosts(rig):
    rig.node2("orphans")
    try:
        res = rig.cli("doctor", "--ray", rig.cluster.address, "--json")
        human = rig.cli("doctor", "--ray", rig.cluster.address)
        prom = rig.cli("doctor", "--ray", rig.cluster.address, "--format", "prometheus")
    finally:
        rig.node2("clean")
    assert res.returncode == 1, res.stderr
    doc = doc_of(res)
    assert doc["schema"] == "xpuctl.cluster/1" and doc["exit_code"] == 1
    assert doc["status"] == "dirty"
    assert all("doctor" in n for n in doc["nodes"]), doc["nodes"]
    by_root = {n["doctor"]["root"]: n for n in doc["nodes"]}
    assert set(by_root) == {rig.live.root, str(rig.base / "healthy"), str(rig.switch)}
    dirty = by_root[str(rig.switch)]
    assert dirty["status"] == "dirty" and dirty["exit_code"] == 1
    assert any(f["check"] == "orphans" for f in dirty["doctor"]["findings"])
    healthy = by_root[str(rig.base / "healthy")]
    assert healthy["doctor"]["schema"] == "xpuctl.doctor/1" and healthy["exit_code"] == 0
    for n in doc["nodes"]:
        assert n["ip"] and n["hostname"] and len(n["node_id"]) > 8
    assert human.returncode == 1
    assert f"node {dirty['node_id'][:8]}  {dirty['ip']}" in human.stdout
    assert "orphans" in human.stdout and "problems on" in human.stdout
    assert f'xpuctl_doctor_check_ok{{node="{dirty["node_id"][:8]}",check="orphans"}} 0' in prom.stdout
    assert prom.stdout.count("xpuctl_cluster_node_up{") == 3


def test_ps_and_devices_ray_answer_per_node(rig):
    ps = rig.cli("ps", "--ray", rig.cluster.address, "--json")
    devices = rig.cli("devices", "--ray", rig.cluster.address, "--json")
    assert ps.returncode == 0 and devices.returncode == 0, ps.stderr + devices.stderr
    for doc, key in ((doc_of(ps), "ps"), (doc_of(devices), "devices")):
        assert doc["command"] == key and len(doc["nodes"]) == 3
        assert all(n["status"] == "ok" for n in doc["nodes"])
    live = next(n for n in doc_of(devices)["nodes"] if n["devices"]["devices"]
                and n["devices"]["devices"][0]["bdf"] == StandInRoot.bdf(0))
    assert live["devices"]["schema"] == "xpuctl.devices/1"


# -- roles and attribution ------------------------------------------------------------------


def _doctor(rig: Rig, *extra: str, env: dict[str, str] | None = None) -> dict:
    res = rig.cli("--root", rig.live.root, "doctor", "--json", *extra, env=env)
    assert res.returncode in (0, 1), res.stderr
    return doc_of(res)


def _procs(doc: dict, pids: list[int] | None = None) -> dict[int, dict]:
    return {p["pid"]: p for p in doc["processes"] if pids is None or p["pid"] in pids}


def _actor_pids(root: StandInRoot, n: int) -> list[int]:
    found: list[int] = []

    def ready() -> bool:
        found[:] = sorted({p for i in range(n) for p in holders(root.node(i))})
        return len(found) == n

    assert wait_for(ready, 90, 0.2), found
    return found


def _run(rig: Rig, token: str, run_id: str, cluster: bool, tp: int = 2,
         extra_env: dict[str, str] | None = None):
    """A fake vLLM Ray run carrying the test's own reaper token (its local Ray too); actors on
    the cluster are the cluster's processes and die with their driver."""
    env = {k: v for k, v in rig.env.items() if k != TOKEN_VAR}
    env["XPUCTL_RUN_ID"] = run_id
    env.update(extra_env or {})
    if cluster:
        env.update(RAY_ADDRESS=rig.cluster.address, FAKE_VLLM_RAY_RESOURCES='{"live": 1}')
    fv = start_fake_vllm(token, rig.live.root, tp=tp, env=env, workdir=rig.base,
                         args=["--distributed-executor-backend", "ray"])
    assert fv.wait_ready(120), fv.log()[-3000:]
    return fv


def test_local_ray_started_by_the_run_and_its_orphaned_driver(rig, proc_token):
    fv = _run(rig, proc_token, "local-run", cluster=False)
    try:
        actors = _actor_pids(rig.live, 2)
        doc = _doctor(rig)
        procs = _procs(doc)
        for pid in actors:
            assert procs[pid]["role"] == "worker" and procs[pid]["top"] == fv.pid
            assert procs[pid]["orphan"] is False and procs[pid]["run_id"] == "local-run"
        assert any(p["role"] == "ray" and p["top"] == fv.pid for p in procs.values())
        busy = [f for f in doc["findings"] if f["check"] == "device-holders"]
        assert busy and all(f"live vLLM server {fv.pid}" in f["message"] for f in busy)
        # the API server dies: EngineCore (the driver) lives on, and so do its actors
        os.kill(fv.pid, signal.SIGKILL)
        assert wait_for(lambda: is_gone(fv.pid), 10)
        doc = _doctor(rig)
        procs = _procs(doc)
        cores = [p for p in procs.values() if p["role"] == "engine-core" and p["run_id"] == "local-run"]
        assert len(cores) == 1 and cores[0]["orphan"]
        for pid in actors:
            assert procs[pid]["orphan"] and procs[pid]["top"] == cores[0]["top"]
        orphan = [f for f in doc["findings"] if f["check"] == "orphans"
                  and set(actors) <= set(f["pids"])]
        assert orphan and orphan[0]["severity"] == "fail"
    finally:
        reap_token(fv.token)


def test_existing_cluster_actors_are_tied_through_ray_state(rig, proc_token):
    fv = _run(rig, proc_token, "cluster-run", cluster=True)
    try:
        actors = _actor_pids(rig.live, 2)
        doc = _doctor(rig)
        procs = _procs(doc)
        core = next(p for p in procs.values()
                    if p["role"] == "engine-core" and p["run_id"] == "cluster-run")
        for pid in actors:
            p = procs[pid]
            assert p["role"] == "worker" and p["run_id"] == "cluster-run", p
            assert p["top"] == fv.pid and not p["orphan"]
            assert p["ray"]["class_name"] == "RayWorkerProc"
            assert p["ray"]["name"].startswith("vllm_Worker_") and p["ray"]["driver_pid"] == core["pid"]
        assert {procs[pid]["rank"] for pid in actors} == {"TP0", "TP1"}
        ps = doc_of(rig.cli("--root", rig.live.root, "ps", "--json"))
        assert {p["pid"] for p in ps["processes"] if p["role"] == "worker"} >= set(actors)
        # Ray unreachable: doctor as before, plus one finding with the fix
        blind = _doctor(rig, env={**rig.cli_env, "RAY_ADDRESS": "127.0.0.1:1"})
        bp = _procs(blind)
        assert all(bp[pid]["role"] is None for pid in actors)
        notes = [f for f in blind["findings"] if f["check"] == "inspection" and "Ray" in f["message"]]
        assert len(notes) == 1 and "XPUCTL_RAY_PYTHON" in notes[0]["remedy"]
        # the API server dies: the driver is orphaned, its actors are orphans of the same run
        os.kill(fv.pid, signal.SIGKILL)
        assert wait_for(lambda: is_gone(fv.pid), 10)
        procs = _procs(_doctor(rig))
        assert procs[core["pid"]]["orphan"]
        for pid in actors:
            assert procs[pid]["orphan"] and procs[pid]["top"] == procs[core["pid"]]["top"]
        # the orphans' shutdown (reset would do the same, but also touches other orphans of
        # this machine): the driver first, Ray reaps its actors, the devices are free
        out = rig.cli("--root", rig.live.root, "shutdown", "--pid", str(core["pid"]),
                      "--kill-after", "1", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        assert set(actors) <= set(doc_of(out)["targets"][0]["processes"])
        assert wait_for(lambda: all(is_gone(pid) for pid in actors + [core["pid"]]), 30)
        assert wait_for(lambda: not any(holders(rig.live.node(i)) for i in range(2)), 10)
    finally:
        reap_token(fv.token)


def test_an_actor_class_defined_in_a_function_is_tied_too(rig, proc_token):
    """Ray's state names such a class by its qualified name, the title by its own (issue 23)."""
    fv = _run(rig, proc_token, "nested-run", cluster=True, tp=1,
              extra_env={"FAKE_VLLM_RAY_NESTED": "1"})
    try:
        actors = _actor_pids(rig.live, 1)
        procs = _procs(_doctor(rig))
        p = procs[actors[0]]
        assert p["argv"][0].startswith("ray::RayWorkerProc"), p
        assert p["ray"]["class_name"] == "nested_worker_class.<locals>.RayWorkerProc", p
        assert p["role"] == "worker" and p["run_id"] == "nested-run" and p["top"] == fv.pid, p
    finally:
        reap_token(fv.token)


UNRELATED = """
import os, sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")

@ray.remote(num_cpus=0, resources={"live": 1})
class Trainer:
    def __init__(self, node):
        self.fd = os.open(node, os.O_RDWR)
    def pid(self):
        return os.getpid()

t = Trainer.options(name="trainer").remote(sys.argv[2])
print(ray.get(t.pid.remote()), flush=True)
time.sleep(600)
"""


def test_an_unrelated_ray_job_is_a_named_holder_never_a_run(rig):
    proc = subprocess.Popen([sys.executable, "-c", UNRELATED, rig.cluster.address,
                             rig.live.node(1)], env=rig.env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        actor = int(proc.stdout.readline())
        doc = _doctor(rig)
        p = _procs(doc)[actor]
        assert p["role"] is None and p["run_id"] is None and not p["orphan"]
        assert p["ray"]["class_name"] == "Trainer" and p["ray"]["name"] == "trainer"
        held = [f for f in doc["findings"] if actor in f["pids"]]
        assert held and "Ray actor Trainer 'trainer' of job" in held[0]["message"]
        assert not any(actor in f["pids"] for f in doc["findings"] if f["check"] == "orphans")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- serve and shutdown of a Ray run -----------------------------------------------------------


def _serve(rig: Rig, token: str, name: str, cluster: bool, *opts: str, faults: str = "",
           timeout: float = 180) -> subprocess.CompletedProcess[str]:
    from proctools import FAKE_VLLM, free_port

    env = {**rig.cli_env, TOKEN_VAR: token, "SPT_NOENV": "1", "FAKE_VLLM_EVENTS": str(rig.base / f"{name}.jsonl"),
           "FAKE_VLLM_FAULTS": faults, "RAY_AUTH_MODE": "token",
           "PYTHONPATH": str(REPO)}  # vLLM's own Python has ray
    if cluster:  # the actors go to node 0, whose root is the stand-in
        env.update(RAY_ADDRESS=rig.cluster.address, FAKE_VLLM_RAY_RESOURCES='{"live": 1}')
    return rig.cli("--root", rig.live.root, "serve", "--vllm", f"{sys.executable} {FAKE_VLLM} serve",
                   "--detach", "--quiet", "--name", name, "--ready-timeout", "120",
                   "--drain-timeout", "2", "--teardown-timeout", "4", "--port", str(free_port()),
                   *opts, "fake-model", "--distributed-executor-backend", "ray",
                   "--tensor-parallel-size", "2", env=env, timeout=timeout)


def _record(rig: Rig, name: str) -> dict:
    return json.loads((rig.base / "state" / "runs" / f"{name}.json").read_text())


def _audit(rig: Rig) -> list[dict]:
    path = rig.base / "state" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_serve_with_its_own_ray_and_shutdown(rig, proc_token):
    res = _serve(rig, proc_token, "ray-local", cluster=False)
    assert res.returncode == 0, res.stderr
    rec = _record(rig, "ray-local")
    try:
        assert rec["ray_cluster"] == "local" and rec["ray_nodes"][0]["node_id"] == "local"
        assert "--distributed-executor-backend" in rec["command"]
        actors = _actor_pids(rig.live, 2)
        procs = _procs(_doctor(rig))
        assert all(procs[p]["run_id"] == rec["run_id"] and procs[p]["role"] == "worker" for p in actors)
        local_ray = [p for p in procs.values() if p["role"] == "ray" and p["run_id"] == rec["run_id"]]
        assert local_ray  # raylet, gcs_server, ...: the run's own Ray
        out = rig.cli("--root", rig.live.root, "shutdown", "ray-local", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        assert wait_for(lambda: all(is_gone(p) for p in actors + [r["pid"] for r in local_ray]), 30)
    finally:
        rig.cli("--root", rig.live.root, "shutdown", "ray-local", "--kill-after", "1")


def test_serve_onto_a_cluster_records_its_nodes_and_shutdown_proves_the_actors_gone(rig, proc_token):
    res = _serve(rig, proc_token, "ray-cluster", cluster=True)
    assert res.returncode == 0, res.stderr
    assert "Ray cluster" in res.stderr and "are clean" in res.stderr
    rec = _record(rig, "ray-cluster")
    try:
        assert rec["ray_cluster"] == rig.cluster.address
        [node] = rec["ray_nodes"]
        assert len(node["actors"]) == 2 and all(a.startswith("vllm_Worker_") for a in node["actors"])
        actors = _actor_pids(rig.live, 2)
        out = rig.cli("--root", rig.live.root, "shutdown", "ray-cluster", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        phases = [e["phase"] for e in doc_of(out)["events"]]
        assert "ray" in phases and "ray-gone" in phases, out.stdout
        assert all(is_gone(p) for p in actors)
        assert any(e["action"] == "signal" and e["signal"] == "SIGTERM" for e in _audit(rig))
    finally:
        rig.cli("--root", rig.live.root, "shutdown", "ray-cluster", "--kill-after", "1")


def test_actors_outliving_their_driver_are_killed_through_ray_by_name(rig, proc_token):
    res = _serve(rig, proc_token, "ray-leak", True, faults="detached-actors")
    assert res.returncode == 0, res.stderr
    try:
        actors = _actor_pids(rig.live, 2)
        out = rig.cli("--root", rig.live.root, "shutdown", "ray-leak")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "ray.kill vllm_Worker_" in out.stdout + out.stderr
        assert wait_for(lambda: all(is_gone(p) for p in actors), 30)
        kills = [e for e in _audit(rig) if e["action"] == "ray-kill"]
        assert len(kills) >= 2 and all(k["result"] == "sent" for k in kills)
        assert {k["target"]["name"][:12] for k in kills} == {"vllm_Worker_"}
    finally:
        rig.cli("--root", rig.live.root, "shutdown", "ray-leak", "--kill-after", "1")


def test_a_ray_launch_is_refused_by_one_dirty_node(rig, proc_token):
    rig.node2("orphans")
    try:
        res = _serve(rig, proc_token, "ray-refused", cluster=True)
        doc = doc_of(rig.cli("doctor", "--ray", rig.cluster.address, "--json"))
    finally:
        rig.node2("clean")
    assert res.returncode == 1, res.stderr
    line = one_line_error(res)
    dirty = next(n for n in doc["nodes"] if n["status"] == "dirty" and n["doctor"]["root"] == str(rig.switch))
    assert f"node {dirty['node_id'][:8]} ({dirty['ip']})" in line and "orphans" in line
    assert not (rig.base / "state" / "runs" / "ray-refused.json").exists()


def test_what_runs_on_a_node_needs_neither_typer_nor_rich(tmp_path):
    """A node's Python has Ray and what Ray needs: doctor, ps and devices run there with
    typer and rich unimportable, and read the node's own XPUCTL_ROOT."""
    host = fakehost.orphan_host(tmp_path / "node")
    code = ("import sys, json\n"
            "sys.modules['typer'] = None; sys.modules['rich'] = None\n"
            "from xpuctl import node\n"
            "out = {c: node.run(c, {}) for c in ('doctor', 'ps', 'devices')}\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('typer', 'rich') and sys.modules[m]]\n"
            "print(json.dumps({c: [r['exit_code'], r['root'], r['document']['schema']] for c, r in out.items()}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XPUCTL_ROOT": str(host.root), "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["doctor"] == [1, str(host.root), "xpuctl.doctor/1"]
    assert got["ps"][2] == "xpuctl.ps/1" and got["devices"][2] == "xpuctl.devices/1"
