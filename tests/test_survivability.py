"""A card in survivability mode, and xe's engine and GT reset lines.

Sources: Linux drivers/gpu/drm/xe/xe_survivability_mode.c (the attribute
`/sys/bus/pci/devices/<bdf>/survivability_mode`, admin-only, exists only in survivability mode;
`survivability_mode_show` prints "Survivability mode type: Boot|Runtime" and, for a boot
failure, "<name>: 0x<reg> - 0x<value>" lines; boot survivability loads xe without a DRM card;
runtime survivability declares the card wedged; only a firmware flash helps). The kernel log
lines: xe_guc_submit.c xe_guc_exec_queue_reset_handler's xe_gt_info "Engine reset:
engine_class=%s, logical_mask: 0x%x, guc_id=%d" and xe_gt.c gt_reset's xe_gt_info "reset
started" (printed with the GT prefix, "GT0: reset started"; "Tile0: GT0: ..." on newer
kernels), in dev_printk form "xe BDF: [drm] ..." (kmsg records built with the header of Linux
Documentation/ABI/testing/dev-kmsg).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fakehost import BDF0, BDF1, clean_host
from fakehost_tree import survivability_text
from test_kernel import XE_WEDGED, rec, write_kmsg
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.parse.survivability import BOOT, RUNTIME, UNKNOWN, survivability_type

runner = CliRunner()

XE_ENGINE_RESET = ("6,{seq},{usec},-;xe {bdf}: [drm] GT0: Engine reset: engine_class=ccs, "
                   "logical_mask: 0x1, guc_id=7\n")
XE_GT_RESET = "6,{seq},{usec},-;xe {bdf}: [drm] Tile0: GT0: reset started\n"
XE_RUNTIME_SURVIVABILITY = "3,{seq},{usec},-;xe {bdf}: Runtime Survivability mode enabled\n"


def doctor(root: Path, *extra: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["--root", str(root), "doctor", "--json", *extra])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout)


def findings(data: dict, check: str) -> list[dict]:
    return [f for f in data["findings"] if f["check"] == check]


def device(data: dict, bdf: str) -> dict:
    return next(d for d in data["devices"] if d["bdf"] == bdf)


def put_survivability(root: Path, bdf: str, text: str) -> None:
    """xe's attribute in the card's PCI directory, as the kernel shows it (root only)."""
    pci = (root / "sys/bus/pci/devices" / bdf).resolve()
    (pci / "survivability_mode").write_text(text)
    os.chmod(pci / "survivability_mode", 0o400)


@pytest.mark.parametrize(("text", "mode"), [
    (survivability_text("Runtime"), RUNTIME),
    (survivability_text("Boot", boot_failure=True), BOOT),
    ("Capability Info: 0x138320 - 0x1e0f\n", UNKNOWN),  # before the type line was added
    ("", UNKNOWN),
])
def test_the_type_line(text, mode):
    assert survivability_type(text) == mode


def test_runtime_survivability_is_a_fail_with_the_firmware_flash(tmp_path):
    """Runtime survivability: xe also declared the card wedged; the finding is the
    survivability one (a flash, not a rebind), and device-wedged does not advise a rebind."""
    h = clean_host(tmp_path / "h")
    put_survivability(h.root, BDF1, survivability_text("Runtime"))
    write_kmsg(h.root, rec(XE_RUNTIME_SURVIVABILITY, 1, 90.0, BDF1), rec(XE_WEDGED, 2, 90.1, BDF1))
    code, data = doctor(h.root)
    assert code == 1
    (f,) = findings(data, "device-survivability")
    assert f["severity"] == "fail" and f["device"] == BDF1, f
    assert "runtime survivability mode" in f["message"] and "survivability_mode" in f["message"]
    assert "flash the card's firmware" in f["remedy"] and "rebind" in f["remedy"], f
    assert "does not bring it back" in f["remedy"]
    assert findings(data, "device-wedged") == []  # not "rebind it"
    assert device(data, BDF1)["survivability"] == RUNTIME
    assert device(data, BDF0)["survivability"] is None and device(data, BDF1)["index"] == 1


def test_boot_survivability_card_without_drm_nodes_is_listed(tmp_path):
    """Boot survivability: xe is bound but made no DRM node. The card is still found (from
    /sys/bus/pci/drivers/xe), without a node or a Level Zero index; the others keep theirs."""
    h = clean_host(tmp_path / "h")
    bdf = "0000:05:00.0"
    h.add_device("renderD130", "card2", bdf, device=0xE211, driver="xe",
                 survivability=survivability_text("Boot", boot_failure=True), drm=False)
    code, data = doctor(h.root)
    assert code == 1
    dev = device(data, bdf)
    assert dev["survivability"] == BOOT and dev["index"] is None and dev["render_node"] is None
    assert [device(data, b)["index"] for b in (BDF0, BDF1)] == [0, 1]
    (f,) = findings(data, "device-survivability")
    assert f["device"] == bdf and "boot survivability mode" in f["message"]
    assert "no render node" in f["message"]
    # and in the table for people
    result = runner.invoke(app, ["--root", str(h.root), "doctor"])
    assert bdf in result.stdout and "survivability" in result.stdout


def test_rebind_refuses_a_card_in_survivability_mode(tmp_path):
    h = clean_host(tmp_path / "h")
    put_survivability(h.root, BDF1, survivability_text("Runtime"))
    drivers = h.root / "sys/bus/pci/drivers/xe"
    for op in ("unbind", "bind"):
        (drivers / op).write_text("")
    result = runner.invoke(app, ["--root", str(h.root), "reset", "--state-dir",
                                 str(tmp_path / "state"), "--device", "1", "--rebind", "--yes"])
    assert result.exit_code == 1, result.output
    assert "refused: the device is in survivability mode (Runtime)" in result.output
    assert "only a firmware flash" in result.output
    assert (drivers / "unbind").read_text() == "" and (drivers / "bind").read_text() == ""


def test_engine_and_gt_reset_lines_are_the_devices_kernel_findings(tmp_path):
    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(XE_ENGINE_RESET, 1, 100.0, BDF0), rec(XE_GT_RESET, 2, 101.0, BDF1))
    code, data = doctor(h.root)
    hangs = {f["device"]: f for f in findings(data, "gpu-hang")}
    assert set(hangs) == {BDF0, BDF1}, data["findings"]
    assert "Engine reset: engine_class=ccs" in hangs[BDF0]["message"]
    assert "GT0: reset started" in hangs[BDF1]["message"]
    assert code == 0  # a warning: the card recovered


@pytest.mark.slow
def test_serve_refuses_a_card_in_survivability_mode(rig):
    """Before vLLM starts, --force or not; without --devices the other cards are named."""
    pci = Path(rig.root.root) / "sys/devices/pci0000:00" / rig.root.bdf(1)
    (pci / "survivability_mode").write_text(survivability_text("Runtime"))
    for opts in (["--devices", "1"], ["--devices", "1", "--force"], []):
        res = rig.serve(opts=opts, retry_foreign=False)
        assert res.rc == 1, str(res)
        assert "is in survivability mode: nothing runs on it until its firmware is flashed" \
            in res.err, str(res)
        assert rig.root.bdf(1) in res.err and "Runtime" in res.err
        assert ("choose the other cards with --devices" in res.err) == (opts == []), str(res)
    assert rig.events() == []  # no vLLM was started
    res = rig.serve(opts=["--devices", "0"])  # the other card serves
    assert res.rc == 0, str(res)
    assert rig.shutdown(res.name, "--release-timeout", "5").rc == 0
    rig.assert_clean()
