"""oneCCL as doctor sees it: its KVS listeners in the port table, by proof, and a rank whose
peer ranks are gone.

Sources: oneCCL internal_kvs.h (`default_start_port` 4096) and internal_kvs.cpp (a bind loop
that takes the next free port), `CCL_KVS_PORT`; xpuctl issue 31 (real oneCCL: the KVS on TCP
4096 and up; the survivor of a killed peer spinning at 50 to 200 % CPU for ever); vLLM's titles
`VLLM::Worker_TP<r>` once its groups exist, and only for a group of two or more
(vllm/utils/system_utils.py set_process_title, docs/vllm.md). A maps line as
fs/proc/task_mmu.c show_map_vma prints it (fakehost_tree.maps_line).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest
from fakehost import BDF0, healthy_host, maps_line, orphan_host
from proctools import token_env, wait_for
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.parse.procfs import maps_library

runner = CliRunner()
LIBCCL = "/opt/intel/oneapi/ccl/2021.15/lib/libccl.so.1.0"
SPAWN = ["/usr/bin/python3", "-c",
         "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=33, pipe_handle=35)",
         "--multiprocessing-fork"]


def doctor(root, *extra):
    result = runner.invoke(app, ["--root", str(root), "doctor", "--json", *extra])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout)


def lone(data, pid):
    return [f for f in data["findings"] if f["check"] == "stuck-processes" and pid in f["pids"]
            and "peer ranks are gone" in f["message"]]


# -- ranks whose peers are gone ----------------------------------------------------------------


def test_a_healthy_tp2_server_has_no_lone_rank(tmp_path):
    h = healthy_host(tmp_path / "h")
    _code, data = doctor(h.root)
    assert lone(data, h.tp0) == [] and lone(data, h.tp1) == []


@pytest.mark.parametrize("gone", ["removed", "zombie"])
def test_the_survivor_of_a_killed_peer_is_flagged(tmp_path, gone):
    """TP1 killed (gone, or a zombie nobody reaped) while EngineCore and the API server live:
    TP0 waits in its collective for ever. A warning (vLLM's engine may still notice)."""
    h = healthy_host(tmp_path / "h")
    if gone == "removed":
        h.remove_process(h.tp1)
    else:
        h.remove_process(h.tp1)
        h.add_process(h.tp1, h.engine, [], state="Z", comm="VLLM::Worker_TP",
                      start_ticks=h.ticks(3011))
    _code, data = doctor(h.root)
    (f,) = lone(data, h.tp0)
    assert f["severity"] == "warn" and f["device"] == BDF0, f
    assert "oneCCL rank (TP0)" in f["message"] and "for ever" in f["message"]
    assert f["remedy"] == f"xpuctl shutdown --pid {h.api}"


def test_an_orphaned_survivor_fails(tmp_path):
    """The API server was SIGKILLed and TP1 too: TP0 is an orphan and a lone rank."""
    h = orphan_host(tmp_path / "h")
    h.remove_process(h.tp1)
    code, data = doctor(h.root)
    (f,) = lone(data, h.tp0)
    assert f["severity"] == "fail" and code == 1


def test_a_peer_not_titled_yet_is_a_peer(tmp_path):
    """At start-up a worker is `VLLM::Worker` until its groups exist: still TP0's peer."""
    h = healthy_host(tmp_path / "h")
    spawn = SPAWN
    h.remove_process(h.tp1)
    h.add_process(h.tp1, h.engine, spawn, title="VLLM::Worker", uid=1000, pgrp=h.api,
                  session=2001, start_ticks=h.ticks(3011))
    _code, data = doctor(h.root)
    assert lone(data, h.tp0) == []


# -- KVS listeners --------------------------------------------------------------------------------


def test_maps_library():
    line = maps_line(LIBCCL, 4711, 0x7F0000000000, perms="r-xp", dev="08:02")
    assert maps_library(line, "libccl")
    assert maps_library(line + " (deleted)", "libccl")
    assert not maps_library(maps_line("/opt/lib/libccl_extra.so", 1, 0x1000), "libccl")
    assert not maps_library(maps_line("/tmp/libccl.so.txt/x", 1, 0x1000), "libccl")
    assert not maps_library("", "libccl")


def _listener(h, pid: int, port: int, inode: int, ccl: bool, **kw) -> None:
    maps = [maps_line(LIBCCL, 4711, 0x7F0000000000, perms="r-xp", dev="08:02")] if ccl else []
    h.add_process(pid, 1, kw.pop("argv", ["/usr/bin/python3", "rank.py"]),
                  fds={3: f"socket:[{inode}]"}, maps=maps, start_ticks=h.ticks(4000), **kw)
    h.add_tcp_listen(port, inode)


def test_the_port_table_names_kvs_listeners_with_their_pid(tmp_path):
    """A rank mapping libccl on 4096 and 4097 (KVS and its control socket), one on its
    CCL_KVS_PORT: named oneCCL KVS. A web server on 4098 maps no libccl: not named, not
    listed. A libccl process's listener on an ephemeral port: not the KVS."""
    h = healthy_host(tmp_path / "h")
    _listener(h, 6001, 4096, 90001, True)
    h.add_tcp_listen(4097, 90002)
    h._symlink("proc/6001/fd/4", "socket:[90002]")
    _listener(h, 6002, 4098, 90003, False, argv=["/usr/sbin/nginx"])
    _listener(h, 6003, 45000, 90004, True)
    _code, data = doctor(h.root)
    ports = {(p["port"], p["pid"]): p for p in data["ports"]}
    assert ports[(4096, 6001)]["kind"] == "oneccl-kvs"
    assert ports[(4097, 6001)]["kind"] == "oneccl-kvs"
    assert (4098, 6002) not in ports and (45000, 6003) not in ports
    assert ports[(8000, h.api)]["kind"] is None  # the serving port is vLLM's, not oneCCL's
    result = runner.invoke(app, ["--root", str(h.root), "doctor"], env={"COLUMNS": "200"})
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["4096", "0.0.0.0", "6001", "oneCCL", "KVS"] in rows, result.stdout


def test_a_workers_kvs_on_its_own_ccl_kvs_port(tmp_path):
    """CCL_KVS_PORT outside the default range, in a vLLM worker's environment."""
    h = healthy_host(tmp_path / "h")
    spawn = SPAWN
    h.remove_process(h.tp1)
    h.add_process(h.tp1, h.engine, spawn, title="VLLM::Worker_TP1", uid=1000, pgrp=h.api,
                  session=2001, start_ticks=h.ticks(3011), environ={"CCL_KVS_PORT": "29500"},
                  fds={5: "socket:[90010]"},
                  maps=[maps_line(LIBCCL, 4711, 0x7F0000000000, perms="r-xp", dev="08:02")])
    h.add_tcp_listen(29500, 90010)
    _code, data = doctor(h.root)
    (p,) = [p for p in data["ports"] if p["port"] == 29500]
    assert p["pid"] == h.tp1 and p["kind"] == "oneccl-kvs" and p["role"] == "worker"


RANK = textwrap.dedent("""
    import mmap, os, socket, sys
    lib = sys.argv[1]
    fd = os.open(lib, os.O_RDONLY)
    m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)  # mapped, as a loaded library is
    s = socket.socket()
    port = 4096
    while True:  # oneCCL's KVS: the next free port from 4096 (internal_kvs.cpp)
        try:
            s.bind(("127.0.0.1", port))
            break
        except OSError:
            port += 1
    s.listen(1)
    print(port, flush=True)
    sys.stdin.read()
""")


def test_a_real_process_mapping_libccl_on_a_kvs_port(tmp_path, standin_root, proc_token):
    """A real process maps a file named libccl.so.1 and listens from 4096 up, as oneCCL's KVS
    does: doctor (sock_diag on the live /proc) names the listener with its pid."""
    lib = tmp_path / "libccl.so.1"
    lib.write_bytes(b"\0" * 4096)
    p = subprocess.Popen([sys.executable, "-c", RANK, str(lib)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=token_env(proc_token))
    try:
        port = int(p.stdout.readline())
        assert 4096 <= port <= 8191
        assert wait_for(lambda: _listening(port), 10)
        result = runner.invoke(app, ["--root", standin_root.root, "doctor", "--json"])
        ports = [x for x in json.loads(result.stdout)["ports"] if x["port"] == port]
        assert [(x["pid"], x["kind"]) for x in ports] == [(p.pid, "oneccl-kvs")], ports
    finally:
        p.kill()
        p.wait(10)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_snapshot_keeps_the_proof_of_a_kvs_listener(tmp_path):
    """`doctor --from` names oneCCL's KVS listeners as the live doctor did: the snapshot keeps
    the maps line of libccl (parse/redact.PROOF_LIBRARIES), not only /dev/shm and /tmp lines."""
    import test_snapshot

    h = healthy_host(tmp_path / "h")
    _listener(h, 6001, 4096, 90001, True)
    archive = test_snapshot.take(h.root, tmp_path / "snap.tar.gz")
    live = test_snapshot.cli("--root", str(h.root), "doctor", "--json")
    back = test_snapshot.cli("doctor", "--json", "--from", str(archive))
    assert json.loads(back.stdout)["ports"] == json.loads(live.stdout)["ports"]
    ports = {(p["port"], p["pid"]): p for p in json.loads(back.stdout)["ports"]}
    assert ports[(4096, 6001)]["kind"] == "oneccl-kvs"
