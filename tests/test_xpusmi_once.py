"""xpu-smi's own footprint (issue 37 §5): `xpu-smi ps` allocates about 211 MB of device
memory and lists itself (xpumanager #116). xpuctl runs it once per command, never in a loop
(doctor --deep --wait-clean re-checks without it), and never counts a probe's own memory as
a leak, whichever lister saw it."""

from __future__ import annotations

import json

from fakehost import BDF0, GiB, MiB
from test_deep import HIDDEN, HOLDER, _dev, _result, base_scenario, deep_host, snap, standin_env  # noqa: F401
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.parse.probes import ProbeProcess
from xpuctl.probes import reconcile

SMI_OWN = 211 * MiB  # xpumanager #116: what `xpu-smi ps` holds while it lists


def test_a_probes_own_memory_is_never_a_leak_whoever_listed_it(snap):
    """sysman lists the holders but not xpu-smi (it ran a moment apart); xpu-smi lists itself
    with 211 MB; the used figure (kmd) was read while xpu-smi held it."""
    host, s = snap
    smi_pid = 31338
    results = (
        _result("kmd", _dev(BDF0, used=2 * GiB + SMI_OWN)),
        _result("sysman", _dev(BDF0, used=2 * GiB, procs=(ProbeProcess(HOLDER, 2 * GiB),))),
        _result("xpu-smi", _dev(BDF0, procs=(ProbeProcess(HOLDER, 2 * GiB),
                                             ProbeProcess(smi_pid, SMI_OWN)))),
    )
    v0 = reconcile.reconcile(host, s, results, probe_pids=(smi_pid,)).device(BDF0)
    assert [p.pid for p in v0.processes] == [HOLDER]
    assert v0.memory_used_bytes == 2 * GiB and v0.unattributed_bytes == 0


def test_wait_clean_runs_xpu_smi_ps_once(tmp_path):
    calls = tmp_path / "calls"
    scenario = base_scenario()
    scenario["xpusmi"]["calls"] = str(calls)
    env = standin_env(tmp_path, scenario)
    deep_host(tmp_path / "root")
    result = CliRunner().invoke(app, ["--root", str(tmp_path / "root"), "doctor", "--deep",
                                      "--json", "--probe-timeout", "60", "--wait-clean", "3"],
                                env=env)
    assert result.exit_code == 1  # the hidden 6 GiB stays: every re-check failed
    ran = calls.read_text().split()
    assert ran.count("ps") == 1 and ran.count("discovery") == 1, ran
    data = json.loads(result.stdout)
    smi = next(p for p in data["probes"] if p["name"] == "xpu-smi")
    assert smi["available"] is False and "xpumanager #116" in smi["reason"]
    assert any(v["name"] == "oneccl" for v in data["versions"])  # carried from the first look
    assert any(f["check"] == "unattributed-memory" for f in data["findings"])  # sysman again
