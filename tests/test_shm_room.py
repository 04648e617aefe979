"""/dev/shm's room: doctor shows its size and what is free (statvfs of ROOT/dev/shm), serve
warns before launch when vLLM's shared-memory rings would not fit.

The estimate: vLLM #50606's table (the broadcast ring VLLM_MQ_MAX_CHUNK_BYTES_MB x 10 chunks,
16 MiB by default, plus one response ring of 24 MiB x 10 per worker: 640 MiB at TP=2; 520 MiB
with the variable at 4), vLLM #48879 (the start fails fast since then). A /dev/shm of a known
size is a real tmpfs mounted in a private mount namespace (`unshare -m`, root), never a
number written into a file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from fakehost import clean_host
from proctools import free_port
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.core.shmroom import needed_bytes
from xpuctl.parse.vllmargs import parallel_sizes

runner = CliRunner()
MiB = 1 << 20


def _mountns() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


needs_mountns = pytest.mark.skipif(not _mountns(), reason="needs unshare -m and tmpfs (root)")


def in_small_shm(root: str, size: str, cmd: list[str]) -> list[str]:
    """`cmd` in a mount namespace of its own where ROOT/dev/shm is a tmpfs of `size`."""
    script = 'mount -t tmpfs -o "size=$0" tmpfs "$1" && shift && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, size, f"{root}/dev/shm", *cmd]


@pytest.mark.parametrize(("tp", "pp", "env", "mib"), [
    (1, 1, {}, 0),  # one worker runs in EngineCore: no rings
    (2, 1, {}, 640),  # vLLM #50606: 160 + 2 x 240
    (2, 1, {"VLLM_MQ_MAX_CHUNK_BYTES_MB": "4"}, 520),  # #50606's "4, before this PR"
    (4, 1, {}, 160 + 4 * 240),
    (2, 2, {}, 160 + 4 * 240),  # every worker has its response ring
])
def test_the_estimate(tp, pp, env, mib):
    assert needed_bytes(tp, pp, env) == mib * MiB


@pytest.mark.parametrize(("argv", "sizes"), [
    (["vllm", "serve", "m"], (1, 1)),
    (["vllm", "serve", "m", "-tp", "2"], (2, 1)),
    (["vllm", "serve", "m", "--tensor-parallel-size=4", "--pipeline-parallel-size", "2"], (4, 2)),
    (["vllm", "serve", "m", "-tp", "two"], (1, 1)),
    (["vllm", "serve", "m", "-tp"], (1, 1)),
])
def test_parallel_sizes(argv, sizes):
    assert parallel_sizes(argv) == sizes


def test_a_trees_plain_directory_is_not_a_dev_shm(tmp_path):
    """Under --root, ROOT/dev/shm must be a filesystem of its own (a tmpfs mounted there):
    the disk a tree's plain directory sits on says nothing about a host's /dev/shm."""
    h = clean_host(tmp_path / "h")
    result = runner.invoke(app, ["--root", str(h.root), "doctor", "--json"])
    assert json.loads(result.stdout)["shm"] is None
    result = runner.invoke(app, ["--root", str(h.root), "doctor"])
    assert "/dev/shm:" not in result.stdout


def test_the_live_hosts_dev_shm():
    result = runner.invoke(app, ["doctor", "--json"])
    shm = json.loads(result.stdout)["shm"]
    st = os.statvfs("/dev/shm")
    assert shm["path"] == "/dev/shm" and shm["size_bytes"] == st.f_blocks * st.f_frsize, shm
    assert 0 <= shm["free_bytes"] <= shm["size_bytes"]


@needs_mountns
def test_doctor_on_a_64_mib_dev_shm(tmp_path):
    h = clean_host(tmp_path / "h")
    base = [sys.executable, "-m", "xpuctl", "--root", str(h.root), "doctor"]
    p = subprocess.run(in_small_shm(str(h.root), "64m", [*base, "--json"]), capture_output=True,
                       text=True, timeout=120)
    shm = json.loads(p.stdout)["shm"]
    assert shm == {"path": "/dev/shm", "size_bytes": 64 * MiB, "free_bytes": 64 * MiB}, p.stderr
    p = subprocess.run(in_small_shm(str(h.root), "64m", base), capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert "/dev/shm: 64.0 MiB, 64.0 MiB free" in p.stdout, p.stdout


@needs_mountns
def test_a_snapshot_keeps_the_room_it_saw(tmp_path):
    """doctor --from gives the capture's answer (its manifest's `statvfs`), never the
    filesystem the archive was unpacked on."""
    h = clean_host(tmp_path / "h")
    out = tmp_path / "snap.tar.gz"
    cmd = [sys.executable, "-m", "xpuctl", "--root", str(h.root), "snapshot", "-o", str(out)]
    p = subprocess.run(in_small_shm(str(h.root), "32m", cmd), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    result = runner.invoke(app, ["doctor", "--from", str(out), "--json"])
    assert json.loads(result.stdout)["shm"] == {"path": "/dev/shm", "size_bytes": 32 * MiB,
                                                "free_bytes": 32 * MiB}


@pytest.mark.slow
@needs_mountns
@pytest.mark.parametrize(("tp", "warned"), [(2, True), (1, False)])
def test_serve_warns_when_vllms_rings_do_not_fit(rig, tp, warned):
    """A 64 MiB /dev/shm and TP=2: about 640 MiB needed, one warning line before launch (the
    start goes on: it is a warning). TP=1 needs no ring: nothing said."""
    cmd = rig.serve_cmd(port=free_port(), tp=tp, opts=["--name", f"shm{tp}"])
    p = subprocess.run(in_small_shm(rig.root.root, "64m", cmd), env=rig.env(),
                       capture_output=True, text=True, timeout=180, cwd=rig.tmp)
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("xpuctl: warning: ")]
    if warned:
        assert len(lines) == 1, p.stderr
        assert "/dev/shm has 64.0 MiB free of 64.0 MiB" in lines[0], lines
        assert "about 640.0 MiB at TP=2 (vLLM #50606)" in lines[0], lines
    else:
        assert lines == [], p.stderr
    res = rig.shutdown(f"shm{tp}", "--release-timeout", "5")
    assert res.rc == 0, str(res)
    rig.assert_clean()
