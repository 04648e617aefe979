"""libfabric's and oneCCL's files by their real names (issue 31 §3), and the pid in a name
proved by its process's start (issue 29 §2, rule 5 of xpuctl/core/rules.py).

Names, from the sources named in docs/intel.md:
- libfabric's shm provider under oneCCL (`FI_PROVIDER=shm` or `CCL_ATL_SHM=1`) maps one
  64 MiB, 0600 region per endpoint, `/dev/shm/<pid>:<uid>:<n>` (seen with real oneCCL 2022.1
  on a CPU, issue 31); newer libfabric names it `<pid>:<uid>:<dom>:<ep>`;
- oneCCL's GPU build: `ze_fd_manager.cpp` `is_pidfd_supported` runs
  `mkstemp("/tmp/oneccl_pidfd_check_getXXXXXXXXXX")` (the last 6 X become random letters and
  digits) and unlinks it at once; `fd_manager::get_shm_filename` makes
  `/dev/shm/ccl-shm-file-<getuid()>`; `atl_ofi_helper.cpp` makes
  `/dev/shm/EPS-shm-file-<PALS_APID or "default">-<uid>`; its binary names
  `/dev/shm/ccl-rank2proc-eps-shm-*`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fakehost import clean_host
from fakehost_tree import maps_line
from proctools import skip_unless_only_ours, token_env
from typer.testing import CliRunner

from xpuctl.cli import app

runner = CliRunner()
PY = sys.executable
MiB = 1 << 20
UID = 1000


def _doctor(root) -> dict:
    res = runner.invoke(app, ["--root", str(root), "doctor", "--json"])
    return json.loads(res.stdout)


def _arts(data: dict) -> dict[str, dict]:
    return {a["path"]: a for a in data["artifacts"]}


def _finding(data: dict, check: str) -> dict | None:
    found = [f for f in data["findings"] if f["check"] == check]
    assert len(found) <= 1
    return found[0] if found else None


def _reset(root, state) -> dict:
    res = runner.invoke(app, ["--root", str(root), "reset", "--yes", "--json", "--state-dir",
                              str(state)])
    return json.loads(res.stdout)


def _audit(state) -> list[dict]:
    with open(os.path.join(state, "audit.jsonl")) as f:
        return [json.loads(line) for line in f]


# --- libfabric regions ---------------------------------------------------------------------------


def _libfabric_host(root):
    """Boot at h.at(0). A region's file was last written at h.at(3600)."""
    h = clean_host(root)
    written = h.at(3600)
    for name in ("4242:1000:0", "4242:1000:1",  # 3-field regions of a rank that is gone
                 "4243:1000:0:1",  # newer libfabric's 4 fields, rank gone
                 "5001:1000:0",  # rank alive: started before the file
                 "5002:1000:0",  # its pid reused: the live process started after the file
                 "5003:1000:0",  # rank gone, but mapped by a peer rank (5004)
                 "5005:1000:0"):  # rank gone, held open by another process (5006)
        h.add_file(f"/dev/shm/{name}", uid=UID, size=64 * MiB, mtime=written, mode=0o600)
    # look-alikes: never a libfabric region
    for name in ("123:abc:1", "1:2", "x123:0:1", "0:1000:0", "4242:1000:0:1:2", "4242:1000:"):
        h.add_file(f"/dev/shm/{name}", uid=UID, size=MiB, mtime=h.at(100), mode=0o600)
    h.add_file("/dev/shm/4244:1000:0", uid=UID, kind="dir", mtime=h.at(100))
    h.add_file("/dev/shm/4245:1000:0", uid=UID, kind="symlink", target="/etc/passwd")
    rank = ["python", "-m", "ccl_rank"]
    h.add_process(5001, 1, rank, uid=UID, start_ticks=h.ticks(3000))
    h.add_process(5002, 1, ["sleep", "1000"], uid=UID, start_ticks=h.ticks(7200))
    h.add_process(5004, 1, rank, uid=UID, start_ticks=h.ticks(3000),
                  maps=[maps_line("/dev/shm/5003:1000:0", 9001, 0x7F0000000000, 64 * MiB)])
    h.add_process(5006, 1, rank, uid=UID, start_ticks=h.ticks(3000),
                  fds={5: "/dev/shm/5005:1000:0"})
    return h


def test_libfabric_regions_are_judged_by_their_pid_and_by_who_holds_them(tmp_path):
    h = _libfabric_host(tmp_path / "h")
    data = _doctor(h.root)
    arts = _arts(data)
    stale = {p for p, a in arts.items() if a["stale"]}
    assert stale == {"/dev/shm/4242:1000:0", "/dev/shm/4242:1000:1", "/dev/shm/4243:1000:0:1",
                     "/dev/shm/5002:1000:0"}
    assert arts["/dev/shm/4242:1000:0"]["kind"] == "libfabric"
    assert "process 4242 is gone" in arts["/dev/shm/4242:1000:0"]["reason"]
    assert "reused" in arts["/dev/shm/5002:1000:0"]["reason"]
    assert arts["/dev/shm/5001:1000:0"]["reason"] == "its process 5001 is alive"
    assert arts["/dev/shm/5003:1000:0"]["open_by"] == [5004]
    assert arts["/dev/shm/5005:1000:0"]["open_by"] == [5006]
    # the look-alikes are no libfabric regions: not listed, or (a directory, a symlink) kept
    for name in ("123:abc:1", "1:2", "x123:0:1", "0:1000:0", "4242:1000:0:1:2", "4242:1000:"):
        assert f"/dev/shm/{name}" not in arts, name
    for name in ("4244:1000:0", "4245:1000:0"):
        assert arts[f"/dev/shm/{name}"]["stale"] is False
    f = _finding(data, "stale-libfabric")
    assert f is not None and f["severity"] == "warn" and f["remedy"] == "xpuctl reset"
    assert sorted(f["paths"]) == sorted(stale)
    assert f["message"].startswith("4 leaked libfabric shared-memory region(s) in /dev/shm (256")
    assert "fi_getinfo error: ret -61" in f["message"]
    assert _finding(data, "stale-shm") is None  # not counted twice


def test_reset_removes_dead_libfabric_regions_and_audits_each(tmp_path):
    h = _libfabric_host(tmp_path / "h")
    state = tmp_path / "state"
    data = _reset(h.root, state)
    gone = {"/dev/shm/4242:1000:0", "/dev/shm/4242:1000:1", "/dev/shm/4243:1000:0:1",
            "/dev/shm/5002:1000:0"}
    assert set(data["removed"]) == gone
    for p in gone:
        assert not os.path.lexists(str(h.root) + p)
    for p in ("5001:1000:0", "5003:1000:0", "5005:1000:0", "123:abc:1", "4244:1000:0"):
        assert os.path.lexists(f"{h.root}/dev/shm/{p}"), p
    deleted = {line["target"]["path"] for line in _audit(state)
               if line["action"] == "delete" and line["result"] == "removed"}
    assert deleted == gone


# A rank: makes and maps its region, named after its pid and uid, and closes the fd.
RANK = r"""
import mmap, os, sys, time
p = os.path.join(sys.argv[1], f"{os.getpid()}:{os.getuid()}:0")
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 20)
m = mmap.mmap(fd, 1 << 20)
os.close(fd)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_live_rank_keeps_its_region_and_a_dead_ranks_is_removed(standin_root, proc_token,
                                                                 tmp_path):
    """Real processes: a rank maps its own region (named after its pid); a region named after
    a rank that exited is removed by reset."""
    r = standin_root
    shm = os.path.join(r.root, "dev", "shm")
    rank = subprocess.Popen([PY, "-c", RANK, shm], env=token_env(proc_token),
                            stdout=subprocess.PIPE)
    assert rank.stdout.readline().strip() == b"ready"
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_region = os.path.join(shm, f"{dead.stdout.strip()}:{os.getuid()}:0")
    with open(dead_region, "wb") as f:
        f.truncate(1 << 20)
    live_region = f"{rank.pid}:{os.getuid()}:0"

    skip_unless_only_ours(r.root, proc_token)  # never stop an orphan this test did not start
    data = _reset(r.root, tmp_path / "state")

    assert data["removed"] == ["/dev/shm/" + os.path.basename(dead_region)]
    assert not os.path.lexists(dead_region)
    assert os.path.exists(os.path.join(shm, live_region))


# --- the pid in a oneCCL socket's name -----------------------------------------------------------


def test_a_ccl_socket_named_after_a_reused_pid_is_stale(tmp_path):
    """`/tmp/ccl-ipc-fd-sock-<pid>:…`: a live process with that pid that started after the
    socket file was made is not the rank that made it."""
    h = clean_host(tmp_path / "h")
    h.add_file("/tmp/ccl-ipc-fd-sock-6001:0-1-2", kind="socket", uid=UID, mtime=h.at(3600))
    h.add_file("/tmp/ccl-ipc-fd-sock-6002:0-1-2", kind="socket", uid=UID, mtime=h.at(3600))
    h.add_process(6001, 1, ["sleep", "1000"], uid=UID, start_ticks=h.ticks(7200))  # reused
    h.add_process(6002, 1, ["python", "rank.py"], uid=UID, start_ticks=h.ticks(3000))  # its rank
    arts = _arts(_doctor(h.root))
    assert arts["/tmp/ccl-ipc-fd-sock-6001:0-1-2"]["stale"] is True
    assert "reused" in arts["/tmp/ccl-ipc-fd-sock-6001:0-1-2"]["reason"]
    assert arts["/tmp/ccl-ipc-fd-sock-6002:0-1-2"]["stale"] is False


# --- oneCCL's GPU build --------------------------------------------------------------------------

LIBCCL = "/opt/intel/oneapi/ccl/2021.14/lib/libccl.so.1.0"


def test_gpu_build_names_are_judged_by_their_owners_oneccl_processes(tmp_path):
    h = clean_host(tmp_path / "h")
    old, new = h.at(1000), h.at(5000)
    # uid 1000 runs a oneCCL process (it maps libccl) started at 3000: files it may use are
    # those written after that; uid 1001 runs none
    h.add_process(7001, 1, ["python", "train.py"], uid=UID, start_ticks=h.ticks(3000),
                  maps=[maps_line(LIBCCL, 424242, 0x7F1000000000, perms="r-xp", dev="fe:00")])
    files = {
        "/tmp/oneccl_pidfd_check_getXXXXa1B2c3": (1001, old),  # nobody of 1001 uses oneCCL
        "/tmp/oneccl_pidfd_check_getZ9y8X7": (UID, new),  # may be 7001's probe right now
        "/dev/shm/EPS-shm-file-default-1001": (1001, old),
        "/dev/shm/EPS-shm-file-8812.0-1000": (UID, new),
        "/dev/shm/ccl-shm-file-1000": (UID, old),  # written before 7001 started: not its
        "/dev/shm/ccl-rank2proc-eps-shm-1001": (1001, old),
    }
    for path, (uid, mtime) in files.items():
        h.add_file(path, uid=uid, size=4096, mtime=mtime, mode=0o600)
    # look-alikes
    for path in ("/tmp/oneccl_pidfd_check_get", "/tmp/oneccl_pidfd_check_getab12",
                 "/tmp/oneccl_pidfd_check_getXXXXab12cd9", "/dev/shm/ccl-shm-file-abc",
                 "/dev/shm/EPS-shm-file-default", "/tmp/ccl-shm-file-1000"):
        h.add_file(path, uid=UID, size=1, mtime=old, mode=0o600)
    data = _doctor(h.root)
    arts = _arts(data)
    assert {p for p, a in arts.items() if a["stale"]} == {
        "/tmp/oneccl_pidfd_check_getXXXXa1B2c3", "/dev/shm/EPS-shm-file-default-1001",
        "/dev/shm/ccl-shm-file-1000", "/dev/shm/ccl-rank2proc-eps-shm-1001"}
    assert "oneCCL process of its owner" in arts["/dev/shm/EPS-shm-file-8812.0-1000"]["reason"]
    assert arts["/tmp/oneccl_pidfd_check_getXXXXa1B2c3"]["kind"] == "ccl-probe"
    assert arts["/dev/shm/ccl-shm-file-1000"]["kind"] == "ccl-shm"
    for path in ("/tmp/oneccl_pidfd_check_get", "/tmp/oneccl_pidfd_check_getab12",
                 "/tmp/oneccl_pidfd_check_getXXXXab12cd9", "/dev/shm/ccl-shm-file-abc",
                 "/dev/shm/EPS-shm-file-default", "/tmp/ccl-shm-file-1000"):
        assert path not in arts, path
    shm = _finding(data, "stale-shm")
    ipc = _finding(data, "stale-ipc")
    assert shm is not None and len(shm["paths"]) == 3
    assert ipc is not None and ipc["paths"] == ["/tmp/oneccl_pidfd_check_getXXXXa1B2c3"]


def test_a_gpu_build_file_held_open_is_kept_whatever_its_age(tmp_path):
    h = clean_host(tmp_path / "h")
    h.add_file("/dev/shm/ccl-rank2proc-eps-shm-x", uid=UID, size=4096, mtime=h.at(10))
    h.add_process(7101, 1, ["./bench"], uid=UID, start_ticks=h.ticks(3000),
                  fds={4: "/dev/shm/ccl-rank2proc-eps-shm-x"})
    arts = _arts(_doctor(h.root))
    assert arts["/dev/shm/ccl-rank2proc-eps-shm-x"]["stale"] is False
    assert arts["/dev/shm/ccl-rank2proc-eps-shm-x"]["open_by"] == [7101]
