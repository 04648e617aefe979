"""The i915 backport (intel-i915-dkms) prints no memory keys in fdinfo; its per-client memory is in
/sys/class/drm/cardN/clients/<id>/ (pid, name, total_device_memory_buffer_objects/created_bytes
and imported_bytes). Source: compute-runtime level_zero/sysman/source/.../global_operations/
linux/ (Sysman reads `pid`, then created_bytes as the process's memory, imported_bytes as its
shared memory) and its unit tests (mock files clients/<id>/total_device_memory_buffer_objects/
created_bytes). Each file holding one decimal number is read there; the exact text of `pid`
on a real host (a bare number) is inferred from Sysman reading it as an integer.
"""

from __future__ import annotations

import json

import fakehost as fh
from fakehost import MiB
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.parse.drmclients import parse_client

BDF = "0000:29:00.0"
# an i915 backport fdinfo without memory keys (drm-driver, drm-client-id, drm-pdev, engines)
NO_MEMORY = (fh.generic_fdinfo(284, flags="02100002", mnt_id=26)
             + f"drm-driver:\ti915\ndrm-client-id:\t6\ndrm-pdev:\t{BDF}\ndrm-engine-render:\t0 ns\n")


def test_parse_client_files():
    c = parse_client("6", "4242\n", "python3\n", "1073741824\n", "0\n")
    assert (c.pid, c.name, c.created_bytes, c.imported_bytes) == (4242, "python3", 1 << 30, 0)
    bad = parse_client("7", "x", None, "-1", "")
    assert (bad.pid, bad.name, bad.created_bytes, bad.imported_bytes) == (None, None, None, None)


def _host(tmp_path, with_sysfs: bool):
    h = fh.FakeHost(tmp_path / "root")
    h.add_device("renderD128", "card0", BDF, driver="i915")
    h.add_process(1, 0, ["/sbin/init"], uid=0, comm="systemd")
    h.add_process(4242, 1, ["python3", "serve.py"], fds={7: "/dev/dri/renderD128"}, fdinfo={7: NO_MEMORY})
    if with_sysfs:
        for cid, pid, created in (("6", 4242, 300 * MiB), ("9", 999999, 5 * MiB)):
            d = tmp_path / "root/sys/class/drm/card0/clients" / cid
            (d / "total_device_memory_buffer_objects").mkdir(parents=True)
            (d / "pid").write_text(f"{pid}\n")
            (d / "name").write_text("python3\n")
            (d / "total_device_memory_buffer_objects/created_bytes").write_text(f"{created}\n")
            (d / "total_device_memory_buffer_objects/imported_bytes").write_text("0\n")
    return str(tmp_path / "root")


def test_memory_comes_from_the_clients_dir_when_fdinfo_has_none(tmp_path):
    root = _host(tmp_path, True)
    r = CliRunner().invoke(app, ["--root", root, "doctor", "--json"])
    data = json.loads(r.stdout)
    d = next(x for x in data["devices"] if x["bdf"] == BDF)
    assert d["memory_used_bytes"] == 300 * MiB and d["memory_source"] == "sysfs-clients"
    (p,) = [p for p in data["processes"] if p["pid"] == 4242]
    assert p["memory_bytes"] == 300 * MiB  # tied by pid; pid 999999 is not a holder here
    t = CliRunner().invoke(app, ["--root", root, "devices"], env={"COLUMNS": "300"})
    assert "from the i915 clients sysfs" in t.stdout


def test_without_the_clients_dir_memory_stays_unknown(tmp_path):
    root = _host(tmp_path, False)
    data = json.loads(CliRunner().invoke(app, ["--root", root, "doctor", "--json"]).stdout)
    d = next(x for x in data["devices"] if x["bdf"] == BDF)
    assert d["memory_used_bytes"] is None and d["memory_source"] is None
