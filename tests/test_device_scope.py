"""`--device` scopes reset, shutdown and doctor (issue 29 §3).

A tree is tied to a device when one of its processes holds that device's render node (the fd
scan), its ZE_AFFINITY_MASK names it, or its proven run's record claims it. With `--device`,
a tree tied to other devices, or to none, is left alone (and the plan says so), and so are
stale files: a file whose process is gone is tied to no device. Before, `reset --device 0`
stopped an orphaned tree that held only device 1 (its EngineCore held no device at all).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fakehost as fh
import pytest
from proctools import pidns_available
from typer.testing import CliRunner

from xpuctl.cli import app

runner = CliRunner()
PY = sys.executable
SUPPORT_DIR = Path(__file__).resolve().parent / "support"


def _json(root: Path, *args: str) -> tuple[int, dict]:
    res = runner.invoke(app, ["--root", str(root), *args])
    assert "Traceback" not in res.output, res.output
    return res.exit_code, json.loads(res.stdout)


@pytest.fixture
def host(tmp_path):
    return fh.device_scope_host(tmp_path / "root")


def test_reset_device_plans_only_the_trees_tied_to_it(host):
    code, doc = _json(host.root, "reset", "--device", fh.BDF1, "--dry-run", "--json")
    plan = doc["plan"]
    assert code == 0
    assert plan["orphan_pids"] == [host.on1, host.on1_worker], plan
    notes = plan["notes"]
    assert (f"skipped: orphaned vLLM tree {host.masked} is tied to {fh.BDF0}, not to {fh.BDF1}"
            in notes)
    assert any(n.startswith(f"skipped: orphaned vLLM tree {host.bare} holds no device")
               for n in notes)
    # the stale file is tied to no device: kept, and said
    assert plan["files"] == [] and any(n.startswith("kept: 1 stale file(s)") for n in notes), notes


def test_a_tree_is_tied_to_the_device_its_affinity_mask_names(host):
    code, doc = _json(host.root, "reset", "--device", "0", "--dry-run", "--json")
    assert code == 0 and doc["plan"]["orphan_pids"] == [host.masked], doc["plan"]


def test_without_device_reset_plans_every_orphan_and_file(host):
    _, doc = _json(host.root, "reset", "--dry-run", "--json")
    plan = doc["plan"]
    assert plan["orphan_pids"] == sorted([host.on1, host.on1_worker, host.masked, host.bare])
    assert [f["path"] for f in plan["files"]] == [host.paths["stale"]]


def test_doctor_device_judges_only_the_trees_tied_to_it(host):
    code, doc = _json(host.root, "doctor", "--device", fh.BDF0, "--json")
    orphans = {tuple(f["pids"]): f["severity"] for f in doc["findings"] if f["check"] == "orphans"}
    # the masked tree is the device's (fail); the bare one's device is unknown (warn); the
    # tree on device 1 is none of its business
    assert orphans == {(host.masked,): "fail", (host.bare,): "warn"}, orphans
    stale = [f for f in doc["findings"] if f["check"] == "stale-shm"]
    assert stale and "without --device" in stale[0]["remedy"]
    assert code == 1


def test_shutdown_device_and_all_stop_only_trees_tied_to_the_devices(host):
    code, doc = _json(host.root, "shutdown", "--device", fh.BDF0, "--dry-run", "--json")
    assert code == 0 and [t["top"] for t in doc["targets"]] == [host.masked], doc
    code, doc = _json(host.root, "shutdown", "--all", "--device", fh.BDF1, "--dry-run", "--json")
    assert code == 0 and [t["top"] for t in doc["targets"]] == [host.on1], doc
    code, doc = _json(host.root, "shutdown", "--all", "--dry-run", "--json")
    assert sorted(t["top"] for t in doc["targets"]) == sorted([host.on1, host.masked, host.bare])


# -- real processes ---------------------------------------------------------------------------

_DRIVER = r"""
import json, os, signal, subprocess, sys
support, token, workdir, state = sys.argv[1:5]
sys.path.insert(0, support)
from proctools import StandInRoot, is_gone, token_env, wait_for
out = {"pid": os.getpid()}
root = StandInRoot(workdir, n_devices=2)
R = root.root
env = token_env(token, SPT_NOENV="1")
def xp(*args):
    p = subprocess.run([sys.executable, "-m", "xpuctl", "--root", R, "reset", "--yes", "--json",
                        "--state-dir", state, "--kill-after", "1", "--timeout", "5", *args],
                       capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                       env=env)
    return {"code": p.returncode, "out": p.stdout, "err": p.stderr}
def orphaned_tree(name, node):
    # a library job whose script is SIGKILLed: its EngineCore (holding nothing) and worker
    # (holding `node`) are reparented to init, orphans
    d = os.path.join(workdir, name)
    os.mkdir(d)
    script = subprocess.Popen([sys.executable, os.path.join(support, "embedded_vllm.py"),
                               "script", d, "-", os.path.join(R, "dev/dri", node)],
                              env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    pids = []
    for f in ("engine", "worker0"):
        path = os.path.join(d, f + ".pid")
        wait_for(lambda: os.path.exists(path), 60)
        pids.append(int(open(path).read()))
    os.kill(script.pid, signal.SIGKILL)
    script.wait()
    wait_for(lambda: open(f"/proc/{pids[0]}/stat").read().rsplit(")", 1)[1].split()[1] == "1", 30)
    return pids
try:
    out["on1"] = orphaned_tree("on1", "renderD129")
    out["on0"] = orphaned_tree("on0", "renderD128")
    stale = os.path.join(R, "dev/shm/psm_dead3")
    open(stale, "wb").write(b"x")
    out["device0"] = xp("--device", "0")
    out["on0_gone"] = wait_for(lambda: all(is_gone(p) for p in out["on0"]), 30)
    out["on1_alive"] = [not is_gone(p) for p in out["on1"]]
    out["stale_kept"] = os.path.exists(stale)
    out["all"] = xp()
    out["on1_gone"] = wait_for(lambda: all(is_gone(p) for p in out["on1"]), 30)
    out["stale_removed"] = not os.path.exists(stale)
finally:
    root.close()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not pidns_available(), reason="needs unshare --pid (root)")
def test_reset_device_0_leaves_an_orphaned_tree_of_device_1(tmp_path, proc_token):
    """Real orphans in a private PID namespace: one tree on device 1 and one on device 0,
    each with an EngineCore that holds no device. `reset --yes --device 0` stops the second
    only and keeps the stale file; a reset without --device then stops and removes the rest."""
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PY, str(driver),
                        str(SUPPORT_DIR), proc_token, str(tmp_path), str(tmp_path / "state")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1, out
    first = json.loads(out["device0"]["out"])
    assert sorted(first["plan"]["orphan_pids"]) == sorted(out["on0"]), first["plan"]
    assert out["device0"]["code"] == 0, out["device0"]
    assert out["on0_gone"] and out["on1_alive"] == [True, True], out
    assert out["stale_kept"], out
    assert sorted(json.loads(out["all"]["out"])["plan"]["orphan_pids"]) == sorted(out["on1"])
    assert out["on1_gone"] and out["stale_removed"], out
