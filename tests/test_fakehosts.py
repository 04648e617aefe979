"""`doctor`, `ps` and `devices` on fake host trees (tests/support/fakehost.py) against the JSON contract.

Each scenario is built once per module (the commands are read-only) and the CLI runs in-process
with `--root`. Expected figures come from the scenario constants, written by hand.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import fakehost as fh
import pytest
from fakehost import GiB, KiB, MiB
from typer.testing import CliRunner

from xpuctl.cli import app

CHECKS = {
    "no-device",
    "device-holders",
    "orphans",
    "device-memory",
    "stuck-processes",
    "stale-shm",
    "stale-libfabric",
    "stale-ipc",
    "ports",
    "env",
    "run-health",
    "unattributed-memory",
    "device-lost",
    "device-survivability",
    "probe-timeout",
    "device-health",
    "known-issues",
    "device-wedged",
    "gpu-hang",
    "devcoredump",
    "collective",
    "last-run",
    "run-records",
    "blocked-reads",
    "inspection",
}
SEVERITIES = {"info", "warn", "fail"}
ROLES = {"api-server", "engine-core", "worker", "dp-coordinator", "resource-tracker", None}
KINDS = {"shm", "libfabric", "ccl-shm", "filestore", "ccl-socket", "ccl-probe", "zmq-socket",
         "xpu-ipc-socket", "cache"}
DEVICE_KEYS = {
    "index",
    "bdf",
    "render_node",
    "card_node",
    "driver",
    "vendor_id",
    "device_id",
    "memory_used_bytes",
    "memory_total_bytes",
    "holders",
}
PROCESS_KEYS = {
    "pid",
    "ppid",
    "state",
    "cmdline",
    "role",
    "orphan",
    "devices",
    "memory_bytes",
    "run_id",
    "wchan",
}
ARTIFACT_KEYS = {"path", "kind", "stale", "open_by", "owner_uid", "size_bytes"}
FINDING_KEYS = {"check", "severity", "device", "pids", "paths", "message", "remedy"}

runner = CliRunner()


# --- helpers --------------------------------------------------------------------------------


def run(root: Path, *args: str):
    result = runner.invoke(app, ["--root", str(root), *args])
    out = result.stdout + (result.stderr or "")
    assert "Traceback" not in out, out
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: uncaught {result.exception!r}") from result.exception
    return result


def run_json(root: Path, *args: str) -> tuple[int, dict]:
    result = run(root, *args)
    try:
        data = json.loads(result.stdout)
    except ValueError as e:
        raise AssertionError(
            f"{args}: stdout is not JSON (exit {result.exit_code}):\n{result.output}"
        ) from e
    return result.exit_code, data


def doctor(root: Path, *extra: str) -> tuple[int, dict]:
    code, data = run_json(root, "doctor", "--json", *extra)
    assert data["schema"] == "xpuctl.doctor/1"
    return code, data


def by_pid(data: dict) -> dict[int, dict]:
    return {p["pid"]: p for p in data["processes"]}


def by_bdf(data: dict) -> dict[str, dict]:
    return {d["bdf"]: d for d in data["devices"]}


def by_path(data: dict) -> dict[str, dict]:
    return {a["path"]: a for a in data["artifacts"]}


def findings(data: dict, check: str) -> list[dict]:
    return [f for f in data["findings"] if f["check"] == check]


def finding_pids(data: dict, check: str) -> set[int]:
    return {p for f in findings(data, check) for p in (f["pids"] or [])}


def finding_paths(data: dict, *checks: str) -> set[str]:
    return {p for c in checks for f in findings(data, c) for p in (f["paths"] or [])}


def holders(data: dict, bdf: str) -> list[int]:
    return sorted(by_bdf(data)[bdf]["holders"])


# --- scenarios, built once per module -------------------------------------------------------


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> dict[str, fh.FakeHost]:
    base = tmp_path_factory.mktemp("hosts")
    return {
        "clean": fh.clean_host(base / "clean"),
        "healthy": fh.healthy_host(base / "healthy"),
        "orphan": fh.orphan_host(base / "orphan"),
        "i915": fh.i915_host(base / "i915"),
        "mixed": fh.mixed_vendor_host(base / "mixed"),
        "no-drm": fh.no_drm_host(base / "no-drm"),
        "amd-only": fh.amd_only_host(base / "amd-only"),
    }


@pytest.fixture(scope="module")
def reports(hosts) -> dict[str, tuple[int, dict]]:
    return {name: doctor(h.root) for name, h in hosts.items()}


SCENARIOS = ["clean", "healthy", "orphan", "i915", "mixed", "no-drm", "amd-only"]


# --- the contract holds everywhere ----------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_doctor_json_shape(reports, name):
    code, data = reports[name]
    assert set(data) >= {
        "schema",
        "status",
        "devices",
        "processes",
        "artifacts",
        "ports",
        "findings",
    }
    assert data["status"] in {"clean", "busy", "dirty"}
    for d in data["devices"]:
        assert set(d) >= DEVICE_KEYS, d
        assert d["render_node"] is None or d["render_node"].startswith("/dev/dri/renderD")
        assert d["card_node"] is None or d["card_node"].startswith("/dev/dri/card")
        assert d["vendor_id"].startswith("0x") and d["device_id"].startswith("0x")
    for p in data["processes"]:
        assert set(p) >= PROCESS_KEYS, p
        assert p["role"] in ROLES
        assert p["state"] in {"R", "S", "D", "Z", "T"}
        assert isinstance(p["cmdline"], str) and isinstance(p["orphan"], bool)
        assert "\x00" not in p["cmdline"] and p["cmdline"] == p["cmdline"].strip()
    for a in data["artifacts"]:
        assert set(a) >= ARTIFACT_KEYS, a
        assert a["kind"] in KINDS and isinstance(a["stale"], bool)
        assert a["path"].startswith("/")
    for f in data["findings"]:
        assert set(f) >= FINDING_KEYS, f
        assert f["check"] in CHECKS and f["severity"] in SEVERITIES
    # exit code: 1 iff a finding fails; status "dirty" iff exit 1
    has_fail = any(f["severity"] == "fail" for f in data["findings"])
    assert code == (1 if has_fail else 0)
    assert (data["status"] == "dirty") == (code == 1)


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_paths_leak_the_root(hosts, reports, name):
    _, data = reports[name]
    # the report may say which root it read; every path inside it is a host path
    body = {k: v for k, v in data.items() if k != "root"}
    assert str(hosts[name].root) not in json.dumps(body)


@pytest.mark.parametrize("name", SCENARIOS)
def test_ps_and_devices_match_doctor(hosts, reports, name):
    _, doc = reports[name]
    code, ps = run_json(hosts[name].root, "ps", "--json")
    assert code == 0
    assert ps["schema"] == "xpuctl.ps/1"
    # ps shows the vLLM trees (it may leave out non-vLLM holders); records are doctor's records
    doc_procs = by_pid(doc)
    for p in ps["processes"]:
        assert p == doc_procs.get(p["pid"]), p["pid"]
    assert {p["pid"] for p in ps["processes"] if p["role"]} == {
        p for p, r in doc_procs.items() if r["role"]
    }
    code, dev = run_json(hosts[name].root, "devices", "--json")
    assert code == 0
    assert dev["schema"] == "xpuctl.devices/1"
    assert sorted(dev["devices"], key=lambda d: d["bdf"]) == sorted(
        doc["devices"], key=lambda d: d["bdf"]
    )


# --- (a) clean host -------------------------------------------------------------------------


def test_clean_host(reports):
    code, data = reports["clean"]
    assert code == 0
    assert data["status"] == "clean"
    assert data["processes"] == []  # bash, sshd, a busy python: none is vLLM, none holds a GPU
    assert not [a for a in data["artifacts"] if a["stale"]]
    assert not [f for f in data["findings"] if f["severity"] == "fail"]
    devs = sorted(data["devices"], key=lambda d: d["bdf"])
    assert [d["bdf"] for d in devs] == [fh.BDF0, fh.BDF1]
    for i, d in enumerate(devs):
        assert d["index"] == i
        assert d["render_node"] == f"/dev/dri/renderD{128 + i}"
        assert d["card_node"] == f"/dev/dri/card{i}"
        assert d["driver"] == "xe"
        assert d["vendor_id"] == "0x8086"
        assert d["device_id"] == "0xe211"
        assert d["holders"] == []
        assert d["memory_used_bytes"] is None
        assert d["memory_total_bytes"] == 24 * GiB  # tile0/physical_vram_size_bytes


def test_clean_host_other_apps_shm_is_in_use(reports):
    _, data = reports["clean"]
    a = by_path(data).get(fh.PSM_OTHER_APP)
    if a is not None:  # listed or not, a psm_* open by a live process is never stale
        assert a["stale"] is False
        assert a["open_by"] == [2101]


# --- (b) healthy TP=2 server ----------------------------------------------------------------


def test_healthy_status_busy(reports):
    code, data = reports["healthy"]
    assert code == 0
    assert data["status"] == "busy"
    assert not [f for f in data["findings"] if f["severity"] == "fail"]


def test_healthy_processes(hosts, reports):
    h = hosts["healthy"]
    _, data = reports["healthy"]
    procs = by_pid(data)
    assert {h.api, h.engine, h.tp0, h.tp1} <= set(procs)
    assert set(procs) <= {
        h.api,
        h.tracker,
        h.engine,
        h.tp0,
        h.tp1,
    }  # no bash/sshd/etl.py/its tracker
    api, eng, tp0, tp1 = procs[h.api], procs[h.engine], procs[h.tp0], procs[h.tp1]
    assert api["role"] == "api-server"
    assert api["cmdline"] == (
        "/usr/bin/python3 /usr/local/bin/vllm serve /models/llama "
        "--tensor-parallel-size 2 --port 8000"
    )
    assert api["ppid"] == 2001
    assert (
        eng["role"] == "engine-core"
        and eng["cmdline"] == "VLLM::EngineCore"
        and eng["ppid"] == h.api
    )
    assert (
        tp0["role"] == "worker" and tp0["cmdline"] == "VLLM::Worker_TP0" and tp0["ppid"] == h.engine
    )
    assert tp1["role"] == "worker" and tp1["cmdline"] == "VLLM::Worker_TP1"
    if h.tracker in procs:
        assert procs[h.tracker]["role"] == "resource-tracker"
    for p in procs.values():
        assert p["orphan"] is False
        assert p["run_id"] is None  # not started by xpuctl; the workers' environ is zeroed anyway
        assert p["state"] == "S"


def test_healthy_process_devices_and_memory(hosts, reports):
    h = hosts["healthy"]
    procs = by_pid(reports["healthy"][1])
    assert procs[h.api]["devices"] == [] and procs[h.api]["memory_bytes"] is None
    assert procs[h.tp0]["devices"] == [fh.BDF0]
    assert procs[h.tp0]["memory_bytes"] == fh.TP0_VRAM == 12 * GiB
    assert procs[h.tp1]["devices"] == [fh.BDF1]
    assert procs[h.tp1]["memory_bytes"] == fh.TP1_VRAM == 12800 * MiB
    assert sorted(procs[h.engine]["devices"]) == [fh.BDF0, fh.BDF1]
    # client id 11 on both devices: two clients (ids are per device), 4 MiB + 2 MiB
    assert procs[h.engine]["memory_bytes"] == 6 * MiB


def test_healthy_devices(hosts, reports):
    h = hosts["healthy"]
    _, data = reports["healthy"]
    assert holders(data, fh.BDF0) == [h.engine, h.tp0]
    assert holders(data, fh.BDF1) == [h.engine, h.tp1]
    devs = by_bdf(data)
    assert devs[fh.BDF0]["memory_used_bytes"] == 12 * GiB + 4 * MiB
    assert devs[fh.BDF1]["memory_used_bytes"] == 12800 * MiB + 2 * MiB
    assert devs[fh.BDF0]["index"] == 0 and devs[fh.BDF1]["index"] == 1


def test_healthy_port(hosts, reports):
    _, data = reports["healthy"]
    on_8000 = [p for p in data["ports"] if p["port"] == 8000]
    # one LISTEN row; the ESTABLISHED row of a client on 8000 is not a listener
    assert len(on_8000) == 1
    assert on_8000[0]["pid"] == hosts["healthy"].api
    # sshd's port 22 is not a vLLM port and not held by a vLLM process
    assert not [p for p in data["ports"] if p["port"] == 22 and p["pid"] in by_pid(data)]


def test_healthy_artifacts_in_use(hosts, reports):
    h = hosts["healthy"]
    _, data = reports["healthy"]
    arts = by_path(data)
    assert not [a["path"] for a in data["artifacts"] if a["stale"]]
    assert arts[fh.PSM_BCAST]["kind"] == "shm"
    assert arts[fh.PSM_BCAST]["open_by"] == [h.tp0, h.tp1]
    assert arts[fh.PSM_BCAST]["owner_uid"] == 1000
    assert arts[fh.PSM_BCAST]["size_bytes"] == 16 * MiB
    assert arts[fh.PSM_TP0]["open_by"] == [h.tp0]
    assert arts[fh.PSM_TP1]["open_by"] == [h.tp1]
    assert arts[fh.SEM_ENGINE]["kind"] == "shm" and arts[fh.SEM_ENGINE]["stale"] is False
    assert (
        arts[fh.FILESTORE_LIVE]["kind"] == "filestore" and arts[fh.FILESTORE_LIVE]["stale"] is False
    )
    for uuid in fh.UUIDS_ENGINE + fh.UUIDS_API:
        assert arts[f"/tmp/{uuid}"]["kind"] == "zmq-socket"
        assert arts[f"/tmp/{uuid}"]["stale"] is False


# --- (c) API server SIGKILLed: orphans and leftovers ----------------------------------------


def test_orphan_exit_dirty(reports):
    code, data = reports["orphan"]
    assert code == 1
    assert data["status"] == "dirty"


def test_orphans(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    procs = by_pid(data)
    assert h.api not in procs
    orphans = {pid for pid, p in procs.items() if p["orphan"]}
    assert {h.engine, h.tp0, h.tp1} <= orphans <= {h.engine, h.tp0, h.tp1, h.tracker}
    assert procs[h.engine]["role"] == "engine-core" and procs[h.engine]["ppid"] == 1
    assert procs[h.tp0]["role"] == "worker" and procs[h.tp0]["ppid"] == h.engine
    assert procs[h.tp1]["role"] == "worker"
    if h.tracker in procs:
        assert procs[h.tracker]["role"] == "resource-tracker"
    f = findings(data, "orphans")
    assert any(x["severity"] == "fail" for x in f)
    assert {h.engine, h.tp0, h.tp1} <= finding_pids(data, "orphans")
    assert not finding_pids(data, "orphans") & {h.zombie, h.decoy_train, h.decoy_tail, h.monitor}


def test_unrelated_resource_tracker_is_not_vllm(hosts, reports):
    # etl.py (2101, alive, not vLLM) has its own multiprocessing resource tracker 2102 in the
    # same login session as vLLM: it belongs to etl.py, not to vLLM, and is no orphan.
    for name in ("healthy", "orphan"):
        procs = by_pid(reports[name][1])
        assert 2102 not in procs, (name, procs.get(2102))
        assert 2102 not in finding_pids(reports[name][1], "orphans")


def test_orphan_decoys_and_non_vllm_absent(hosts, reports):
    h = hosts["orphan"]
    procs = by_pid(reports["orphan"][1])
    for pid in (h.decoy_tail, h.decoy_train, 2101, 2102, 2001, 812, 1):
        assert pid not in procs, procs.get(pid)


def test_orphan_zombie_holds_nothing(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    for d in data["devices"]:
        assert h.zombie not in d["holders"]
    z = by_pid(data).get(h.zombie)
    if z is not None:
        assert z["orphan"] is False
        assert z["state"] == "Z"
        assert z["devices"] == [] and not z["memory_bytes"]
    assert h.zombie not in finding_pids(data, "device-holders")


def test_orphan_monitor_is_a_holder_without_memory(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    mon = by_pid(data)[h.monitor]
    assert mon["role"] is None
    assert mon["orphan"] is False
    assert mon["cmdline"] == "/usr/bin/xpu-smi dump -d 0 -m 1"
    assert mon["devices"] == [fh.BDF0]
    assert mon["memory_bytes"] == 0  # drm-total-vram0: 0


def test_orphan_holders(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    assert holders(data, fh.BDF0) == [h.engine, h.tp0, h.monitor]
    assert holders(data, fh.BDF1) == [h.engine, h.tp1]
    procs = by_pid(data)
    assert procs[h.tp0]["devices"] == [fh.BDF0]
    assert procs[h.tp1]["devices"] == [fh.BDF1]


def test_orphan_dup_fd_is_one_client(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    # fd 9 and fd 15 of tp0 are one client (0000:03:00.0, id 12): 12 GiB, not 24
    assert by_pid(data)[h.tp0]["memory_bytes"] == 12 * GiB
    dev0 = by_bdf(data)[fh.BDF0]
    assert dev0["memory_used_bytes"] == 12 * GiB + 4 * MiB + 0  # tp0 + engine + monitor
    assert dev0["memory_total_bytes"] == 24 * GiB


def test_orphan_dmabuf_is_not_drm_client_memory(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    # tp1 holds a 2 MiB xe dma-buf fd (an IPC handle): memory is drm-total-vram*/local* only.
    # The exporter's own drm-total already contains that buffer, and dma-buf fdinfo does not
    # say which device exported it.
    assert by_pid(data)[h.tp1]["memory_bytes"] == 12800 * MiB
    assert by_bdf(data)[fh.BDF1]["memory_used_bytes"] == 12800 * MiB + 2 * MiB  # tp1 + engine


def test_orphan_stuck_worker(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    tp1 = by_pid(data)[h.stuck]
    assert tp1["state"] == "D"
    assert tp1["wchan"] == "dma_fence_default_wait"
    assert h.stuck in finding_pids(data, "stuck-processes")
    assert not finding_pids(data, "stuck-processes") & {h.tp0, h.engine, h.monitor}


def test_orphan_port_is_free(reports):
    _, data = reports["orphan"]
    # the API server's LISTEN socket is gone; a TIME_WAIT row on 8000 is not a holder
    assert not [p for p in data["ports"] if p["port"] == 8000 and p["pid"] is not None]


STALE = [
    "stale_shm",
    "filestore_old",
    "filestore_bob",
    "ccl_dead",
    "ccl_handle",
    "zmq_api_0",
    "zmq_api_1",
    "zmq_old_0",
    "zmq_old_1",
]
IN_USE = [
    "psm_bcast",
    "psm_tp0",
    "psm_tp1",
    "psm_tp1b",
    "sem",
    "filestore_live",
    "ccl_live",
    "ccl_cache",
    "zmq_engine_0",
    "zmq_engine_1",
    "zmq_engine_2",
    "other_app_shm",
]
KIND = {
    "stale_shm": "shm",
    "filestore_old": "filestore",
    "filestore_bob": "filestore",
    "ccl_dead": "ccl-socket",
    "ccl_handle": "ccl-socket",
    "zmq_api_0": "zmq-socket",
    "zmq_old_0": "zmq-socket",
    "psm_bcast": "shm",
    "sem": "shm",
    "filestore_live": "filestore",
    "ccl_live": "ccl-socket",
    "ccl_cache": "cache",
    "zmq_engine_0": "zmq-socket",
}


@pytest.mark.parametrize("key", STALE)
def test_orphan_stale_artifact(hosts, reports, key):
    path = hosts["orphan"].paths[key]
    arts = by_path(reports["orphan"][1])
    assert path in arts, f"{path} not listed"
    assert arts[path]["stale"] is True
    assert arts[path]["open_by"] == []
    if key in KIND:
        assert arts[path]["kind"] == KIND[key]


@pytest.mark.parametrize("key", IN_USE)
def test_orphan_artifact_in_use(hosts, reports, key):
    path = hosts["orphan"].paths[key]
    arts = by_path(reports["orphan"][1])
    if key == "other_app_shm" and path not in arts:
        return  # not a vLLM file; listing it is optional, calling it stale is not
    assert path in arts, f"{path} not listed"
    assert arts[path]["stale"] is False
    if key in KIND:
        assert arts[path]["kind"] == KIND[key]


def test_orphan_artifact_details(hosts, reports):
    h = hosts["orphan"]
    arts = by_path(reports["orphan"][1])
    assert arts[fh.PSM_BCAST]["open_by"] == [h.tp0, h.tp1]
    dead = arts[h.paths["stale_shm"]]
    assert dead["owner_uid"] == 1000 and dead["size_bytes"] == 4 * MiB
    assert arts[h.paths["filestore_bob"]]["owner_uid"] == 1001
    assert arts[h.paths["ccl_cache"]]["owner_uid"] == 0


def test_orphan_never_stale_non_artifacts(hosts, reports):
    h = hosts["orphan"]
    arts = by_path(reports["orphan"][1])
    # a symlink is never stale (never followed); a uuid-named regular file is not a ZMQ socket
    if h.paths["shm_symlink"] in arts:
        assert arts[h.paths["shm_symlink"]]["stale"] is False
    reg = arts.get(h.paths["uuid_regular"])
    assert reg is None or (reg["kind"] != "zmq-socket" and reg["stale"] is False)
    for p in (
        "/tmp/notes.txt",
        "/tmp/.X11-unix",
        "/tmp/systemd-private-4e1b8c2d-chrony.service-Xy12Ab",
    ):
        assert p not in arts or arts[p]["stale"] is False


def test_orphan_stale_findings_name_exactly_the_stale_paths(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    named = finding_paths(data, "stale-shm", "stale-ipc")
    assert h.paths["stale_shm"] in {p for f in findings(data, "stale-shm") for p in f["paths"]}
    assert h.paths["ccl_dead"] in {p for f in findings(data, "stale-ipc") for p in f["paths"]}
    for key in STALE:
        assert h.paths[key] in named, key
    for key in IN_USE + ["shm_symlink", "uuid_regular"]:
        assert h.paths[key] not in named, key


def test_orphan_device_holder_finding_names_the_monitor(hosts, reports):
    h = hosts["orphan"]
    _, data = reports["orphan"]
    assert h.monitor in finding_pids(data, "device-holders")


# --- (d) i915: Arc A770 + iGPU, a run started by xpuctl -------------------------------------


def test_i915_devices(hosts, reports):
    h = hosts["i915"]
    code, data = reports["i915"]
    assert code == 0 and data["status"] == "busy"
    assert len(data["devices"]) == 2  # connectors card0-eDP-1, card1-DP-1 are not devices
    devs = by_bdf(data)
    igpu, arc = devs[fh.IGPU_BDF], devs[fh.A770_BDF]
    assert igpu["index"] == 0 and arc["index"] == 1  # Level Zero order: BDF
    assert igpu["driver"] == arc["driver"] == "i915"
    assert igpu["device_id"] == "0xa780" and arc["device_id"] == "0x56a0"
    assert igpu["render_node"] == "/dev/dri/renderD128" and igpu["card_node"] == "/dev/dri/card0"
    assert arc["render_node"] == "/dev/dri/renderD129" and arc["card_node"] == "/dev/dri/card1"
    # i915: local0 counts, system0 does not
    assert arc["memory_used_bytes"] == 14680064 * KiB + 3 * MiB
    assert igpu["memory_used_bytes"] is None  # its only holder reports system0 alone
    assert arc["memory_total_bytes"] == 16 * GiB  # card1/lmem_total_bytes
    assert igpu["memory_total_bytes"] is None
    assert sorted(igpu["holders"]) == [h.engine]
    assert sorted(arc["holders"]) == [h.engine, h.worker]


def test_i915_processes_and_run_id(hosts, reports):
    h = hosts["i915"]
    procs = by_pid(reports["i915"][1])
    assert set(procs) == {h.api, h.engine, h.worker}
    assert procs[h.api]["role"] == "api-server"
    assert procs[h.api]["cmdline"].startswith(
        "/home/alice/venv/bin/python -m vllm.entrypoints.openai.api_server"
    )
    assert procs[h.engine]["role"] == "engine-core"
    assert procs[h.worker]["role"] == "worker" and procs[h.worker]["cmdline"] == "VLLM::Worker"
    assert procs[h.worker]["memory_bytes"] == 14680064 * KiB
    assert procs[h.worker]["devices"] == [fh.A770_BDF]
    assert procs[h.engine]["memory_bytes"] == 3 * MiB
    assert sorted(procs[h.engine]["devices"]) == [fh.IGPU_BDF, fh.A770_BDF]
    for p in procs.values():
        assert p["run_id"] == fh.RUN_ID  # SPT_NOENV=1 kept every environ readable
        assert p["orphan"] is False


# --- (e) non-Intel device first -------------------------------------------------------------


def test_mixed_vendor_devices(reports):
    code, data = reports["mixed"]
    assert code == 0 and data["status"] == "clean"
    devs = by_bdf(data)
    assert set(devs) == {fh.AMD_BDF, fh.XE_BDF}
    amd, xe = devs[fh.AMD_BDF], devs[fh.XE_BDF]
    assert amd["vendor_id"] == "0x1002" and amd["index"] is None
    assert amd["driver"] == "amdgpu" and amd["device_id"] == "0x744c"
    assert amd["render_node"] == "/dev/dri/renderD128"
    assert xe["vendor_id"] == "0x8086" and xe["index"] == 0
    assert xe["device_id"] == "0xe20b" and xe["driver"] == "xe"
    assert xe["render_node"] == "/dev/dri/renderD129" and xe["card_node"] == "/dev/dri/card1"
    assert xe["memory_total_bytes"] is None  # no tile sysfs on this kernel
    assert xe["holders"] == [] and xe["memory_used_bytes"] is None


def test_mixed_vendor_device_selection(hosts):
    root = hosts["mixed"].root
    assert doctor(root, "--device", "0")[0] == 0
    assert doctor(root, "--device", fh.XE_BDF)[0] == 0
    # index 1 does not exist: Level Zero counts only the Intel device
    assert run(root, "doctor", "--json", "--device", "1").exit_code == 2


# --- (f, g) no Intel GPU ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no-drm", "amd-only"])
def test_no_intel_gpu_is_a_warning_finding(hosts, reports, name):
    """A finding (warn: nothing to clean, exit 0; --strict makes it count) and, for people,
    a sentence where the devices table would be empty."""
    code, data = reports[name]
    assert code == 0 and data["status"] == "clean"
    mine = [f for f in data["findings"] if f["check"] == "no-device"]
    assert len(mine) == 1 and mine[0]["severity"] == "warn", data["findings"]
    assert mine[0]["message"].startswith("no Intel GPU found")
    assert mine[0]["remedy"]
    root = hosts[name].root
    assert run(root, "doctor", "--strict").exit_code == 1
    res = run(root, "doctor")
    assert res.exit_code == 0
    lines = res.stdout.splitlines()
    assert lines[0] == "no Intel GPU found", res.stdout
    assert "clean, 1 warning (no Intel GPU found)" in res.stdout  # its warning counted
    has_table = any(line.startswith("Devices") for line in lines)
    assert has_table == (name == "amd-only"), res.stdout  # the AMD device is still listed
    assert run(root, "devices").stdout.splitlines()[0] == "no Intel GPU found"
    prom = run(root, "doctor", "--format", "prometheus").stdout
    assert 'xpuctl_doctor_check_ok{check="no-device"} 0' in prom


@pytest.mark.parametrize("name", ["clean", "healthy", "orphan", "i915", "mixed"])
def test_hosts_with_an_intel_gpu_have_no_no_device_finding(reports, name):
    assert not [f for f in reports[name][1]["findings"] if f["check"] == "no-device"]


# --- usage errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["7", "0000:99:00.0", "renderD200", "-1", "zero"])
def test_unknown_device_is_a_usage_error(hosts, device):
    result = run(hosts["healthy"].root, "doctor", "--json", "--device", device)
    assert result.exit_code == 2


@pytest.mark.parametrize("device", ["0", "1", fh.BDF1])
def test_known_device_is_accepted(hosts, device):
    code, _ = doctor(hosts["orphan"].root, "--device", device)
    assert code in (0, 1)


def test_missing_root_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["--root", str(tmp_path / "nope"), "doctor", "--json"])
    assert result.exit_code == 2


# --- malformed input never produces a traceback ---------------------------------------------


def _truncated_stat(h: fh.FakeHost) -> None:
    (h.root / "proc/3020/stat").write_text("3020 (VLLM::Worker_TP) S 30")
    (h.root / "proc/3021/stat").write_text("")


def _bad_utf8_cmdline(h: fh.FakeHost) -> None:
    h.add_process(
        6000,
        1,
        [],
        cmdline_bytes=b"/usr/bin/python3\0/usr/local/bin/vllm\0serve\0/models/\xff\xfe-x\0",
        comm="vllm",
        start_ticks=h.ticks(3600),
        fds={9: "/dev/dri/renderD129"},
        fdinfo={9: fh.xe_fdinfo(55, fh.BDF1, [1 * GiB])},
    )
    h.add_process(
        6001,
        1,
        [],
        cmdline_bytes=b"VLLM::Worker_TP0\xc3\0\0\0",
        comm="VLLM::Worker_TP",
        start_ticks=h.ticks(3601),
    )


def _missing_fdinfo(h: fh.FakeHost) -> None:
    h.add_process(
        6002,
        1,
        ["/usr/bin/python3", "x"],
        title="VLLM::EngineCore",
        start_ticks=h.ticks(3602),
        fds={7: "/dev/dri/renderD128", 8: "/dev/dri/renderD129"},
        fdinfo={8: fh.xe_fdinfo(56, fh.BDF1, [GiB])},
    )
    (h.root / "proc/6002/fdinfo/7").unlink()


def _empty_net(h: fh.FakeHost) -> None:
    (h.root / "proc/net/tcp").write_text("")
    (h.root / "proc/net/tcp6").unlink()
    (h.root / "proc/net/unix").write_text("garbage\n\x00\x01\nNum RefCount\n0000: zz\n")


def _pid_dir_is_a_file(h: fh.FakeHost) -> None:
    (h.root / "proc/7000").write_text("not a directory")
    (h.root / "proc/7001").mkdir()  # a process that vanished mid-scan: empty dir
    (h.root / "proc/self").symlink_to("3010")


def _garbage_fdinfo_and_environ(h: fh.FakeHost) -> None:
    (h.root / "proc/3020/fdinfo/9").write_bytes(
        b"drm-driver:\txe\ndrm-client-id:\t\xff\xff\ndrm-total-vram0:\t\x00 KiB\n"
    )
    (h.root / "proc/3010/environ").write_bytes(b"\xff\xfe=\x00XPUCTL_RUN_ID\x00=\x00" + b"A" * 5000)
    (h.root / "proc/3010/maps").write_bytes(b"garbage\n7f-7e rw-s\n\xff\xff /dev/shm/psm_dead1\n")
    (h.root / "proc/3010/status").unlink()


def _odd_comm_and_sysfs(h: fh.FakeHost) -> None:
    h.add_process(
        6003,
        2001,
        ["/usr/bin/python3", "y"],
        comm="x) R 9 9 (y",
        start_ticks=h.ticks(3603),
        fds={9: "/dev/dri/renderD129 (deleted)", 10: "/dev/dri/renderD999"},
        fdinfo={9: fh.xe_fdinfo(57, fh.BDF1, [MiB])},
    )
    os.symlink(
        "../../devices/pci0000:00/0000:00:09.0/0000:09:00.0/drm/renderD130",
        h.root / "sys/class/drm/renderD130",
    )
    (h.root / "sys/class/drm/renderD131").mkdir()
    (h.root / "sys/class/drm/renderD131/device").symlink_to("../../../nowhere")
    shutil.rmtree(h.root / "proc/3021/fd")


def _vanished_files(h: fh.FakeHost) -> None:
    for name in ("cmdline", "stat", "status"):
        (h.root / f"proc/3021/{name}").unlink()
    (h.root / "proc/stat").write_text("cpu  1 2 3\n")  # no btime
    (h.root / "sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0/vendor").write_text("garbage\n")


MALFORMED = {
    "truncated-stat": _truncated_stat,
    "bad-utf8-cmdline": _bad_utf8_cmdline,
    "missing-fdinfo": _missing_fdinfo,
    "empty-net": _empty_net,
    "pid-dir-is-a-file": _pid_dir_is_a_file,
    "garbage-fdinfo-environ-maps": _garbage_fdinfo_and_environ,
    "odd-comm-and-sysfs": _odd_comm_and_sysfs,
    "vanished-files": _vanished_files,
}


@pytest.mark.parametrize("base", ["clean", "orphan"])
@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_input_never_crashes(tmp_path, base, name):
    h = fh.clean_host(tmp_path) if base == "clean" else fh.orphan_host(tmp_path)
    if base == "clean" and name in (
        "truncated-stat",
        "garbage-fdinfo-environ-maps",
        "odd-comm-and-sysfs",
        "vanished-files",
    ):
        # these touch the vLLM pids of the orphan host; give the clean host the same tree
        fh._vllm_tp2(h, api_alive=True)
    MALFORMED[name](h)
    for args in (("doctor", "--json"), ("ps", "--json"), ("devices", "--json")):
        code, data = run_json(h.root, *args)
        assert code in (0, 1), (args, code)
        assert data["schema"].startswith("xpuctl.")
    assert run(h.root, "doctor").exit_code in (0, 1)  # the human table too


def test_odd_comm_is_parsed_from_the_last_paren(tmp_path):
    h = fh.clean_host(tmp_path)
    h.add_process(
        6004,
        2001,
        ["/usr/bin/python3", "z"],
        comm="a) Z 1 (b",
        start_ticks=h.ticks(3604),
        fds={9: "/dev/dri/renderD128"},
        fdinfo={9: fh.xe_fdinfo(58, fh.BDF0, [2 * MiB])},
    )
    _, data = doctor(h.root)
    p = by_pid(data)[6004]  # holds renderD128, so it is listed
    assert p["ppid"] == 2001 and p["state"] == "S"
    assert p["memory_bytes"] == 2 * MiB and p["devices"] == [fh.BDF0]


def test_bad_utf8_cmdline_is_still_a_string(tmp_path):
    h = fh.clean_host(tmp_path)
    _bad_utf8_cmdline(h)
    _, data = doctor(h.root)
    p = by_pid(data)[6000]  # holds renderD129
    assert p["cmdline"].startswith("/usr/bin/python3 /usr/local/bin/vllm serve /models/")
    assert p["memory_bytes"] == GiB


def test_missing_fdinfo_keeps_the_other_device(tmp_path):
    h = fh.clean_host(tmp_path)
    _missing_fdinfo(h)
    _, data = doctor(h.root)
    p = by_pid(data)[6002]
    assert fh.BDF1 in p["devices"]
    assert by_bdf(data)[fh.BDF1]["memory_used_bytes"] == GiB


def test_fdinfo_without_pdev_is_mapped_by_node(tmp_path):
    # old kernels print no drm-pdev: the device comes from the render node; client ids are per
    # device, so id 5 on each device is two clients
    h = fh.clean_host(tmp_path)
    spawn = ["/usr/bin/python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    h.add_process(
        6100,
        2001,
        spawn,
        title="VLLM::Worker",
        start_ticks=h.ticks(3600),
        fds={9: "/dev/dri/renderD129"},
        fdinfo={9: fh.xe_fdinfo(5, None, [1 * GiB])},
    )
    h.add_process(
        6101,
        2001,
        spawn,
        title="VLLM::Worker",
        start_ticks=h.ticks(3601),
        fds={9: "/dev/dri/renderD128"},
        fdinfo={9: fh.xe_fdinfo(5, None, [2 * GiB])},
    )
    _, data = doctor(h.root)
    procs = by_pid(data)
    assert procs[6100]["devices"] == [fh.BDF1] and procs[6100]["memory_bytes"] == GiB
    assert procs[6101]["devices"] == [fh.BDF0] and procs[6101]["memory_bytes"] == 2 * GiB
    assert by_bdf(data)[fh.BDF1]["memory_used_bytes"] == GiB
    assert by_bdf(data)[fh.BDF0]["memory_used_bytes"] == 2 * GiB


def test_index_follows_bdf_not_node_number(tmp_path):
    # the kernel probed 0000:04:00.0 first: it got card0/renderD128. Level Zero order is BDF order.
    h = fh.FakeHost(tmp_path)
    h.add_device("renderD128", "card0", fh.BDF1, device=fh.B60, driver="xe")
    h.add_device("renderD129", "card1", fh.BDF0, device=fh.B60, driver="xe")
    _, data = doctor(h.root)
    devs = by_bdf(data)
    assert devs[fh.BDF0]["index"] == 0 and devs[fh.BDF0]["render_node"] == "/dev/dri/renderD129"
    assert devs[fh.BDF1]["index"] == 1 and devs[fh.BDF1]["render_node"] == "/dev/dri/renderD128"
    assert doctor(h.root, "--device", "0")[0] == 0


def test_data_parallel_roles(tmp_path):
    # vllm serve --data-parallel-size 2: launcher, API servers, DP coordinator, one engine per rank
    h = fh.clean_host(tmp_path)
    spawn = [
        "/usr/bin/python3",
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=9, pipe_handle=11)",
        "--multiprocessing-fork",
    ]
    common = {"pgrp": 3300, "session": 2001, "start_ticks": h.ticks(5000)}
    h.add_process(
        3300,
        2001,
        [
            "/usr/bin/python3",
            "/usr/local/bin/vllm",
            "serve",
            "/models/m",
            "--data-parallel-size",
            "2",
            "--port",
            "8100",
        ],
        comm="vllm",
        **common,
        fds={5: "socket:[70001]"},
    )
    h.add_tcp_listen(8100, 70001)
    h.add_process(3301, 3300, spawn, title="VLLM::DPCoordinator", **common)
    h.add_process(3302, 3300, spawn, title="VLLM::APIServer_0", **common)
    h.add_process(3303, 3300, spawn, title="VLLM::APIServer_1", **common)
    for rank, (pid, node, bdf) in enumerate(
        ((3310, "renderD128", fh.BDF0), (3311, "renderD129", fh.BDF1))
    ):
        h.add_process(
            pid,
            3300,
            spawn,
            title=f"VLLM::EngineCore_DP{rank}",
            **common,
            fds={7: f"/dev/dri/{node}"},
            fdinfo={7: fh.xe_fdinfo(20 + rank, bdf, [GiB])},
        )
    code, data = doctor(h.root)
    procs = by_pid(data)
    assert procs[3300]["role"] == "api-server"
    assert procs[3301]["role"] == "dp-coordinator"
    assert procs[3302]["role"] == procs[3303]["role"] == "api-server"
    assert procs[3310]["role"] == procs[3311]["role"] == "engine-core"
    assert not any(p["orphan"] for p in procs.values())
    assert procs[3311]["devices"] == [fh.BDF1]
    assert code == 0 and data["status"] == "busy"


# --- only doctor and reset pay for the maps pass ----------------------------------------------


def test_only_doctor_reads_maps(hosts, monkeypatch):
    """The maps pass (is a stale-looking file still mapped?) reads every process's maps, and
    a busy process can hold its mmap lock for long: ps, devices and shutdown need no files."""
    from xpuctl.host import liveness

    def trap(self):
        raise AssertionError("maps read")

    root = hosts["orphan"].root
    monkeypatch.setattr(liveness.Holdings, "_mapped", trap)
    for args in (["ps", "--json"], ["devices", "--json"], ["shutdown", "--dry-run", "--all", "--json"]):
        result = runner.invoke(app, ["--root", str(root), *args])
        assert result.exit_code == 0, (args, result.stdout, result.exception)
    doctor_run = runner.invoke(app, ["--root", str(root), "doctor", "--json"])
    assert doctor_run.exit_code == 70, doctor_run.stdout  # the trap is on the path it guards
    assert "maps read" in doctor_run.stdout + (doctor_run.stderr or "")


def test_every_check_id_has_one_registered_function() -> None:
    from xpuctl.core import checks

    assert set(checks.REGISTRY) == set(checks.CHECKS) == CHECKS
    assert len(checks.CHECKS) == len(set(checks.CHECKS))
    for check_id, fn in checks.REGISTRY.items():
        assert fn.__doc__, f"check {check_id} has no docstring"
