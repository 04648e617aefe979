"""xpu-smi as real versions print it: the version decides the unit of `ps -j` sizes, v2's
device_state and its `{"device_list": null}`. Through `doctor --deep` with the xpu-smi stand-in.

Sources (intel/xpumanager): the `--version` layout in xpumanager doc/smi_user_guide.md and
xpumanager cli/src/comlet_version.cpp (v1), xpumanager ial/cli/cli.cpp (v2); `ps` sizes bytes / 1000 before the commit
of 2025-03-06 ("ps: Use sysman interface...", xpumanager cli/src/core_stub/lib_core_stub.cpp), / 1024 from
1.3.1 and in v2 (xpumanager ial/cmn/cmd_ps.cpp); device_state strings in xpumanager ial/cmn/cmd_discovery.h; the null
device list in xpumanager ial/cmn/cmd_discovery.cpp.
"""

from __future__ import annotations

import pytest
from fakehost import GiB
from test_deep import (
    BDF0,
    HIDDEN,
    HOLDER,
    base_scenario,
    deep_json,
    device,
    findings,
    probe,
    standin_env,
)

from xpuctl.parse import xpusmi

# xpumanager doc/smi_user_guide.md (xpumanager 1.x); v2 prints the same lines (xpumanager ial/cli/cli.cpp)
VERSION_1_0 = ("CLI:\n    Version: 1.0.0.20211217\n    Build ID: f847c0fa\n\nService:\n"
               "    Version: 1.0.0.20211217\n    Build ID: f847c0fa\n    Level Zero Version: 1.6.2\n")
VERSION_1_2 = VERSION_1_0.replace("1.0.0.20211217", "1.2.39.20240813")  # a later 1.2 (inferred)
VERSION_2_0 = VERSION_1_0.replace("1.0.0.20211217", "2.0.0.20250225")
SURVIVABILITY = ("survivability mode (firmware update and cold reset are recommended for device "
                 "recovery)")  # xpumanager ial/cmn/cmd_discovery.h


@pytest.mark.parametrize(("text", "numbers", "kb"), [
    (VERSION_1_0, (1, 0, 0, 20211217), 1000),
    (VERSION_1_2, (1, 2, 39, 20240813), 1000),
    (VERSION_1_0.replace("1.0.0.20211217", "1.3.1.20250314"), (1, 3, 1, 20250314), 1024),
    (VERSION_2_0, (2, 0, 0, 20250225), 1024),
    ('{"cli_version": "1.2.39.20240813", "xpum_version": "1.2.39.20240813"}', (1, 2, 39, 20240813), 1000),
])
def test_version_and_unit(text, numbers, kb):
    v = xpusmi.parse_version(text)
    assert v is not None and v.numbers == numbers and v.kb == kb


@pytest.mark.parametrize("text", ["", "usage: xpu-smi discovery|ps -j", "Service:\n    Version: 1.2.3\n",
                                  '{"cli_version": 3}', "{", "CLI:\n    Version: soon\n"])
def test_no_version_is_none(text):
    assert xpusmi.parse_version(text) is None


def _smi(scen: dict, version: str | None, per_kb: int) -> dict:
    """The base scenario's xpu-smi, its ps sizes divided by `per_kb` as that version does."""
    scen["xpusmi"]["version"] = version
    for p in scen["xpusmi"]["ps"]["device_util_by_proc_list"]:
        p["mem_size"] = {HOLDER: 2 * GiB, HIDDEN: 6 * GiB}[p["process_id"]] // per_kb
    return scen


@pytest.mark.parametrize(("version", "per_kb"), [(VERSION_1_2, 1000), (VERSION_2_0, 1024)])
def test_ps_sizes_scale_by_version_through_doctor(tmp_path, version, per_kb):
    env = standin_env(tmp_path, _smi(base_scenario(), version, per_kb), pyzes=False, torch="absent")
    _code, data = deep_json(tmp_path, env, "--probe-timeout", "60")
    smi = probe(data, "xpu-smi")
    assert smi["available"] and smi["version"] == xpusmi.parse_version(version).text
    rt = device(data, BDF0)["runtime"]
    # the listed sizes are a lower bound of what is used: 2 + 6 GiB, whichever kB was printed
    assert rt["source"] == "xpu-smi" and abs(rt["memory_used_bytes"] - 8 * GiB) < 2048, rt
    assert {p["pid"]: round(p["memory_bytes"] / (1 << 20)) for p in rt["processes"]} == {HOLDER: 2048,
                                                                                  HIDDEN: 6144}
    (f,) = findings(data, "unattributed-memory")
    assert "6.0 GiB" in f["message"], f


def test_unknown_version_is_said_not_guessed(tmp_path):
    env = standin_env(tmp_path, _smi(base_scenario(), None, 1000), pyzes=False, torch="absent")
    _code, data = deep_json(tmp_path, env, "--probe-timeout", "60")
    smi = probe(data, "xpu-smi")
    assert smi["available"] and smi["version"] is None
    assert any("unit of `ps -j` sizes" in n for n in smi["notes"]), smi
    rt = device(data, BDF0)["runtime"]
    assert rt["memory_used_bytes"] is None and [p["memory_bytes"] for p in rt["processes"]] == [None, None]
    assert findings(data, "unattributed-memory") == []  # no figure from a guessed unit


def test_null_device_list_is_no_device_not_garbage(tmp_path):
    scen = base_scenario()
    scen["xpusmi"]["discovery"] = '{\n    "device_list": null\n}'
    scen["xpusmi"]["ps"] = {"device_util_by_proc_list": []}
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen, pyzes=False, torch="absent"),
                            "--probe-timeout", "60")
    smi = probe(data, "xpu-smi")
    assert smi["available"] and smi["reason"] is None
    assert "xpu-smi sees no device" in smi["notes"]


@pytest.mark.parametrize(("ps_out", "ps_rc"), [
    ("", 0),  # v2's ps loops over no device: it prints nothing (xpumanager ial/cmn/cmd_ps.cpp)
    ("Error: Device handle not found for device ID ''.", 1),  # ial/cmn/cmd_ps.cpp's findDevice error
], ids=["ps-prints-nothing", "ps-fails"])
def test_null_device_list_with_v2s_ps_is_no_device_not_a_failed_call(tmp_path, ps_out, ps_rc):
    """xpu-smi 2.x with no device: `discovery -j` prints {"device_list": null} (exit 0), and
    `ps -j` has no device to answer for. The probe answers "no device", not a failed call."""
    scen = base_scenario()
    scen["xpusmi"]["version"] = VERSION_2_0
    scen["xpusmi"]["discovery"] = '{\n    "device_list": null\n}'
    scen["xpusmi"]["ps"] = ps_out
    scen["xpusmi"]["rc"] = {"ps": ps_rc}
    _code, data = deep_json(tmp_path, standin_env(tmp_path, scen, pyzes=False, torch="absent"),
                            "--probe-timeout", "60")
    smi = probe(data, "xpu-smi")
    assert smi["available"] and smi["reason"] is None, smi
    assert "xpu-smi sees no device" in smi["notes"], smi
    assert xpusmi.probe_result((0, '{"device_list": null}'), (ps_rc, ps_out), 0.1, True,
                               (0, VERSION_2_0)).available


def test_survivability_mode_is_a_state_and_a_finding(tmp_path):
    scen = base_scenario()
    scen["xpusmi"]["discovery"]["device_list"][0]["device_state"] = SURVIVABILITY
    scen["xpusmi"]["discovery"]["device_list"][1]["device_state"] = "normal"
    code, data = deep_json(tmp_path, standin_env(tmp_path, scen, pyzes=False, torch="absent"),
                           "--probe-timeout", "60")
    assert code == 1
    (f,) = findings(data, "device-survivability")
    assert f["severity"] == "fail" and f["device"] == BDF0 and SURVIVABILITY in f["message"]
    assert "firmware" in f["remedy"] and "cold-reset" in f["remedy"]
    assert device(data, BDF0)["runtime"]["state"] == "survivability"
    assert device(data, "0000:04:00.0")["runtime"]["state"] == "ok"
    assert findings(data, "device-lost") == []
