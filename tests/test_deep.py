"""`doctor --deep` / `devices --deep`: probes in child processes against stand-ins.

The stand-ins (tests/standins: pyzes with its ctypes API, torch + torch.xpu, IPEX, xpu-smi)
read a scenario from $XPUCTL_STANDIN and are put on PYTHONPATH / PATH per test. A fake root
(tests/support/fakehost.py) gives the devices and the visible holders; the probes describe "the live
machine", which here is whatever the stand-ins say.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import fakehost as fh
import pytest
from fakehost import GiB, MiB
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.host.scan import take_scan
from xpuctl.host.seam import Host
from xpuctl.parse import probes
from xpuctl.parse.probes import ProbeDevice, ProbeProcess, ProbeResult
from xpuctl.probes import baseline, reconcile, runner

STANDINS = Path(__file__).resolve().parent / "standins"
BDF0, BDF1 = "0000:03:00.0", "0000:04:00.0"
HOLDER, HIDDEN = 4242, 77777
cli_runner = CliRunner()


def deep_host(root: Path) -> fh.FakeHost:
    """Two xe GPUs without a VRAM size in sysfs; pid 4242 holds 2 GiB of the first."""
    h = fh.FakeHost(root)
    h.add_device("renderD128", "card0", BDF0, driver="xe")
    h.add_device("renderD129", "card1", BDF1, driver="xe")
    h.add_process(1, 0, ["/sbin/init"], uid=0, comm="systemd")
    h.add_process(HOLDER, 1, ["python3", "train.py"], fds={7: "/dev/dri/renderD128"},
                  fdinfo={7: fh.xe_fdinfo(5, BDF0, [2 * GiB])})
    return h


def sysman_device(bdf: str, size: int, free: int, processes, lost=None) -> dict:
    return {"bdf": bdf, "name": "Intel(R) Arc(TM) Pro B60 Graphics",
            "memory": [{"location": 0, "size": 64 * GiB, "free": 60 * GiB},
                       {"location": 1, "size": size, "free": free}],
            "processes": processes, **({"lost": lost} if lost else {})}


def torch_device(total: int, free: int, lost: bool = False) -> dict:
    return {"name": "Intel(R) Arc(TM) Pro B60 Graphics", "total": total, "free": free, "lost": lost}


def base_scenario() -> dict:
    return {
        "pyzes": {"loader": "libc.so.6", "devices": [
            sysman_device(BDF0, 24 * GiB, 16 * GiB,  # 8 GiB used: 2 visible + 6 hidden
                          [{"pid": HOLDER, "mem": 2 * GiB}, {"pid": HIDDEN, "mem": 6 * GiB}]),
            sysman_device(BDF1, 24 * GiB, 24 * GiB - 512 * MiB, []),
        ]},
        "torch": {"version": "2.13.0+xpu", "devices": [torch_device(24 * GiB, 16 * GiB),
                                                       torch_device(24 * GiB, 24 * GiB - 512 * MiB)]},
        "xpusmi": {
            "discovery": {"device_list": [
                {"device_id": 0, "device_name": "Intel(R) Arc(TM) Pro B60 Graphics", "device_type": "GPU",
                 "drm_device": "/dev/dri/card0", "pci_bdf_address": BDF0, "pci_device_id": "0xe211"},
                {"device_id": 1, "device_name": "Intel(R) Arc(TM) Pro B60 Graphics", "device_type": "GPU",
                 "drm_device": "/dev/dri/card1", "pci_bdf_address": BDF1, "pci_device_id": "0xe211"}]},
            "ps": {"device_util_by_proc_list": [
                {"process_id": HOLDER, "process_name": "python3", "device_id": 0, "mem_size": 2 * GiB // 1024,
                 "shared_mem_size": 0},
                {"process_id": HIDDEN, "process_name": "python3", "device_id": 0, "mem_size": 6 * GiB // 1024,
                 "shared_mem_size": 0}]},
        },
    }


def standin_env(tmp: Path, scenario: dict, pyzes: bool = True, torch: str = "fake", ipex: bool = False,
                xpusmi: bool = True) -> dict[str, str]:
    """PYTHONPATH/PATH holding only the stand-ins asked for. torch: fake | absent | real."""
    sp = tmp / "sp"
    bindir = tmp / "bin"
    sp.mkdir(exist_ok=True)
    bindir.mkdir(exist_ok=True)
    (sp / "scenario.py").symlink_to(STANDINS / "scenario.py")
    if pyzes:
        (sp / "pyzes").symlink_to(STANDINS / "pyzes")
    if torch == "fake":
        (sp / "torch").symlink_to(STANDINS / "torch")
    elif torch == "absent":
        (sp / "torch").symlink_to(STANDINS / "no_torch" / "torch")
    if ipex:
        (sp / "intel_extension_for_pytorch").symlink_to(STANDINS / "ipex" / "intel_extension_for_pytorch")
    if xpusmi:
        (bindir / "xpu-smi").symlink_to(STANDINS / "bin" / "xpu-smi")
    path = tmp / "scenario.json"
    path.write_text(json.dumps(scenario))
    return {"PYTHONPATH": str(sp), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
            "XPUCTL_STANDIN": str(path), "XPUCTL_STATE_DIR": str(tmp / "state")}


def deep_json(tmp: Path, env: dict[str, str], *args: str, command: str = "doctor") -> tuple[int, dict]:
    root = tmp / "root"
    if not root.exists():
        deep_host(root)
    result = cli_runner.invoke(app, ["--root", str(root), command, "--deep", "--json", *args], env=env)
    assert "Traceback" not in result.stdout + (result.stderr or "")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {result.exception!r}") from result.exception
    return result.exit_code, json.loads(result.stdout)


def probe(data: dict, name: str) -> dict:
    return next(p for p in data["probes"] if p["name"] == name)


def device(data: dict, bdf: str) -> dict:
    return next(d for d in data["devices"] if d["bdf"] == bdf)


def findings(data: dict, check: str) -> list[dict]:
    return [f for f in data["findings"] if f["check"] == check]


# --- the whole path through the CLI -------------------------------------------------------


def test_unattributed_memory_names_device_amount_and_hidden_pids(tmp_path):
    code, data = deep_json(tmp_path, standin_env(tmp_path, base_scenario()), "--probe-timeout", "60")
    assert code == 1
    for name in ("sysman", "torch", "xpu-smi"):
        p = probe(data, name)
        assert p["available"] and p["live"] is True and p["reason"] is None, p
        assert set(p) >= {"name", "available", "reason", "seconds", "version", "live"}
    assert probe(data, "sysman")["version"] is None or isinstance(probe(data, "sysman")["version"], str)
    assert probe(data, "torch")["version"] == "2.13.0+xpu"
    kmd = probe(data, "kmd")  # this machine has no xe/i915 render node
    assert kmd["available"] is False and "render node" in kmd["reason"]
    (f,) = findings(data, "unattributed-memory")
    assert f["severity"] == "fail" and f["device"] == BDF0 and f["pids"] == [HIDDEN]
    assert "6.0 GiB" in f["message"] and "PID namespace" in f["message"] and "hostPID" in f["remedy"]
    d0, d1 = device(data, BDF0), device(data, BDF1)
    assert d0["unattributed_bytes"] == 6 * GiB
    assert d1["unattributed_bytes"] == 512 * MiB  # below the 1 GiB threshold: no finding
    assert d0["runtime"]["source"] == "sysman" and d0["runtime"]["memory_used_bytes"] == 8 * GiB
    assert d0["runtime"]["state"] == "ok"
    assert {p["pid"] for p in d0["runtime"]["processes"]} == {HOLDER, HIDDEN}
    assert d0["runtime"]["invisible_pids"] == [HIDDEN]
    assert d0["memory_total_bytes"] == 24 * GiB  # sysfs has none here: the probe fills it
    assert d0["memory_used_bytes"] == 2 * GiB  # fdinfo, unchanged


def test_threshold_option_and_prometheus(tmp_path):
    env = standin_env(tmp_path, base_scenario())
    code, data = deep_json(tmp_path, env, "--probe-timeout", "60", "--unattributed-threshold", "7GiB")
    assert code == 0 and not findings(data, "unattributed-memory")
    deep_host(tmp_path / "root2")
    result = cli_runner.invoke(app, ["--root", str(tmp_path / "root2"), "doctor", "--deep", "--probe-timeout",
                                 "60", "--format", "prometheus"], env=env)
    text = result.stdout
    assert f'xpuctl_device_unattributed_bytes{{device="{BDF0}"}} {6 * GiB}' in text
    assert 'xpuctl_probe_available{probe="sysman"} 1' in text
    assert 'xpuctl_probe_available{probe="kmd"} 0' in text
    bad = cli_runner.invoke(app, ["--root", str(tmp_path / "root2"), "doctor", "--deep",
                              "--unattributed-threshold", "lots"], env=env)
    assert bad.exit_code == 2 and "not a size" in (bad.stderr or bad.stdout)


def test_plain_doctor_runs_no_probe_and_keeps_its_shape(tmp_path):
    env = standin_env(tmp_path, {**base_scenario(), "record_env": str(tmp_path / "seen")})
    deep_host(tmp_path / "root")
    result = cli_runner.invoke(app, ["--root", str(tmp_path / "root"), "doctor", "--json"], env=env)
    data = json.loads(result.stdout)
    assert data["probes"] == [] and device(data, BDF0)["runtime"] is None
    assert not list(tmp_path.glob("seen.*"))  # no stand-in was even imported


def test_baseline_recorded_then_subtracted(tmp_path):
    scen = base_scenario()
    # the second device: 1.5 GiB used while nothing holds it (memory the driver keeps)
    scen["pyzes"]["devices"][1] = sysman_device(BDF1, 24 * GiB, 24 * GiB - 1536 * MiB, [])
    env = standin_env(tmp_path, scen)
    code, before = deep_json(tmp_path, env, "--probe-timeout", "60")
    assert {f["device"] for f in findings(before, "unattributed-memory")} == {BDF0, BDF1}
    assert device(before, BDF1)["runtime"]["baseline_bytes"] == 0

    code, rec = deep_json(tmp_path, env, "--probe-timeout", "60", "--record-baseline", command="devices")
    assert code == 0
    by_bdf = {b["bdf"]: b for b in rec["baseline"]}
    assert by_bdf[BDF1]["memory_used_bytes"] == 1536 * MiB
    assert by_bdf[BDF0]["memory_used_bytes"] is None and "held by" in by_bdf[BDF0]["note"]
    stored = json.loads((tmp_path / "state" / baseline.BASELINE_FILE).read_text())
    assert stored["devices"][BDF1]["memory_used_bytes"] == 1536 * MiB and BDF0 not in stored["devices"]

    code, after = deep_json(tmp_path, env, "--probe-timeout", "60")
    assert [f["device"] for f in findings(after, "unattributed-memory")] == [BDF0]
    assert device(after, BDF1)["unattributed_bytes"] == 0
    assert device(after, BDF1)["runtime"]["baseline_bytes"] == 1536 * MiB


def test_record_baseline_needs_deep(tmp_path):
    deep_host(tmp_path / "root")
    result = cli_runner.invoke(app, ["--root", str(tmp_path / "root"), "devices", "--record-baseline"])
    assert result.exit_code == 2 and "needs --deep" in (result.stderr or result.stdout)


def test_lost_device_from_sysman_and_torch(tmp_path):
    scen = base_scenario()
    scen["pyzes"]["devices"][1]["lost"] = "lost"
    scen["torch"]["devices"][1]["lost"] = True
    code, data = deep_json(tmp_path, standin_env(tmp_path, scen), "--probe-timeout", "60")
    assert code == 1
    (f,) = findings(data, "device-lost")
    assert f["device"] == BDF1 and f["severity"] == "fail"
    assert "ZE_RESULT_ERROR_DEVICE_LOST" in f["message"] and "UR_RESULT_ERROR_DEVICE_LOST" in f["message"]
    assert "/sys/bus/pci/drivers/xe/unbind" in f["remedy"] and "--device-reset" in f["remedy"]
    assert device(data, BDF1)["runtime"]["state"] == "lost"
    assert device(data, BDF0)["runtime"]["state"] == "ok"


def test_requires_reset_is_lost_too(tmp_path):
    scen = base_scenario()
    scen["pyzes"]["devices"][0]["lost"] = "reset"
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen, torch="absent", xpusmi=False),
                           "--probe-timeout", "60")
    (f,) = findings(data, "device-lost")
    assert f["device"] == BDF0 and "REQUIRES_RESET" in f["message"]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh_:
            return fh_.read().rsplit(")", 1)[1].split()[0] == "Z"  # PID 1 here may not reap
    except FileNotFoundError:
        return True


def test_hung_init_times_out_and_leaves_nothing(tmp_path):
    scen = base_scenario()
    pidfile = tmp_path / "hung.pids"
    scen["pyzes"].update({"hang": True, "pidfile": str(pidfile)})
    env = standin_env(tmp_path, scen, xpusmi=False)
    t0 = time.monotonic()
    _code, data = deep_json(tmp_path, env, "--probe-timeout", "8")
    took = time.monotonic() - t0
    sysman = probe(data, "sysman")
    assert sysman["available"] is False and sysman["timed_out"] is True and "8 s" in sysman["reason"]
    assert probe(data, "torch")["available"] is True  # the others still answered
    (f,) = findings(data, "probe-timeout")
    assert f["severity"] == "warn" and "sysman" in f["message"] and "wedged" in f["message"]
    leader, grandchild = map(int, pidfile.read_text().split())
    # SIGKILL is delivered asynchronously: give the grandchild a (generous) moment to die
    end = time.monotonic() + 10
    while not (_gone(leader) and _gone(grandchild)) and time.monotonic() < end:
        time.sleep(0.05)
    assert _gone(leader) and _gone(grandchild)  # killed with the process group
    assert took < 8 * 3  # bounded by the timeout (not by the 600 s hang)
    # without the unattributed sysman figure, torch's is used (8 GiB used on device 0)
    assert device(data, BDF0)["runtime"]["source"] == "torch"


def test_missing_loader_and_missing_packages(tmp_path):
    scen = base_scenario()
    scen["pyzes"]["loader"] = str(tmp_path / "nowhere" / "libze_loader.so.1")
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen, torch="absent", xpusmi=False),
                           "--probe-timeout", "60")
    sysman, torch, smi = probe(data, "sysman"), probe(data, "torch"), probe(data, "xpu-smi")
    assert not sysman["available"] and "loader not found" in sysman["reason"]
    assert "libze_loader.so.1" in sysman["reason"]
    assert not torch["available"] and "torch is not installed" in torch["reason"]
    assert not smi["available"] and smi["reason"] == "xpu-smi is not on PATH"
    assert device(data, BDF0)["runtime"]["source"] is None
    assert device(data, BDF0)["unattributed_bytes"] is None
    msgs = [f["message"] for f in findings(data, "inspection")]
    assert any("deep probe sysman unavailable" in m for m in msgs)
    assert any("briefly opened the devices" in m for m in msgs)


def test_pyzes_not_installed(tmp_path):
    _code, data = deep_json(tmp_path, standin_env(tmp_path, base_scenario(), pyzes=False, xpusmi=False),
                           "--probe-timeout", "60")
    assert "pyzes is not installed" in probe(data, "sysman")["reason"]


def test_unsupported_process_list_gives_memory_only(tmp_path):
    scen = base_scenario()
    scen["pyzes"]["devices"][0]["processes"] = "unsupported"
    scen["pyzes"]["devices"][1]["processes"] = "permissions"
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen), "--probe-timeout", "60")
    sysman = probe(data, "sysman")
    assert sysman["available"]
    assert any("UNSUPPORTED_FEATURE" in n and "memory only" in n for n in sysman["notes"])
    assert any("needs root" in n and BDF1 in n for n in sysman["notes"])
    d0 = device(data, BDF0)["runtime"]
    assert d0["source"] == "sysman" and d0["memory_used_bytes"] == 8 * GiB
    assert d0["process_source"] == "xpu-smi"  # the process list came from xpu-smi instead
    assert {p["pid"] for p in d0["processes"]} == {HOLDER, HIDDEN}
    assert findings(data, "unattributed-memory")[0]["pids"] == [HIDDEN]


@pytest.mark.parametrize("fault, needle", [
    ({"ps": "xpu-smi: error while loading shared libraries"}, "not JSON"),
    ({"rc": {"discovery": 1}}, "exited with 1"),
    ({"discovery": {"error": "Level Zero Initialization Error", "errno": 3}}, "Level Zero Initialization"),
])
def test_xpusmi_garbage_or_failure_makes_it_unavailable(tmp_path, fault, needle):
    scen = base_scenario()
    scen["xpusmi"].update(fault)
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen), "--probe-timeout", "60")
    smi = probe(data, "xpu-smi")
    assert smi["available"] is False and needle in smi["reason"], smi


def test_probe_printing_garbage_is_unavailable_with_reason(tmp_path):
    scen = base_scenario()
    scen["torch"]["garbage"] = True
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen), "--probe-timeout", "60")
    torch = probe(data, "torch")
    assert torch["available"] is False and "exited with 3" in torch["reason"]


def test_old_torch_without_ipex(tmp_path):
    scen = base_scenario()
    scen["torch"]["version"] = "2.3.1+cxx11.abi"
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen), "--probe-timeout", "60")
    torch = probe(data, "torch")
    assert torch["available"] is False
    assert "2.5 or later" in torch["reason"] and "intel-extension-for-pytorch is not installed" in torch["reason"]


def test_old_torch_with_ipex(tmp_path):
    scen = base_scenario()
    scen["torch"]["version"] = "2.3.1+cxx11.abi"
    env = standin_env(tmp_path, scen, pyzes=False, xpusmi=False, ipex=True)
    _code, data = deep_json(tmp_path, env, "--probe-timeout", "60")
    torch = probe(data, "torch")
    assert torch["available"] is True and torch["version"] == "2.3.1+cxx11.abi"
    assert any("end-of-life" in n and "2.5 or later" in n and "needs no IPEX" in n for n in torch["notes"])
    assert device(data, BDF0)["runtime"]["source"] == "torch"
    assert device(data, BDF0)["runtime"]["memory_used_bytes"] == 8 * GiB


def test_caller_affinity_mask_is_dropped_for_the_probes(tmp_path):
    scen = base_scenario()
    scen["record_env"] = str(tmp_path / "seen")
    scen["torch"]["devices"][1] = torch_device(24 * GiB, 20 * GiB)  # device 1: 4 GiB used
    scen["torch"]["driver_order"] = [1, 0]  # not PCI order unless asked for
    env = standin_env(tmp_path, scen, pyzes=False, xpusmi=False)
    env.update({"ZE_AFFINITY_MASK": "1", "ONEAPI_DEVICE_SELECTOR": "level_zero:1",
                "ZE_FLAT_DEVICE_HIERARCHY": "FLAT"})
    _code, data = deep_json(tmp_path, env, "--probe-timeout", "60")
    seen = json.loads((tmp_path / "seen.torch").read_text())
    assert "ZE_AFFINITY_MASK" not in seen and "ONEAPI_DEVICE_SELECTOR" not in seen
    assert seen["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1"
    assert seen["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE" and seen["ZES_ENABLE_SYSMAN"] == "1"
    # both devices seen, each under its own PCI address
    assert device(data, BDF0)["runtime"]["memory_used_bytes"] == 8 * GiB
    assert device(data, BDF1)["runtime"]["memory_used_bytes"] == 4 * GiB


@pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("torch") is None,
    reason="torch is not installed (the test extra installs torch==2.13.0)",
)
def test_real_torch_cpu_build_is_installed_without_xpu(tmp_path):
    """The real torch 2.13.0 CPU wheel: importable, torch.xpu present, no device."""
    env = standin_env(tmp_path, {}, pyzes=False, torch="real", xpusmi=False)
    _code, data = deep_json(tmp_path, env, "--probe-timeout", "120")
    torch = probe(data, "torch")
    assert torch["available"] is False and torch["timed_out"] is False, torch
    assert torch["version"].startswith("2.") and "is_available() is False" in torch["reason"]


def test_devices_deep_table_shows_runtime_columns(tmp_path):
    env = standin_env(tmp_path, base_scenario())
    deep_host(tmp_path / "root")
    result = cli_runner.invoke(app, ["--root", str(tmp_path / "root"), "devices", "--deep",
                                 "--probe-timeout", "60"], env={**env, "COLUMNS": "200"})
    assert result.exit_code == 0, result.stdout
    assert "unattributed" in result.stdout and "6.0 GiB" in result.stdout
    assert "deep probes: sysman ok" in result.stdout and "kmd unavailable" in result.stdout


# --- reconciliation arithmetic ------------------------------------------------------------


def _result(name: str, *devices: ProbeDevice) -> ProbeResult:
    return ProbeResult(name, True, None, None, 0.1, True, tuple(devices))


def _dev(bdf=None, index=None, used=None, total=None, procs=None, state="ok") -> ProbeDevice:
    return ProbeDevice(bdf, index, None, state, total, used, procs)


@pytest.fixture
def snap(tmp_path):
    h = deep_host(tmp_path / "root")
    return Host(str(h.root)), take_scan(Host(str(h.root)), port=None)


def test_reconcile_prefers_kmd_then_sysman_then_torch(snap):
    host, s = snap
    results = (
        _result("sysman", _dev(BDF0, used=8 * GiB, total=24 * GiB)),
        _result("torch", _dev(index=0, used=9 * GiB), _dev(index=1, used=3 * GiB, total=24 * GiB)),
        _result("kmd", _dev(BDF0, used=10 * GiB, total=24 * GiB)),
    )
    d = reconcile.reconcile(host, s, results)
    v0, v1 = d.device(BDF0), d.device(BDF1)
    assert (v0.source, v0.memory_used_bytes, v0.unattributed_bytes) == ("kmd", 10 * GiB, 8 * GiB)
    assert (v1.source, v1.memory_used_bytes, v1.unattributed_bytes) == ("torch", 3 * GiB, 3 * GiB)
    # kmd without CAP_PERFMON reports no used: sysman's figure counts
    results = (results[0], results[1], _result("kmd", _dev(BDF0, used=None, total=24 * GiB)))
    v0 = reconcile.reconcile(host, s, results).device(BDF0)
    assert (v0.source, v0.unattributed_bytes, v0.memory_total_bytes) == ("sysman", 6 * GiB, 24 * GiB)


def test_reconcile_with_and_without_baseline(snap):
    host, s = snap
    results = (_result("sysman", _dev(BDF0, used=8 * GiB), _dev(BDF1, used=1 * GiB)),)
    plain = reconcile.reconcile(host, s, results)
    assert plain.device(BDF0).unattributed_bytes == 6 * GiB  # 8 − 2 visible − 0
    assert plain.device(BDF1).unattributed_bytes == 1 * GiB
    based = reconcile.reconcile(host, s, results, {BDF0: 512 * MiB, BDF1: 3 * GiB})
    assert based.device(BDF0).unattributed_bytes == 6 * GiB - 512 * MiB
    assert based.device(BDF0).baseline_bytes == 512 * MiB
    assert based.device(BDF1).unattributed_bytes == 0  # never below zero


def test_reconcile_leaves_the_probes_own_clients_out(snap):
    host, s = snap
    me = 31337
    procs = (ProbeProcess(HOLDER, 2 * GiB), ProbeProcess(me, 256 * MiB), ProbeProcess(HIDDEN, 1 * GiB))
    results = (_result("sysman", _dev(BDF0, used=3 * GiB + 256 * MiB, procs=procs)),)
    v0 = reconcile.reconcile(host, s, results, probe_pids=(me,)).device(BDF0)
    assert [p.pid for p in v0.processes] == [HOLDER, HIDDEN]
    assert v0.memory_used_bytes == 3 * GiB and v0.unattributed_bytes == 1 * GiB
    assert v0.invisible_pids == (HIDDEN,)


def test_unavailable_probe_results_are_ignored(snap):
    host, s = snap
    results = (ProbeResult("sysman", False, "no loader", None, 0.1, True,
                           (_dev(BDF0, used=20 * GiB, state="lost"),)),)
    v0 = reconcile.reconcile(host, s, results).device(BDF0)
    assert v0.source is None and v0.state == "ok" and v0.unattributed_bytes is None


def test_results_document_round_trips(tmp_path):
    results = (
        _result("sysman", _dev(BDF0, used=8 * GiB, total=24 * GiB,
                               procs=(ProbeProcess(HIDDEN, 6 * GiB, 0),))),
        ProbeResult("torch", False, "torch is not installed", None, 0.2, True, notes=("x",)),
        ProbeResult("xpu-smi", False, "no answer", None, 10.0, True, timed_out=True),
    )
    doc = probes.results_to_json(results, frozenset({99}))
    text = json.dumps(doc)
    assert probes.results_from_json(text) == results == probes.results_from_json(json.loads(text))
    assert probes.probe_pids_from_json(doc) == (99,)
    with pytest.raises(ValueError):
        probes.results_from_json({"schema": "other", "probes": []})


# --- the probe environment and process handling -------------------------------------------


def test_probe_env():
    env = runner.probe_env({"ZE_AFFINITY_MASK": "0", "ONEAPI_DEVICE_SELECTOR": "level_zero:0",
                       "ZE_FLAT_DEVICE_HIERARCHY": "FLAT", "HOME": "/root", "PYTHONPATH": "/a"})
    assert "ZE_AFFINITY_MASK" not in env and "ONEAPI_DEVICE_SELECTOR" not in env
    assert env["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE" and env["ZES_ENABLE_SYSMAN"] == "1"
    assert env["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1" and env["HOME"] == "/root"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == "/a"  # stand-ins keep precedence


def test_all_probes_start_at_once(tmp_path):
    """Each stand-in sleeps S; together they take about S, not 3 S (measured, not assumed)."""
    one = {"sleep": 1.0}
    scen = base_scenario()
    scen["pyzes"].update(one)
    scen["torch"].update(one)
    scen["xpusmi"].update(one)
    env = {**os.environ, **standin_env(tmp_path, scen)}
    t0 = time.monotonic()
    results = runner.start(env, 60).finish()
    took = time.monotonic() - t0
    secs = {r.name: r.seconds for r in results if r.available}
    assert set(secs) == {"sysman", "torch", "xpu-smi"}
    assert all(s >= 1.0 for s in secs.values())
    assert took < sum(secs.values())  # overlapped: less than the sum of their own durations


def test_pid_namespace_inspection_finding(tmp_path):
    h = deep_host(tmp_path / "root")
    (h.root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    (h.root / "proc" / "self" / "status").write_text("Name:\tpython3\nNSpid:\t4100\t7\n")
    result = cli_runner.invoke(app, ["--root", str(h.root), "doctor", "--json"])
    data = json.loads(result.stdout)
    (f,) = [f for f in findings(data, "inspection") if "PID namespace" in f["message"]]
    assert f["severity"] == "info" and "--deep" in f["message"] and "hostPID" in f["remedy"]


def test_lost_device_without_pci_address_is_still_reported(tmp_path):
    scen = base_scenario()
    scen["pyzes"]["devices"][1].update({"lost": "lost", "pci_lost": True})
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen, torch="absent", xpusmi=False),
                           "--probe-timeout", "60")
    (f,) = findings(data, "device-lost")
    assert f["device"] is None and "sysman device #1" in f["message"] and "unbind" in f["remedy"]


def test_process_list_is_the_last_source_of_used_memory(snap):
    host, s = snap
    procs = (ProbeProcess(HOLDER, 2 * GiB), ProbeProcess(HIDDEN, 5 * GiB))
    results = (_result("xpu-smi", _dev(BDF0, procs=procs)),)
    v0 = reconcile.reconcile(host, s, results).device(BDF0)
    assert (v0.source, v0.memory_used_bytes, v0.unattributed_bytes) == ("xpu-smi", 7 * GiB, 5 * GiB)


def test_deadline_counts_from_the_command_start(tmp_path):
    """A command that started T ago gives its probes only timeout − T (at least half)."""
    scen = base_scenario()
    scen["pyzes"].update({"hang": True})
    env = {**os.environ, **standin_env(tmp_path, scen, torch="absent", xpusmi=False)}
    running = runner.start(env, 4.0, since=time.monotonic() - 1.0)
    t0 = min(j.t0 for j in running.jobs)
    assert running.deadline <= t0 + 3.0 + 0.01
    results = {r.name: r for r in running.finish()}
    assert results["sysman"].timed_out and not results["torch"].timed_out
    again = runner.start(env, 4.0, since=time.monotonic() - 100)
    try:
        assert again.deadline >= min(j.t0 for j in again.jobs) + 2.0  # half, at least
    finally:
        again.deadline = time.monotonic()  # finish now: kill and reap them
        again.finish()


def test_serve_deep_preflight_refuses_a_lost_device(tmp_path):
    """`serve --preflight deep` runs doctor --deep first: a lost device refuses the launch
    (vLLM is never started: its command would fail loudly if it were)."""
    import subprocess
    import sys

    from proctools import StandInRoot

    root = StandInRoot(tmp_path, n_devices=2)
    try:
        scen = base_scenario()
        scen["pyzes"]["devices"][0]["lost"] = "lost"
        env = {**os.environ, **standin_env(tmp_path, scen, torch="absent", xpusmi=False)}
        for k in ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR", "XPUCTL_ROOT"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "xpuctl", "--root", root.root, "serve", "--vllm",
               "/bin/false never-started", "--state-dir", str(tmp_path / "state"), "--devices", "0",
               "--preflight", "deep", "--probe-timeout", "60", "model", "--port", "1"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180,
                             stdin=subprocess.DEVNULL)
        assert out.returncode == 1, out.stderr
        assert f"xpuctl: preflight fail device-lost: {BDF0} is lost" in out.stderr, out.stderr
        assert "preflight failed" in out.stderr
        assert not (tmp_path / "state" / "runs" / "vllm-1.json").exists()
        bad = subprocess.run(cmd[:-5] + ["--preflight", "sideways", "model"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2
    finally:
        root.close()
