"""DRM fdinfo memory as Linux Documentation/gpu/drm-usage-stats.rst defines it: drm-total-<region>
is private plus shared, drm-shared-<region> the shared part, drm-resident-<region> what is
resident. A buffer shared by two clients of one device is not counted twice in the device's used
figure; shared and resident are shown apart, per device, in JSON, the table and Prometheus.

Samples: the key layout is i915's (i915_drm_client.c, as in tests/data/fdinfo/i915_dgpu.txt);
the figures of the first are the ones issue 22 §2 reports from a real i915 host (35 MiB total,
12 KiB resident). The two clients sharing one buffer are inferred from the document's
definition (no capture of two sharing clients was found).
"""

from __future__ import annotations

import json

import fakehost as fh
from fakehost import KiB, MiB
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.parse.fdinfo import parse_fdinfo

BDF = "0000:03:00.0"


def i915(client_id: int, total: int, shared: int, resident: int) -> str:
    return fh.generic_fdinfo(284, flags="02100002", mnt_id=26) + "".join(
        f"{k}:\t{v}\n" for k, v in [
            ("drm-driver", "i915"), ("drm-client-id", client_id), ("drm-pdev", BDF),
            ("drm-total-system0", "2 MiB"), ("drm-shared-system0", "0"),
            ("drm-resident-system0", "2 MiB"),
            ("drm-total-local0", f"{total // KiB} KiB"), ("drm-shared-local0", f"{shared // KiB} KiB"),
            ("drm-active-local0", "0"), ("drm-resident-local0", f"{resident // KiB} KiB"),
            ("drm-purgeable-local0", "0"),
            ("drm-engine-render", "0 ns")])


def test_parser_reads_shared_and_resident_of_device_regions_only():
    f = parse_fdinfo(i915(12, 35 * MiB, 0, 12 * KiB))
    assert (f.memory_bytes, f.shared_bytes, f.resident_bytes) == (35 * MiB, 0, 12 * KiB)
    xe = parse_fdinfo(fh.xe_fdinfo(5, BDF, [2 * MiB]))  # fakehost's xe layout: no shared key
    assert xe.memory_bytes == 2 * MiB


def _devices_json(tmp_path, clients: list[tuple[int, str]]) -> tuple[dict, str, str]:
    h = fh.FakeHost(tmp_path / "root")
    h.add_device("renderD128", "card0", BDF, driver="i915")
    h.add_process(1, 0, ["/sbin/init"], uid=0, comm="systemd")
    for pid, text in clients:
        h.add_process(pid, 1, ["python3", "serve.py"], fds={7: "/dev/dri/renderD128"}, fdinfo={7: text})
    runner = CliRunner()
    root = str(tmp_path / "root")
    j = runner.invoke(app, ["--root", root, "doctor", "--json"])
    t = runner.invoke(app, ["--root", root, "devices"], env={"COLUMNS": "300"})
    p = runner.invoke(app, ["--root", root, "doctor", "--format", "prometheus"])
    return json.loads(j.stdout), t.stdout, p.stdout


def _dev(data: dict) -> dict:
    return next(d for d in data["devices"] if d["bdf"] == BDF)


def test_a_buffer_shared_by_two_clients_is_counted_once(tmp_path):
    # each client: 100 MiB private + the same 50 MiB buffer (drm-total 150, drm-shared 50)
    data, table, prom = _devices_json(tmp_path, [
        (4001, i915(1, 150 * MiB, 50 * MiB, 150 * MiB)),
        (4002, i915(2, 150 * MiB, 50 * MiB, 150 * MiB)),
    ])
    d = _dev(data)
    assert d["memory_used_bytes"] == 250 * MiB  # not 300
    assert d["memory_shared_bytes"] == 100 * MiB and d["memory_resident_bytes"] == 300 * MiB
    procs = {p["pid"]: p["memory_bytes"] for p in data["processes"] if p["pid"] in (4001, 4002)}
    assert procs == {4001: 150 * MiB, 4002: 150 * MiB}  # per process: its own drm-total
    assert "250.0 MiB" in table and "100.0 MiB shared" in table
    assert f'xpuctl_device_memory_shared_bytes{{device="{BDF}"}}' in prom


def test_resident_is_shown_beside_total(tmp_path):
    data, table, prom = _devices_json(tmp_path, [(4001, i915(12, 35 * MiB, 0, 12 * KiB))])
    d = _dev(data)
    assert (d["memory_used_bytes"], d["memory_resident_bytes"], d["memory_shared_bytes"]) == (
        35 * MiB, 12 * KiB, 0)
    assert "35.0 MiB (12.0 KiB resident)" in table
    assert f'xpuctl_device_memory_resident_bytes{{device="{BDF}"}} 12288' in prom
