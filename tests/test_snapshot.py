"""`xpuctl snapshot` and `doctor/ps/devices --from FILE`.

The contract: read back, a snapshot gives the findings doctor gave at capture time; the
JSON is the same apart from `taken_at` and `root`. Checked on every fake host of
tests/support/fakehost.py (and each malformed variant of test_fakehosts), against an independent
live doctor run at the same instant (Host.now is pinned, so file ages agree), and on live
roots with real processes, against the scan the capture itself ran. The archive holds only
what doctor reads (environ and maps reduced, no file contents from /dev/shm or /tmp), and
an unsafe archive is refused by each rule with one line and exit 2.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import tarfile
import time
from pathlib import Path

import fakehost as fh
import pytest
from proctools import start_fake_vllm, wait_for
from test_fakehosts import MALFORMED
from typer.testing import CliRunner

from xpuctl.archive import capture
from xpuctl.archive import members as archive_members
from xpuctl.archive.replay import open_snapshot
from xpuctl.cli import app
from xpuctl.core.checks import Options, evaluate
from xpuctl.diagnosis import diagnose
from xpuctl.host.seam import Host
from xpuctl.output import documents

runner = CliRunner()
NOW = 1_900_000_000.25  # a fixed "now" for the live run and the capture alike

BUILDERS = {
    "clean": fh.clean_host,
    "healthy": fh.healthy_host,
    "orphan": fh.orphan_host,
    "i915": fh.i915_host,
    "mixed": fh.mixed_vendor_host,
}


def cli(*args: str):
    result = runner.invoke(app, list(args))
    out = result.stdout + (result.stderr or "")
    assert "Traceback" not in out, out
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: uncaught {result.exception!r}") from result.exception
    return result


def without(data: dict, *keys: str) -> dict:
    return {k: v for k, v in data.items() if k not in keys}


def take(root: Path | str, out: Path, state_dir: Path | None = None) -> Path:
    args = ["--root", str(root), "snapshot", "-o", str(out),
            "--state-dir", str(state_dir or out.parent / "no-state")]
    result = cli(*args)
    assert result.exit_code == 0, result.output
    return out


def assert_same_as_live(root: Path, archive: Path, *options: str) -> None:
    """doctor (and ps, devices) live on `root` and read back from `archive` agree."""
    for cmd in (("doctor", "--json", *options), ("ps", "--json", "--all"), ("devices", "--json")):
        live = cli("--root", str(root), *cmd)
        back = cli(*cmd, "--from", str(archive))
        assert back.exit_code == live.exit_code, (cmd, back.output)
        a, b = json.loads(live.stdout), json.loads(back.stdout)
        assert without(b, "taken_at", "root") == without(a, "taken_at", "root"), cmd
        if "root" in b:
            assert b["root"] == str(archive)


@pytest.fixture
def pinned_now(monkeypatch):
    monkeypatch.setattr(Host, "now", lambda self: NOW)


# --- every fake host ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_read_back_equals_live_doctor(tmp_path, pinned_now, name):
    h = BUILDERS[name](tmp_path / "host")
    archive = take(h.root, tmp_path / "snap.tar.gz")
    assert_same_as_live(h.root, archive)
    # evaluation options apply to the read-back just as to a live run
    assert_same_as_live(h.root, archive, "--expect-idle", "--port", "8001", "--device", "0")


@pytest.mark.parametrize("base", ["clean", "orphan"])
@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_read_back_equals_live_doctor_on_malformed_hosts(tmp_path, pinned_now, base, name):
    h = fh.clean_host(tmp_path / "host") if base == "clean" else fh.orphan_host(tmp_path / "host")
    if base == "clean":
        fh._vllm_tp2(h, api_alive=True)
    MALFORMED[name](h)
    archive = take(h.root, tmp_path / "snap.tar.gz")
    assert_same_as_live(h.root, archive)


def _inline_hosts(tmp_path: Path) -> dict[str, fh.FakeHost]:
    """The hosts test_fakehosts builds inside its tests, and odd files in /tmp and /dev/shm."""
    spawn = ["/usr/bin/python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    out = {}
    h = out["no-pdev"] = fh.clean_host(tmp_path / "no-pdev")
    for pid, node, gib in ((6100, "renderD129", 1), (6101, "renderD128", 2)):
        h.add_process(pid, 2001, spawn, title="VLLM::Worker", start_ticks=h.ticks(3600),
                      fds={9: f"/dev/dri/{node}"}, fdinfo={9: fh.xe_fdinfo(5, None, [gib * fh.GiB])})
    h = out["bdf-order"] = fh.FakeHost(tmp_path / "bdf-order")
    h.add_device("renderD128", "card0", fh.BDF1, device=fh.B60, driver="xe")
    h.add_device("renderD129", "card1", fh.BDF0, device=fh.B60, driver="xe")
    h = out["data-parallel"] = fh.clean_host(tmp_path / "data-parallel")
    common = {"pgrp": 3300, "session": 2001, "start_ticks": h.ticks(5000)}
    h.add_process(3300, 2001, ["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "/m",
                               "--data-parallel-size", "2", "--port", "8100"],
                  comm="vllm", fds={5: "socket:[70001]"}, **common)
    h.add_tcp_listen(8100, 70001)
    h.add_tcp_listen(8100, 70001, addr="::", v6=True)
    h.add_process(3301, 3300, spawn, title="VLLM::DPCoordinator", **common)
    for rank, (pid, node, bdf) in enumerate(((3310, "renderD128", fh.BDF0),
                                             (3311, "renderD129", fh.BDF1))):
        h.add_process(pid, 3300, spawn, title=f"VLLM::EngineCore_DP{rank}", **common,
                      fds={7: f"/dev/dri/{node}"}, fdinfo={7: fh.xe_fdinfo(20 + rank, bdf, [fh.GiB])})
    h = out["odd-files"] = fh.orphan_host(tmp_path / "odd-files")
    at = h.at(3000)
    h.add_file("/tmp/ccl-ipc-fd-sock-3020:0", kind="socket", mtime=at)  # its process lives
    h.add_file("/tmp/ccl-ipc-fd-sock-99999:0", kind="socket", mtime=at)  # its process is gone
    h.add_file("/tmp/ccl-handle-bound", kind="socket", mtime=at)
    h.add_unix_socket("/tmp/ccl-handle-bound", 88001)
    h.add_file("/tmp/12345678-1234-4234-8234-123456789abc", kind="file", mtime=at)  # not a socket
    h.add_file("/dev/shm/psm_link", kind="symlink", target="/etc/shadow", mtime=at)
    h.add_file("/dev/shm/psm_dir", kind="dir", mtime=at)
    h.add_file("/dev/shm/psm_bob", uid=1001, size=4096, mtime=at)
    h.add_file("/tmp/ccl-module-cache-x", size=10, mtime=at)
    return out


def test_read_back_equals_live_doctor_on_more_hosts(tmp_path, pinned_now):
    for name, h in _inline_hosts(tmp_path).items():
        archive = take(h.root, tmp_path / f"{name}.tar.gz")
        assert_same_as_live(h.root, archive)
        assert_same_as_live(h.root, archive, "--port", "8100", "--device", "1", "--strict")


def test_ages_are_measured_against_capture_time(tmp_path, monkeypatch):
    h = fh.orphan_host(tmp_path / "host")
    monkeypatch.setattr(Host, "now", lambda self: NOW)
    archive = take(h.root, tmp_path / "snap.tar.gz")
    live = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    monkeypatch.setattr(Host, "now", lambda self: NOW + 86400.0)  # read back a day later
    back = json.loads(cli("doctor", "--json", "--from", str(archive)).stdout)
    assert back["artifacts"] and back["artifacts"] == live["artifacts"]
    assert back["taken_at"] == NOW


def test_caller_environment_is_judged_as_captured(tmp_path, pinned_now):
    h = fh.healthy_host(tmp_path / "host")
    out = tmp_path / "snap.tar.gz"
    env = {"ZE_AFFINITY_MASK": "7", "HOME": "/home/x", "AWS_SECRET_ACCESS_KEY": "hunter2"}
    result = runner.invoke(app, ["--root", str(h.root), "snapshot", "-o", str(out),
                                 "--state-dir", str(tmp_path / "s")], env=env)
    assert result.exit_code == 0, result.output
    back = cli("doctor", "--json", "--from", str(out))
    data = json.loads(back.stdout)
    assert [f["check"] for f in data["findings"] if f["severity"] == "fail"] == ["env"]
    assert back.exit_code == 1
    with tarfile.open(out) as tf:
        blob = b"".join(tf.extractfile(m).read() for m in tf if m.isreg())
    assert b"hunter2" not in blob and b"/home/x" not in blob


# --- what the archive holds ------------------------------------------------------------


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tf:
        out = {}
        for m in tf:
            assert m.isreg(), m.name  # files only: no links, devices or sockets
            out[m.name.split("/", 1)[1]] = tf.extractfile(m).read()
        return out


def test_archive_holds_only_what_doctor_reads(tmp_path, pinned_now):
    h = fh.orphan_host(tmp_path / "host")
    secret = b"TOPSECRET-shm-contents"
    h.path(fh.PSM_TP0).write_bytes(secret)  # a file doctor judges: listed, never copied
    pid = 9100
    h.add_process(pid, 1, ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server"],
                  start_ticks=h.ticks(500),
                  environ={"XPUCTL_RUN_ID": "r-1", "ZE_AFFINITY_MASK": "0", "SPT_NOENV": "1",
                           "HF_TOKEN": "hf_secret", "PATH": "/secret/bin", "VLLM_PORT": "8000",
                           "ZEBRA": "no"},
                  maps=[fh.maps_line("/usr/lib/libc.so.6", 11, 0x1000),
                        fh.maps_line(fh.PSM_TP1, 12, 0x2000),
                        fh.maps_line("/tmp/vllm_dist_x", 13, 0x3000)])
    h.add_file("/tmp/somebodys-file", size=5)
    archive = take(h.root, tmp_path / "snap.tar.gz")
    files = members(archive)
    blob = b"".join(files.values())
    assert secret not in blob and b"hf_secret" not in blob and b"/secret/bin" not in blob
    assert files[f"root/proc/{pid}/environ"] == (
        b"XPUCTL_RUN_ID=r-1\0ZE_AFFINITY_MASK=0\0SPT_NOENV=1\0HF_TOKEN=<redacted>\0VLLM_PORT=8000\0"
    )
    maps = files.get(f"root/proc/{pid}/maps", b"").decode()
    if maps:  # read only when a candidate file is in no fd; then only /dev/shm and /tmp lines
        assert "libc" not in maps and fh.PSM_TP1 in maps
    assert not any(name.startswith(("root/dev/", "root/tmp/")) for name in files)
    assert set(files["root/proc/stat"].splitlines()) == {f"btime {h.boot_time}".encode()}
    index = json.loads(files["index.json"])
    assert fh.PSM_TP0.rsplit("/", 1)[1] in index["lists"]["/dev/shm"]
    assert "somebodys-file" in index["lists"]["/tmp"]  # the listing is complete
    _, uid, size, *_ = index["lstat"]["/tmp/somebodys-file"]
    assert (uid, size) == (1000, 5)
    manifest = json.loads(files["manifest.json"])
    assert manifest["schema"] == "xpuctl.snapshot/1"
    assert manifest["time"] == NOW and manifest["host"] == "xpu-node-07"
    assert {"kernel", "xpuctl_version", "uid", "unreadable"} <= set(manifest)


def test_unreadable_files_are_listed_with_the_reason(tmp_path, pinned_now):
    h = fh.orphan_host(tmp_path / "host")
    fd_dir = h.root / "proc/3010/fd"
    for link in fd_dir.iterdir():
        link.unlink()
    fd_dir.rmdir()
    fd_dir.write_text("")  # unreadable as a directory (root reads through any mode)
    archive = take(h.root, tmp_path / "snap.tar.gz")
    assert_same_as_live(h.root, archive)
    data = json.loads(cli("doctor", "--json", "--from", str(archive)).stdout)
    assert [(u["pid"], u["file"], u["blocked"], u["fds_known"]) for u in data["unreadable_processes"]] == [
        (3010, "/proc/3010/fd", False, False)]
    manifest = json.loads(members(archive)["manifest.json"])
    assert {"op": "fds", "path": "/proc/3010/fd", "reason": "Not a directory"} in manifest[
        "unreadable"
    ]


def test_run_records_and_log_tails_are_kept(tmp_path, pinned_now):
    from xpuctl.state import runs

    h = fh.healthy_host(tmp_path / "host")
    sdir = runs.ensure_state_dir(str(tmp_path / "state"))
    log = Path(sdir) / "logs" / "vllm-8000.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    rec = runs.RunRecord("vllm-8000", "r-1", 3000, 1, 3000, ["vllm", "serve"], [], 8000, "h",
                         35, 30.0, 5.0, str(log))
    runs.write_record(sdir, rec)
    files = members(take(h.root, tmp_path / "snap.tar.gz", Path(sdir)))
    assert json.loads(files["state/runs/vllm-8000.json"])["run_id"] == "r-1"
    tail = files["state/logs/vllm-8000.log"].decode().splitlines()
    assert tail == [f"line {i}" for i in range(800, 1000)]


def test_snapshot_to_stdout_and_default_name(tmp_path, pinned_now, monkeypatch):
    h = fh.clean_host(tmp_path / "host")
    result = cli("--root", str(h.root), "snapshot", "-o", "-", "--state-dir", str(tmp_path / "s"))
    assert result.exit_code == 0
    with tarfile.open(fileobj=io.BytesIO(result.stdout_bytes)) as tf:
        assert any(n.endswith("/manifest.json") for n in tf.getnames())
    monkeypatch.chdir(tmp_path)
    assert cli("--root", str(h.root), "snapshot", "--state-dir", str(tmp_path / "s")).exit_code == 0
    made = [p for p in os.listdir(tmp_path) if p.endswith(".tar.gz")]
    assert len(made) == 1 and made[0].startswith("xpuctl-snapshot-xpu-node-07-")
    assert os.stat(tmp_path / made[0]).st_mode & 0o077 == 0  # cmdlines inside: owner only


# --- usage errors ----------------------------------------------------------------------


def test_from_usage_errors(tmp_path, pinned_now):
    h = fh.clean_host(tmp_path / "host")
    archive = take(h.root, tmp_path / "snap.tar.gz")
    cases = [
        ("doctor", "--from", str(archive), "--wait-clean", "5"),
        ("doctor", "--from", str(tmp_path / "missing.tar.gz")),
        ("doctor", "--from", str(tmp_path)),
        ("--root", str(h.root), "snapshot", "-o", str(tmp_path / "no/such/dir/x.tar.gz")),
    ]
    for args in cases:
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("xpuctl: error:"), args


def test_from_replaces_the_root(tmp_path, pinned_now):
    h = fh.orphan_host(tmp_path / "host")
    archive = take(h.root, tmp_path / "snap.tar.gz")
    other = fh.clean_host(tmp_path / "other")
    want = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    got = runner.invoke(app, ["doctor", "--json", "--from", str(archive)],
                        env={"XPUCTL_ROOT": str(other.root)})
    assert without(json.loads(got.stdout), "root", "taken_at") == without(want, "root", "taken_at")
    assert got.stderr.startswith("xpuctl: snapshot of xpu-node-07 taken ")


def _tar(path: Path, entries: list[tuple[tarfile.TarInfo, bytes | None]], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tf:
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    info.linkname = link
    return info


def _valid_entries(tmp_path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    h = fh.clean_host(tmp_path / "vhost")
    archive = take(h.root, tmp_path / "valid.tar.gz")
    out = []
    with tarfile.open(archive) as tf:
        for m in tf:
            data = tf.extractfile(m).read()
            m.name = "snap/" + m.name.split("/", 1)[1]  # one top directory for all cases
            m.pax_headers = {}
            out.append((m, data))
    return out


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readinto(self, b) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


UNSAFE = {  # id: (what the one line names, members put first)
    "absolute": ("absolute path", [(_info("/etc/evil"), b"x")]),
    "dotdot": ("'..' in the path", [(_info("snap/root/../../evil"), b"x")]),
    "symlink-absolute": ("member 'snap/root/l': symbolic link",
                         [(_info("snap/root/l", tarfile.SYMTYPE, link="/etc"), None)]),
    "symlink-up": ("member 'snap/root/l': symbolic link",
                   [(_info("snap/root/l", tarfile.SYMTYPE, link="../../.."), None)]),
    "symlink-inside": ("member 'snap/root/l': symbolic link",
                       [(_info("snap/root/l", tarfile.SYMTYPE, link="proc"), None)]),
    "hardlink": ("member 'snap/root/h': hard link",
                 [(_info("snap/root/h", tarfile.LNKTYPE, link="/etc/passwd"), None)]),
    "chardev": ("device file", [(_info("snap/root/dev/dri/renderD128", tarfile.CHRTYPE), None)]),
    "blockdev": ("device file", [(_info("snap/root/dev/sda", tarfile.BLKTYPE), None)]),
    "fifo": ("FIFO", [(_info("snap/root/proc/1/stat", tarfile.FIFOTYPE), None)]),
    "two-tops": ("outside the snapshot's directory",
                 [(_info("snap/a"), b"x"), (_info("other/b"), b"x")]),
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_archive_is_refused(tmp_path, case):
    why, first = UNSAFE[case]
    archive = _tar(tmp_path / "bad.tar.gz", first + _valid_entries(tmp_path))
    result = cli("doctor", "--from", str(archive))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and why in result.stderr, result.stderr
    assert "refusing unsafe snapshot" in result.stderr
    assert not os.path.exists("/etc/evil") and not (tmp_path / "evil").exists()


def test_member_over_64_mib_is_refused(tmp_path):
    path = tmp_path / "big.tar.gz"
    with tarfile.open(path, "w:gz", compresslevel=1) as tf:
        size = archive_members.MAX_MEMBER_BYTES + 1
        tf.addfile(_info("snap/root/proc/stat", size=size), _Zeros(size))
    result = cli("doctor", "--from", str(path))
    assert result.exit_code == 2 and "over 64 MiB" in result.stderr, result.output


def test_too_many_members_is_refused(tmp_path):
    path = tmp_path / "many.tar.gz"
    header = b"".join(_info(f"snap/d{i}", tarfile.DIRTYPE).tobuf()
                      for i in range(archive_members.MAX_MEMBERS + 1))
    import gzip

    path.write_bytes(gzip.compress(header + bytes(1024), compresslevel=1))
    result = cli("doctor", "--from", str(path))
    assert result.exit_code == 2 and "more than 200000 members" in result.stderr, result.output


def test_check_member_rules_one_by_one():
    ok = _info("snap/root/proc/1/stat", size=10)
    assert archive_members.check_member(ok) is None
    assert archive_members.check_member(_info("snap/root/proc", tarfile.DIRTYPE)) is None
    symlink = _info("snap/root/sys/l", tarfile.SYMTYPE, link="../proc")
    assert "symbolic link" in archive_members.check_member(symlink)
    hardlink = _info("snap/root/h", tarfile.LNKTYPE, link="snap/root/x")
    assert "hard link" in archive_members.check_member(hardlink)
    assert archive_members.check_member(_info("/abs")) == "absolute path"
    assert archive_members.check_member(_info("a/../b")) == "'..' in the path"
    assert archive_members.check_member(_info("a/./b")) == "'.' or empty component in the path"
    assert archive_members.check_member(_info("a//b")) == "'.' or empty component in the path"
    assert archive_members.check_member(_info("a/\x1b[2Jb")) == "control character in the path"
    assert archive_members.check_member(_info("a/c", tarfile.CHRTYPE)) == "device file"
    assert archive_members.check_member(_info("a/b", tarfile.BLKTYPE)) == "device file"
    assert archive_members.check_member(_info("a/f", tarfile.FIFOTYPE)) == "FIFO"
    assert archive_members.check_member(_info("a/f", b"Z")) == "special file"
    assert archive_members.check_member(_info("a/s", tarfile.GNUTYPE_SPARSE)) == "special file"
    long_name = _info("a/" + "n" * 256)
    assert archive_members.check_member(long_name) == "name component over 255 bytes (256)"
    assert archive_members.check_member(_info("a/" + "n" * 255)) is None
    assert "path over 1024 bytes" in archive_members.check_member(_info("/".join(["d" * 200] * 6)))
    assert "64 MiB" in archive_members.check_member(_info("a/big", size=(64 << 20) + 1))
    assert archive_members.check_member(_info("a/fine", size=64 << 20)) is None


DAMAGES = ["not-gzip", "truncated", "no-manifest", "bad-schema", "bad-index", "bad-time",
           "dangling-hardlink"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_archive_is_a_usage_error(tmp_path, damage):
    entries = _valid_entries(tmp_path)
    path = tmp_path / "damaged.tar.gz"
    if damage == "not-gzip":
        path.write_bytes(b"this is not an archive\n")
    elif damage == "truncated":
        _tar(path, entries)
        path.write_bytes(path.read_bytes()[:300])
    else:
        kept = []
        for info, data in entries:
            if damage == "no-manifest" and info.name.endswith("/manifest.json"):
                continue
            if damage == "bad-schema" and info.name.endswith("/manifest.json"):
                data = json.dumps({**json.loads(data), "schema": "other/9"}).encode()
            if damage == "bad-index" and info.name.endswith("/index.json"):
                data = json.dumps({"lstat": {"/tmp/x": ["a"]}}).encode()
            if damage == "bad-time" and info.name.endswith("/manifest.json"):
                data = data.replace(b'"time": ', b'"time": Infinity, "x": ', 1)
            info.size = len(data)
            kept.append((info, data))
        if damage == "dangling-hardlink":
            kept.append((_info("snap/root/h", tarfile.LNKTYPE, link="snap/root/nothing"), None))
        _tar(path, kept)
    result = cli("doctor", "--from", str(path))
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr


def test_index_paths_never_leave_the_tree(tmp_path):
    """A forged index can name `..` paths; the archive host refuses to read them."""
    entries = []
    for info, data in _valid_entries(tmp_path):
        if info.name.endswith("/index.json"):
            index = json.loads(data)
            index["resolved"]["/sys/class/drm/renderD128/device"] = "/../../../../etc"
            index["lists"]["/sys/class/drm"] = ["renderD128"]
            data = json.dumps(index).encode()
            info.size = len(data)
        entries.append((info, data))
    archive = _tar(tmp_path / "forged.tar.gz", entries)
    with open_snapshot(str(archive)) as opened:
        with pytest.raises(OSError):
            opened.host.read_bytes("/../../../../etc/passwd")
        assert opened.host.exists("/../etc") is False
    result = cli("devices", "--json", "--from", str(archive))
    assert result.exit_code == 0 and json.loads(result.stdout)["devices"] == []


def test_temporary_files_are_removed(tmp_path, pinned_now, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t"))
    (tmp_path / "t").mkdir()
    h = fh.orphan_host(tmp_path / "host")
    archive = take(h.root, tmp_path / "snap.tar.gz")
    assert cli("doctor", "--json", "--from", str(archive)).exit_code == 1
    bad = _tar(tmp_path / "bad.tar.gz", UNSAFE["fifo"][1])
    assert cli("doctor", "--from", str(bad)).exit_code == 2
    assert os.listdir(tmp_path / "t") == []


# --- live roots with real processes --------------------------------------------------------


def _same_as_capture(taken: capture.Taken, archive: str, opts: Options) -> None:
    """The capture's own scan (doctor's, at capture time) and the read-back agree."""
    live = documents.doctor_dict(evaluate(taken.report.scan, opts))
    with open_snapshot(archive) as opened:
        back = documents.doctor_dict(diagnose(opened.host, list(opts.devices), opts.port,
                                           opts.expect_idle, dict(opened.manifest.caller_env)))
    assert without(back, "taken_at", "root") == without(live, "taken_at", "root")
    assert back["taken_at"] == live["taken_at"]


@pytest.mark.slow
def test_read_back_equals_capture_with_a_real_vllm_tree(standin_root, proc_token, tmp_path):
    root = standin_root
    fv = start_fake_vllm(proc_token, root.root, tp=2, workdir=tmp_path)
    assert fv.wait_ready(30), fv.log()
    with open(os.path.join(root.root, "dev/shm/psm_deadbeef"), "wb") as f:
        f.write(b"x" * 100)  # stale
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(os.path.join(root.root, "tmp", "ccl-handle-live"))  # a socket bound: in use
    try:
        for step in ("serving", "orphaned"):
            archive = str(tmp_path / f"{step}.tar.gz")
            env = {"ZE_AFFINITY_MASK": "0,1", "PATH": os.environ.get("PATH", "")}
            taken = capture.take(Host(root.root), archive, env, str(tmp_path / "no-state"))
            roles = {p.role for p in taken.report.scan.processes if not p.orphan}
            if step == "serving":
                assert {"api-server", "engine-core", "worker"} <= roles, taken.report.scan.processes
                assert any(pt.port == fv.port and pt.pid for pt in taken.report.scan.ports)
            else:
                assert any(p.orphan for p in taken.report.scan.processes), taken.report.scan.processes
            assert any(p.devices for p in taken.report.scan.processes)
            _same_as_capture(taken, archive, Options())  # the capture scans for port 8000
            _same_as_capture(taken, archive, Options(expect_idle=True))
            if step == "serving":
                os.kill(fv.proc.pid, signal.SIGKILL)  # the API server dies: orphans stay
                fv.proc.wait()
                assert wait_for(lambda: fv.proc.poll() is not None, 10)
                time.sleep(0.2)
        report = evaluate(taken.report.scan, Options(port=fv.port))
        assert any(f.check == "orphans" for f in report.findings)
    finally:
        lsock.close()


def test_read_back_equals_capture_on_this_host(tmp_path):
    """The live root "/": netlink sockets, DRM fds checked by stat, comm trusted."""
    host = Host("/")
    assert host.live
    archive = str(tmp_path / "live.tar.gz")
    taken = capture.take(host, archive, {}, str(tmp_path / "no-state"))
    with open_snapshot(archive) as opened:
        assert opened.manifest.comm_trusted and opened.manifest.rdev_checked
        assert opened.host.comm_trusted and not opened.host.proc_is_live
    _same_as_capture(taken, archive, Options())


# --- what each file is reduced to (pure functions) -----------------------------------------


def test_redact_environ_keeps_only_the_listed_variables_in_order():
    from xpuctl.parse import redact
    from xpuctl.parse.procfs import parse_environ

    raw = (b"PATH=/bin\0ZE_AFFINITY_MASK=0,1\0HF_TOKEN=x\0XPUCTL_RUN_ID=r\0SPT_NOENV=1\0"
           b"SPT_NOENVX=2\0ZE_AFFINITY_MASK=9\0\xff\xfe=bad\0=novalue\0CCL_LOG_LEVEL=info\0")
    kept = redact.environ(raw)
    assert kept == (b"ZE_AFFINITY_MASK=0,1\0HF_TOKEN=<redacted>\0XPUCTL_RUN_ID=r\0SPT_NOENV=1\0"
                    b"ZE_AFFINITY_MASK=9\0CCL_LOG_LEVEL=info\0")
    full, cut = parse_environ(raw), parse_environ(kept)
    assert cut == {k: "<redacted>" if redact.secret_name(k) else v for k, v in full.items()
                   if redact.keeps_var(k) or redact.secret_name(k)}
    assert redact.environ(b"\0" * 64) == b""


def test_redact_maps_keeps_shm_and_tmp_lines_with_host_paths():
    from xpuctl.host.seam import Host
    from xpuctl.parse import redact
    from xpuctl.parse.procfs import parse_maps_paths

    host = Host("/tmp/xr1")
    lines = [fh.maps_line("/usr/lib/libc.so.6", 1, 0x1000),
             fh.maps_line("/tmp/xr1/dev/shm/psm_a b", 2, 0x2000),
             fh.maps_line("/dev/shm/psm_gone (deleted)", 3, 0x3000),
             fh.maps_line("/tmp/vllm_dist_x", 4, 0x4000),
             "7f00-7f01 rw-p 00000000 00:00 0 [heap]"]
    out = redact.maps("\n".join(lines).encode() + b"\n", host.to_host).decode()
    assert parse_maps_paths(out) == {"/dev/shm/psm_a b", "/tmp/vllm_dist_x"}
    assert "libc" not in out and "heap" not in out


def test_tcp_and_unix_text_round_trip():
    from xpuctl.parse.net import TcpSocket, format_tcp, format_unix, parse_tcp, parse_unix_paths

    v4 = [TcpSocket("127.0.0.1", 8000, "0A", 123, 1000), TcpSocket("0.0.0.0", 22, "0A", 5, None)]
    v6 = [TcpSocket("::1", 8000, "0A", 124, 0), TcpSocket("::ffff:a00:1", 81, "0A", 9, 3),
          TcpSocket("fe80::1:2:3:4", 1, "0A", 1, 1)]
    assert parse_tcp(format_tcp(v4)) == v4 and parse_tcp(format_tcp(v6)) == v6
    paths = {"/tmp/a b": 5, "/dev/shm/x": 7}
    assert parse_unix_paths(format_unix(paths)) == paths


class _RdevHost(Host):
    """A fake tree read the way a live host is: DRM fds checked by stat. Here an fd on
    renderD128 is really minor 129 (a container's renamed node), and fd 8 is not a char
    device at all; the scan must follow the numbers, and so must the read-back."""

    @property
    def rdev_checked(self) -> bool:
        return True

    def stat_rdev(self, hostpath: str) -> tuple[int, int] | None:
        if hostpath.endswith("/fd/8"):
            return None
        return (226, 129) if hostpath.startswith("/proc/7000/") else (226, 128)


def test_read_back_replays_char_device_numbers(tmp_path):
    h = fh.clean_host(tmp_path / "host")
    h.add_process(7000, 1, ["/usr/bin/python3", "x"], title="VLLM::EngineCore",
                  start_ticks=h.ticks(3000),
                  fds={7: "/dev/dri/renderD128", 8: "/dev/dri/renderD128"},
                  fdinfo={7: fh.xe_fdinfo(77, None, [fh.GiB]), 8: fh.xe_fdinfo(78, None, [fh.GiB])})
    archive = str(tmp_path / "snap.tar.gz")
    taken = capture.take(_RdevHost(h.root), archive, {}, str(tmp_path / "no-state"))
    engine = taken.report.scan.process(7000)
    assert engine.devices == (fh.BDF1,) and engine.memory_bytes == fh.GiB  # by minor, fd 8 dropped
    with open_snapshot(archive) as opened:
        assert opened.host.rdev_checked and not opened.host.live
    _same_as_capture(taken, archive, Options())


# --- snapshot --deep: the probes' JSON is kept and replayed ---------------------------------


def test_deep_snapshot_replays_the_probes(tmp_path):
    from test_deep import base_scenario, deep_host, standin_env

    from xpuctl.diagnosis import DeepOptions

    deep_host(tmp_path / "root")
    env = standin_env(tmp_path, base_scenario())
    archive = str(tmp_path / "deep.tar.gz")
    opts = DeepOptions(timeout=60, state_dir=env["XPUCTL_STATE_DIR"])
    taken = capture.take(Host(str(tmp_path / "root")), archive, env, str(tmp_path / "no-state"), opts)
    live = documents.doctor_dict(taken.report)
    assert any(f["check"] == "unattributed-memory" for f in live["findings"])  # probes ran
    files = members(Path(archive))
    doc = json.loads(files["probes.json"])
    assert doc["schema"] == "xpuctl.probes/1" and json.loads(files["manifest.json"])["deep"]
    back = cli("doctor", "--json", "--from", archive)
    assert back.exit_code == 1
    assert without(json.loads(back.stdout), "root", "taken_at") == without(live, "root", "taken_at")
    # the threshold is a judgement, applied at read-back as at capture
    higher = json.loads(cli("doctor", "--json", "--from", archive,
                            "--unattributed-threshold", "7GiB").stdout)
    assert not any(f["check"] == "unattributed-memory" for f in higher["findings"])
    dev = json.loads(cli("devices", "--json", "--from", archive).stdout)
    assert [p["name"] for p in dev["probes"]] == [p["name"] for p in live["probes"]]
    assert cli("doctor", "--deep", "--from", archive).exit_code == 2
    out = tmp_path / "cli-deep.tar.gz"
    result = runner.invoke(app, ["--root", str(tmp_path / "root"), "snapshot", "--deep",
                                 "--probe-timeout", "60", "-o", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(members(out)["probes.json"])["probes"]


def test_plain_snapshot_has_no_probes(tmp_path, pinned_now):
    h = fh.healthy_host(tmp_path / "host")
    files = members(take(h.root, tmp_path / "snap.tar.gz"))
    assert "probes.json" not in files and json.loads(files["manifest.json"])["deep"] is False
