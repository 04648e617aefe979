"""The Ray code that needs no Ray: tying actors by class (whatever its nesting), the one scan
with Ray and the environment it is given, and a cluster's typed answers rendered by output/
(the `xpuctl.cluster/1` document, the per-node tables, node-labelled Prometheus).

The class names are as Ray 2.60 gives them, seen on this machine: for a class defined inside a
function `make`, `ray.util.state.list_actors` says `make.<locals>.RayWorkerProc` while the
actor's process title is `ray::RayWorkerProc` between tasks and `ray::RayWorkerProc.run`
while `run` runs (Ray titles by the class's `__name__`, the state API names its
`__qualname__`).
"""

from __future__ import annotations

import io
import re

import fakehost

from xpuctl import node as ray_node
from xpuctl.core.cluster import ClusterResult, node_result
from xpuctl.core.model import Process, Scan
from xpuctl.host.scan import take_scan
from xpuctl.host.seam import Host
from xpuctl.output import cluster as cluster_output
from xpuctl.parse import roles
from xpuctl.ray import actors, bridge

NESTED = "make.<locals>.RayWorkerProc"


def _actor_proc(pid: int, title: str = "ray::RayWorkerProc.run") -> Process:
    return Process(pid=pid, ppid=1, state="S", comm="ray::RayWorkerP", cmdline=(title,),
                   start_time=None, start_ticks=0, session=pid, pgrp=pid, threads=1,
                   devices=("0000:03:00.0",))


def _scan(*procs: Process) -> Scan:
    return Scan(root="/", taken_at=0.0, devices=(), processes=procs, clients=(), dmabufs=(),
                artifacts=(), ports=(), issues=(), unreadable=0)


def _state(class_name: str, pid: int = 4242) -> dict:
    return {"actors": [{"actor_id": "a1", "name": "vllm_Worker_ab12cd34_TP1",
                        "class_name": class_name, "pid": pid, "job_id": "02000000",
                        "node_id": "n1"}],
            "jobs": [{"job_id": "02000000", "driver_pid": 999999, "driver_ip": "10.0.0.9",
                      "status": "RUNNING"}],
            "nodes": [{"node_id": "n1", "ip": "10.0.0.1"}]}


def test_the_class_ray_titles_is_the_last_part_of_its_qualified_name():
    assert roles.ray_class_name(NESTED) == "RayWorkerProc"
    assert roles.ray_class_name("RayWorkerProc") == "RayWorkerProc"
    assert roles.ray_class_name(None) is None and roles.ray_class_name("") is None
    assert roles.is_vllm_actor(NESTED, None)
    assert not roles.is_vllm_actor("make.<locals>.Trainer", None)


def test_an_actor_of_a_nested_class_is_tied_like_a_top_level_one():
    for class_name in ("RayWorkerProc", NESTED):
        tied = actors.tie(_scan(_actor_proc(4242)), _state(class_name), lambda pid: True)
        p = tied.processes[0]
        assert p.role == roles.WORKER and p.rank == "TP1", class_name
        assert p.ray is not None and p.ray.class_name == class_name  # as Ray states it


def test_an_actor_of_another_class_of_that_pid_is_not_tied():
    tied = actors.tie(_scan(_actor_proc(4242)), _state("make.<locals>.RayWorkerWrapper"),
                      lambda pid: True)
    assert tied.processes[0].role is None and tied.processes[0].ray is None


def test_the_scan_asks_ray_in_the_environment_it_is_given(monkeypatch):
    seen = {}

    def call(op, request, address, python, timeout=0.0, environ=None):
        seen.update(op=op, address=address, python=python, environ=environ)
        return _state(NESTED)

    monkeypatch.setattr(bridge, "call", call)
    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:1")  # this process's: never used
    given = {"RAY_ADDRESS": "10.0.0.5:6379", bridge.PYTHON_VAR: "/opt/ray/bin/python"}
    snap = actors.with_ray(Host("/"), _scan(_actor_proc(4242)), given)
    assert seen == {"op": "state", "address": "10.0.0.5:6379", "python": "/opt/ray/bin/python",
                    "environ": given}
    assert snap.processes[0].role == roles.WORKER


def test_a_fake_tree_is_never_tied_through_ray(tmp_path, monkeypatch):
    monkeypatch.setattr(bridge, "call", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    host = fakehost.orphan_host(tmp_path / "h")
    root = Host(str(host.root))
    snap = actors.with_ray(root, take_scan(root, port=None, artifacts=False),
                           {"RAY_ADDRESS": "10.0.0.5:6379"})
    assert snap.processes


def _answer(tmp_path, monkeypatch, command: str, which=fakehost.orphan_host) -> dict:
    host = which(tmp_path / command)
    monkeypatch.setenv("XPUCTL_ROOT", str(host.root))
    return ray_node.run(command, {})


def _cluster(command: str, *answers: dict) -> ClusterResult:
    nodes = [{"node_id": f"{i:02d}" + "ab" * 27, "ip": f"10.0.0.{i}", "hostname": f"n{i}",
              "result": a} for i, a in enumerate(answers, 1)]
    nodes.append({"node_id": "ff" * 28, "ip": "10.0.0.99", "hostname": None,
                  "error": "no answer within 20s"})
    return ClusterResult(command, "10.0.0.1:6379",
                         tuple(node_result(command, n) for n in nodes), 1.0)


def test_doctor_over_a_cluster_is_typed_and_its_prometheus_is_labelled(tmp_path, monkeypatch):
    dirty = _answer(tmp_path, monkeypatch, "doctor")
    result = _cluster("doctor", dirty)
    first, gone = result.nodes
    assert first.status == "dirty" and first.exit_code == 1 and gone.status == "error"
    assert first.findings and {f.check for f in first.findings} >= {"orphans"}
    assert result.status == "dirty" and result.exit_code == 1
    doc = cluster_output.cluster_dict(result)
    assert doc["schema"] == "xpuctl.cluster/1" and doc["nodes"][0]["doctor"] == dirty["document"]
    assert doc["nodes"][1]["error"] == "no answer within 20s"
    text = cluster_output.prometheus(result)
    assert text.count("# TYPE xpuctl_doctor_status gauge") == 1
    assert 'xpuctl_doctor_status{node="01ababab",status="dirty"} 1' in text
    assert 'xpuctl_cluster_node_up{node="ffffffff",node_id="' + "ff" * 28 + '",ip="10.0.0.99"} 0' in text
    assert re.search(r'^xpuctl_stale_bytes\{node="01ababab"\} \d+$', text, re.M)
    sample = re.compile(r'^[a-z_]+\{node="[0-9a-f]{8}"(,[a-z_]+="[^"]*")*\} [-+0-9.eE]+$|^# ')
    assert all(sample.match(line) for line in text.splitlines()), text


def _printed(result: ClusterResult) -> str:
    from rich.console import Console

    buf = io.StringIO()
    cluster_output.print_cluster(Console(file=buf, width=160, color_system=None), result)
    return buf.getvalue()


def test_ps_and_devices_over_a_cluster_use_the_tables_of_one_host(tmp_path, monkeypatch):
    from rich.console import Console

    from xpuctl.output.tables import print_devices, processes_table

    ps = _cluster("ps", _answer(tmp_path, monkeypatch, "ps"))
    node = ps.nodes[0]
    assert node.scan is not None and any(p.role for p in node.scan.processes)
    local = io.StringIO()
    Console(file=local, width=160, color_system=None).print(
        processes_table(node.scan, "vLLM processes", 160), no_wrap=True, crop=True)
    out = _printed(ps)
    assert local.getvalue() in out and "no answer: no answer within 20s" in out
    devices = _cluster("devices", _answer(tmp_path, monkeypatch, "devices"))
    node = devices.nodes[0]
    assert node.scan is not None and node.scan.devices
    assert node.scan.holders(node.scan.devices[0].bdf)  # the node's holders, from its document
    local = io.StringIO()
    print_devices(Console(file=local, width=160, color_system=None), node.scan)
    assert local.getvalue() in _printed(devices)


ON_NODE = """
import hashlib, json, os, sys
from xpuctl.ray import child
package = child.package_zip(os.path.join(sys.argv[1], "xpuctl"))
digest = hashlib.sha256(package).hexdigest()[:16]
answer = child.on_node(package, digest, "xpuctl.node", "ps", {})
print(json.dumps({"digest": digest, "schema": answer["document"]["schema"],
                  "from": sys.modules["xpuctl.node"].__file__}))
"""


def _on_node(tmp_path, env_extra: dict, name: str) -> dict:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    host = fakehost.clean_host(tmp_path / name)
    res = subprocess.run([sys.executable, "-c", ON_NODE, str(repo)], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "XPUCTL_ROOT": str(host.root), **env_extra})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_node_imports_xpuctl_from_the_shipped_zip_in_a_directory_of_its_own(tmp_path):
    import os
    import stat

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    got = _on_node(tmp_path, {"TMPDIR": str(tmp)}, "first")
    mine = tmp / f"xpuctl-ray-{os.getuid()}"
    assert got["schema"] == "xpuctl.ps/1"
    assert got["from"].startswith(str(mine / f"{got['digest']}.zip"))
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    # a directory anyone may write to is not used, nor what was put in it
    os.chmod(mine, 0o777)
    (mine / f"{got['digest']}.zip").write_bytes(b"not a zip")
    again = _on_node(tmp_path, {"TMPDIR": str(tmp)}, "again")
    assert again["schema"] == "xpuctl.ps/1" and not again["from"].startswith(str(mine) + os.sep)


ON_BARE_NODE = """
import hashlib, importlib.util, json, os, sys, threading
# xpuctl/ray/child.py by path, as the driver runs it: this Python cannot import xpuctl
spec = importlib.util.spec_from_file_location(
    "ray_child", os.path.join(sys.argv[1], "xpuctl", "ray", "child.py"))
child = importlib.util.module_from_spec(spec)
spec.loader.exec_module(child)
threading.Thread(target=threading.Event().wait, daemon=True).start()  # a Ray worker's threads
package = child.package_zip(os.path.join(sys.argv[1], "xpuctl"))
answer = child.on_node(package, hashlib.sha256(package).hexdigest()[:16], "xpuctl.node",
                       "doctor", {})
print(json.dumps({"status": answer["document"]["status"], "exit_code": answer["exit_code"]}))
"""


def test_a_node_without_xpuctl_reads_through_a_reader_of_the_shipped_xpuctl(tmp_path):
    """A plain Ray node's Python has ray and no xpuctl (issue 31 §8): a task imports xpuctl
    from the zip it was sent, and a Ray worker runs threads, so the bounded reader is
    spawned, not forked. It must run the shipped xpuctl too: it found none and every node
    answered RayTaskError(Blocked) ("the reader process ended unexpectedly")."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import xpuctl

    repo = Path(xpuctl.__file__).resolve().parent.parent  # the xpuctl under test
    trap = tmp_path / "trap" / "xpuctl"
    trap.mkdir(parents=True)
    (trap / "__init__.py").write_text("raise ImportError('this node has no xpuctl')\n")
    (tmp_path / "tmp").mkdir()
    host = fakehost.orphan_host(tmp_path / "host")
    res = subprocess.run([sys.executable, "-P", "-c", ON_BARE_NODE, str(repo)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "XPUCTL_ROOT": str(host.root),
                              "PYTHONPATH": str(tmp_path / "trap"),
                              "TMPDIR": str(tmp_path / "tmp")})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"status": "dirty", "exit_code": 1}  # the orphans


EVIL = "\x1b[31mred\x1b[0m"


def _hostile_cluster() -> ClusterResult:
    doc = {"schema": "xpuctl.doctor/1", "status": "dirty", "root": "/",
           "findings": [{"check": "orphans", "severity": "fail", "message": f"engine {EVIL}",
                         "remedy": None, "device": None, "pids": [], "paths": []}]}
    metrics = [[f"xpuctl_doctor_status{EVIL}", "x", [[{}, 1.0]]],
               ["xpuctl_doctor_check_ok", f"help {EVIL}\nline two",
                [[{"check": f"orphans{EVIL}", f"k{EVIL}": "v", "node": "forged"}, 0.0]]]]
    nodes = [{"node_id": "01" + "ab" * 27, "ip": "10.0.0.1", "hostname": f"n1{EVIL}",
              "result": {"hostname": f"n1{EVIL}", "document": doc, "exit_code": 1,
                         "seconds": 0.1, "metrics": metrics}},
             {"node_id": "02" + "ab" * 27, "ip": "10.0.0.2", "hostname": "n2",
              "error": f"Blocked: [Errno 5] {EVIL}"}]
    return ClusterResult("doctor", "10.0.0.1:6379", tuple(node_result("doctor", n) for n in nodes),
                         1.0)


def test_what_a_node_sends_is_escaped_wherever_it_is_printed():
    """A node's texts (its error, hostname, findings, metric families) come from another
    machine: on a terminal-like console, in plain output, in the serve preflight's refusal and
    in the Prometheus text, an ESC is shown escaped, never sent raw."""
    from xpuctl.output.safetext import console
    from xpuctl.ray.launch import refusal

    result = _hostile_cluster()
    for terminal in (True, False):
        buf = io.StringIO()
        cluster_output.print_cluster(console(file=buf, force_terminal=terminal, width=200),
                                     result)
        out = buf.getvalue()
        assert "\x1b[31mred" not in out and out.count("\\x1b[31mred") == 3, (terminal, out)
    message = refusal(result)
    assert message is not None and "\x1b" not in message
    assert "engine \\x1b[31mred" in message and "Blocked: [Errno 5] \\x1b[31mred" in message
    text = cluster_output.prometheus(result)
    assert "\x1b" not in text
    assert "# HELP xpuctl_doctor_check_ok help \\x1b[31mred\\x1b[0m\\nline two" in text
    assert "xpuctl_doctor_status\\x1b" not in text and "k\\x1b" not in text  # not names: dropped
    assert re.search(r'^xpuctl_doctor_check_ok\{node="01ababab",check="orphans[^"]*"\} 0$',
                     text, re.M), text
    assert 'node="forged"' not in text


def test_a_node_task_error_is_named_by_its_cause_not_by_rays_coloured_header():
    from xpuctl.ray.child import classify

    class Blocked(OSError):
        pass

    cause = Blocked(5, "the reader process ended unexpectedly")
    wrapper = type("RayTaskError(Blocked)", (Exception,), {})(
        "\x1b[36mray::on_node()\x1b[39m (pid=2220, ip=192.0.2.2)\nTraceback ...")
    wrapper.cause = cause
    assert classify(wrapper).args[0] == "Blocked: [Errno 5] the reader process ended unexpectedly"
    assert classify(wrapper).kind == "error"
