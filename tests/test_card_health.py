"""The card's own health (issue 37 §3): xe's gpu_health, the wedged uevent's recovery method,
Level Zero Sysman's health extension; doctor, devices, Prometheus and `reset --rebind`.

Sources:
- `gpu_health`: issue 37 (xe, in the card's PCI device directory, the one
  `/sys/class/drm/cardN/device` and `/sys/bus/pci/devices/<bdf>` lead to): ok, warning,
  critical. The attribute is newer than the kernels whose source this project read: a kernel
  without it has no file, which says nothing.
- the wedged uevent: Linux drivers/gpu/drm/drm_drv.c drm_dev_wedged_event sends
  `WEDGED=<method>[,<method>]`, names from drm_get_wedge_recovery: rebind, bus-reset, and
  vendor-specific since DRM_WEDGE_RECOVERY_VENDOR (Documentation/gpu/drm-uapi.rst "Device
  Wedging", the patch adding it); xe's runtime survivability mode
  (drivers/gpu/drm/xe/xe_survivability_mode.c xe_survivability_mode_runtime_enable) sets that
  method, declares the card wedged and logs "Firmware update required, Refer the userspace
  documentation for more details!" (later "Firmware flash required, …").
- Sysman: the Level Zero spec's Device Health Extension (1.18, EXT_DeviceHealth):
  `zesDeviceGetHealthStatusExt(hDevice, &health)`, zes_device_health_status_ext_t OK 0,
  WARNING 1, CRITICAL 2, FAILED 3 ("permanent non-recoverable failure; FRU replacement
  required"), stored in non-volatile memory and kept across resets and firmware updates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakehost import BDF0, BDF1, clean_host
from hypothesis import given
from hypothesis import strategies as st
from test_kernel import XE_WEDGED, rec, write_kmsg
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.parse.health import gpu_health, sysman_health, worst
from xpuctl.parse.kmsg import HANG, VENDOR, WEDGED, gpu_events, parse_kmsg, wedge_method

runner = CliRunner()

UEVENT_LINE = ("6,{seq},{usec},-;xe {bdf}: [drm] device wedged, needs recovery\n"
               " SUBSYSTEM=pci\n DEVICE=+pci:{bdf}\n")
# what `udevadm monitor --property` prints of the uevent, as a log that quotes it carries it
UEVENT_QUOTED = "6,{seq},{usec},-;xe {bdf}: [drm] uevent WEDGED=rebind,bus-reset\n"
VENDOR_QUOTED = "6,{seq},{usec},-;xe {bdf}: [drm] uevent WEDGED=vendor-specific\n"
XE_FLASH = ("3,{seq},{usec},-;xe {bdf}: Firmware update required, Refer the userspace "
            "documentation for more details!\n")
RECOVERED = "6,{seq},{usec},-;xe {bdf}: [drm] device wedged, but recovered through reset\n"


def put_health(root: Path, bdf: str, text: str) -> None:
    (root / "sys/bus/pci/devices" / bdf / "gpu_health").write_text(text)


def cli(root: Path, *args: str, env: dict[str, str] | None = None):
    result = runner.invoke(app, ["--root", str(root), *args], env=env)
    assert "Traceback" not in result.output, result.output
    return result


def doctor(root: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    result = cli(root, "doctor", "--json", *extra, env=env)
    return result.exit_code, json.loads(result.stdout)


def findings(data: dict, check: str) -> list[dict]:
    return [f for f in data["findings"] if f["check"] == check]


# -- parsers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "want"), [
    ("ok\n", "ok"), ("warning\n", "warning"), ("critical\n", "critical"), ("OK", "ok"),
    ("health: Critical\n", "critical"), ("\n", "unknown"), ("degraded\n", "unknown"),
])
def test_gpu_health_values(text, want):
    assert gpu_health(text) == want


def test_sysman_health_names_and_the_one_scale():
    assert [sysman_health(n) for n in ("OK", "WARNING", "CRITICAL", "FAILED")] == [
        "ok", "warning", "critical", "failed"]
    assert sysman_health("ZES_DEVICE_HEALTH_STATUS_EXT_FAILED") == "failed"
    assert sysman_health("FORCE_UINT32") is None and sysman_health(3) is None
    assert worst("ok", None, "unknown", "critical", "warning") == "critical"
    assert worst(None, "unknown") is None


@given(st.text(max_size=300))
def test_gpu_health_never_raises(text):
    assert gpu_health(text) in ("ok", "warning", "critical", "unknown")


def test_the_wedged_methods_from_the_log():
    assert wedge_method("uevent WEDGED=rebind,bus-reset") == "rebind,bus-reset"
    assert wedge_method("WEDGED=vendor-specific") == VENDOR
    assert wedge_method("xe: Firmware flash required, Please refer to …") == VENDOR
    assert wedge_method("WEDGED=frobnicate") is None and wedge_method("all fine") is None
    text = "".join(rec(t, n, n * 10.0) for n, t in enumerate(
        (UEVENT_LINE, UEVENT_QUOTED, XE_FLASH, RECOVERED), 1))
    events = gpu_events(parse_kmsg(text))
    assert [(e.kind, e.method) for e in events] == [
        (WEDGED, None), (WEDGED, "rebind,bus-reset"), (WEDGED, VENDOR), (HANG, None)]
    assert {e.bdf for e in events} == {BDF0}


# -- doctor, devices, Prometheus ----------------------------------------------------------------


def test_gpu_health_in_doctor_devices_and_prometheus(tmp_path):
    h = clean_host(tmp_path / "h")
    put_health(h.root, BDF0, "critical\n")
    put_health(h.root, BDF1, "warning\n")
    code, data = doctor(h.root)
    got = {f["device"]: f["severity"] for f in findings(data, "device-health")}
    assert got == {BDF0: "fail", BDF1: "warn"} and code == 1
    assert f"/sys/bus/pci/devices/{BDF0}/gpu_health" in findings(data, "device-health")[0]["message"]
    devs = json.loads(cli(h.root, "devices", "--json").stdout)
    assert {d["bdf"]: d["health"] for d in devs["devices"]} == {BDF0: "critical", BDF1: "warning"}
    table = cli(h.root, "devices").stdout
    assert "health" in table and "critical" in table
    text = cli(h.root, "doctor", "--format", "prometheus").stdout
    assert f'xpuctl_device_health{{device="{BDF0}",source="gpu_health"}} 2' in text
    assert f'xpuctl_device_health{{device="{BDF1}",source="gpu_health"}} 1' in text


def test_an_ok_card_and_one_without_the_file_say_nothing(tmp_path):
    h = clean_host(tmp_path / "h")
    put_health(h.root, BDF0, "ok\n")
    code, data = doctor(h.root)
    assert findings(data, "device-health") == [] and code == 0
    devs = json.loads(cli(h.root, "devices", "--json").stdout)
    assert {d["bdf"]: d["health"] for d in devs["devices"]} == {BDF0: "ok", BDF1: None}
    text = cli(h.root, "doctor", "--format", "prometheus").stdout
    assert f'xpuctl_device_health{{device="{BDF0}",source="gpu_health"}} 0' in text
    assert f'device="{BDF1}",source=' not in text


def test_a_vendor_specific_wedge_says_flash_not_rebind(tmp_path):
    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(XE_WEDGED, 1, 100.0), rec(VENDOR_QUOTED, 2, 100.1),
               rec(UEVENT_QUOTED, 3, 200.0, BDF1))
    code, data = doctor(h.root)
    wedged = {f["device"]: f for f in findings(data, "device-wedged")}
    assert "WEDGED=vendor-specific" in wedged[BDF0]["message"]
    assert "flash" in wedged[BDF0]["remedy"] and "--rebind" not in wedged[BDF0]["remedy"]
    assert "WEDGED=rebind,bus-reset" in wedged[BDF1]["message"]
    assert "--rebind" in wedged[BDF1]["remedy"] and code == 1


def _drivers(root: Path) -> Path:
    drivers = root / "sys/bus/pci/drivers/xe"
    for op in ("unbind", "bind"):
        (drivers / op).write_text("")
    return drivers


def test_rebind_refuses_a_vendor_specific_recovery(tmp_path):
    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(XE_WEDGED, 1, 100.0), rec(XE_FLASH, 2, 100.1))
    drivers = _drivers(h.root)
    result = cli(h.root, "reset", "--state-dir", str(tmp_path / "state"), "--device", "0",
                 "--rebind", "--yes")
    assert result.exit_code == 1, result.output
    assert "refused: the kernel declared it wedged with a vendor-specific recovery" in result.output
    assert "flash the card's firmware" in result.output and "--kill-holders" not in result.output
    assert (drivers / "unbind").read_text() == "" and (drivers / "bind").read_text() == ""


# -- Sysman's health extension (the pyzes stand-in) ----------------------------------------------


def _sysman_env(tmp_path: Path, health: dict[str, str]) -> dict[str, str]:
    from test_deep import GiB, standin_env, sysman_device

    devices = [{**sysman_device(bdf, 24 * GiB, 24 * GiB, []), "health": said}
               for bdf, said in health.items()]
    return standin_env(tmp_path, {"pyzes": {"loader": "libc.so.6", "devices": devices}},
                       torch="absent", xpusmi=False)


def test_sysman_health_in_doctor_deep_devices_and_prometheus(tmp_path):
    env = _sysman_env(tmp_path, {BDF0: "FAILED", BDF1: "WARNING"})
    h = clean_host(tmp_path / "h")
    code, data = doctor(h.root, "--deep", "--probe-timeout", "60", env=env)
    got = {f["device"]: f for f in findings(data, "device-health")}
    assert got[BDF0]["severity"] == "fail" and "FAILED" in got[BDF0]["message"]
    assert "replaced" in got[BDF0]["remedy"] and got[BDF1]["severity"] == "warn"
    runtime = {d["bdf"]: d["runtime"]["health"] for d in data["devices"]}
    assert runtime == {BDF0: "failed", BDF1: "warning"} and code == 1
    text = cli(h.root, "doctor", "--deep", "--probe-timeout", "60", "--format", "prometheus",
               env=env).stdout
    assert f'xpuctl_device_health{{device="{BDF0}",source="sysman"}} 3' in text


def test_rebind_refuses_a_card_sysman_says_failed(tmp_path):
    env = _sysman_env(tmp_path, {BDF0: "FAILED", BDF1: "OK"})
    h = clean_host(tmp_path / "h")
    drivers = _drivers(h.root)
    result = cli(h.root, "reset", "--state-dir", str(tmp_path / "state"), "--device", "0",
                 "--rebind", "--yes", "--json", env=env)
    assert result.exit_code == 1, result.output
    rebind = json.loads(result.stdout)["rebind"]
    assert "FAILED" in rebind["refused"] and "replaced" in rebind["refused"]
    assert rebind["sysman_health"] == "failed" and rebind["wedge_method"] is None
    assert (drivers / "unbind").read_text() == ""


def test_a_snapshot_keeps_the_cards_health(tmp_path):
    h = clean_host(tmp_path / "h")
    put_health(h.root, BDF0, "critical\n")
    archive = tmp_path / "s.tar.gz"
    assert cli(h.root, "snapshot", "-o", str(archive)).exit_code == 0
    result = runner.invoke(app, ["doctor", "--from", str(archive), "--json"])
    found = findings(json.loads(result.stdout), "device-health")
    assert [(f["device"], f["severity"]) for f in found] == [(BDF0, "fail")]
