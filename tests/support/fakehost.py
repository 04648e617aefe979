"""Fake hosts for tests: the scenarios (a clean host, a healthy vLLM server, orphans, i915, mixed
vendors, no Intel GPU) built with the tree builder in fakehost_tree.py.

`import fakehost` gives both: the scenarios below and the builder's names (`FakeHost`, the
fdinfo text generators, `KiB`/`MiB`/`GiB`), re-exported here. Each scenario writes under the
root it is given and returns its `FakeHost`.

Run as a program it writes one for a person to look at (docs/try-without-a-gpu.md):

    python tests/support/fakehost.py orphan /tmp/xpuctl-try/orphan
    xpuctl --root /tmp/xpuctl-try/orphan doctor

`python tests/support/fakehost.py` lists the scenarios; `standin DIR` makes a stand-in root
instead (its `proc` is the live /proc, its render nodes plain files): the root `serve` and
the fake vLLM (tests/fake_vllm/vllm) run under.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fakehost_tree import (  # noqa: F401 (re-exported: fakehost's public names stay importable)
    HZ,
    PCI_CLASS,
    STATE_NAMES,
    FakeHost,
    GiB,
    KiB,
    MiB,
    amdgpu_fdinfo,
    dmabuf_fdinfo,
    generic_fdinfo,
    i915_fdinfo,
    kernel_size,
    maps_line,
    xe_fdinfo,
)

# --- scenarios ------------------------------------------------------------------------------
#
# uid 1000 ("alice") runs vLLM; uid 1001 ("bob") is another user; root runs daemons.
# Device 0: 0000:03:00.0 renderD128/card0; device 1: 0000:04:00.0 renderD129/card1 (Arc Pro B60,
# 0xe211, 24 GiB each). Times are seconds after boot.

B60 = 0xE211
B60_VRAM = 24 * GiB
BDF0, BDF1 = "0000:03:00.0", "0000:04:00.0"

ALICE_ENV = {
    "PATH": "/home/alice/venv/bin:/usr/local/bin:/usr/bin:/bin",
    "HOME": "/home/alice",
    "USER": "alice",
    "LANG": "C.UTF-8",
    "SHELL": "/bin/bash",
}

# vLLM (b)/(c) figures
TP0_VRAM = 12 * GiB  # worker TP0 on device 0
TP1_VRAM = 12800 * MiB  # worker TP1 on device 1
ENGINE_VRAM0 = 4 * MiB  # EngineCore's Level Zero client on device 0
ENGINE_VRAM1 = 2 * MiB  # ... and on device 1

UUIDS_ENGINE = [
    "2f7c1a0e-9b4d-4c1e-8a55-0d3e6f7a8b91",
    "6a1d3c5e-7f90-4b12-9c34-5e6f7a8b9c0d",
    "b3e4f5a6-1728-4394-a5b6-c7d8e9f00112",
]
UUIDS_API = [
    "d1e2f3a4-b5c6-47d8-9e0f-1a2b3c4d5e6f",
    "0a9b8c7d-6e5f-4a3b-8c1d-0e9f8a7b6c5d",
]
UUIDS_OLD_RUN = [
    "5c4b3a29-1807-46f5-9e4d-3c2b1a098765",
    "9f8e7d6c-5b4a-4392-8817-06f5e4d3c2b1",
]
FILESTORE_LIVE = "/tmp/vllm_dist_3f9c2b7e41d84a0f9b6e5d4c3b2a1908"
FILESTORE_OLD = "/tmp/vllm_dist_0ad5e1c9b7f34e2aa1c0d9e8f7a6b5c4"
FILESTORE_BOB = "/tmp/vllm_dist_7b1e4d2c9a8f46e3b5d0c1f2e3a4b5c6"
PSM_BCAST = "/dev/shm/psm_a1b2c3d4"  # rpc broadcast queue: both workers
PSM_TP0 = "/dev/shm/psm_0f1e2d3c"
PSM_TP1 = "/dev/shm/psm_9a8b7c6d"
PSM_TP1B = "/dev/shm/psm_5e4d3c2b"
SEM_ENGINE = "/dev/shm/sem.mp-5f3c2a1b"
PSM_OTHER_APP = "/dev/shm/psm_0e7c1d2f"  # held by a non-vLLM python


def _base_host(root: Path, devices: bool = True) -> FakeHost:
    """Scenario (a) basis: two xe GPUs, systemd, sshd, a login shell, a python with many fds."""
    h = FakeHost(root)
    if devices:
        h.add_device("renderD128", "card0", BDF0, device=B60, driver="xe", vram_tiles=[B60_VRAM])
        h.add_device("renderD129", "card1", BDF1, device=B60, driver="xe", vram_tiles=[B60_VRAM])
    _add_ordinary_processes(h)
    return h


def _add_ordinary_processes(h: FakeHost) -> None:
    h.add_process(
        1,
        0,
        ["/sbin/init", "splash"],
        uid=0,
        comm="systemd",
        start_ticks=h.ticks(0.5),
        exe="/usr/lib/systemd/systemd",
        fds={
            0: "/dev/null",
            1: "/dev/null",
            2: "/dev/null",
            4: "anon_inode:[eventpoll]",
            7: "socket:[1201]",
            9: "/proc/1/mountinfo",
        },
    )
    h.add_process(2, 0, [], uid=0, comm="kthreadd", start_ticks=h.ticks(0.5), state="S", exe="/")
    h.add_process(
        812,
        1,
        ["sshd: /usr/sbin/sshd -D [listener] 0 of 10-100 startups"],
        uid=0,
        comm="sshd",
        start_ticks=h.ticks(5),
        exe="/usr/sbin/sshd",
        fds={
            0: "/dev/null",
            1: "socket:[15001]",
            2: "socket:[15001]",
            3: "socket:[15010]",
            4: "socket:[15011]",
        },
    )
    h.add_tcp_listen(22, 15010, uid=0)
    h.add_tcp_listen(22, 15011, addr="::", v6=True, uid=0)
    h.add_process(
        2001,
        1995,
        ["-bash"],
        uid=1000,
        comm="bash",
        start_ticks=h.ticks(900),
        environ=ALICE_ENV,
        tty_nr=34816,
        exe="/usr/bin/bash",
        cwd="/home/alice",
        fds={0: "/dev/pts/0", 1: "/dev/pts/0", 2: "/dev/pts/0", 255: "/dev/pts/0"},
    )
    # a busy non-vLLM python: files, pipes, sockets, an eventfd, a deleted tmp file, its own psm
    fds = {
        0: "/dev/null",
        1: "pipe:[39001]",
        2: "pipe:[39002]",
        3: "/home/alice/data/train.csv",
        4: "anon_inode:[eventfd]",
        5: "anon_inode:[eventpoll]",
        6: "socket:[39010]",
        7: "socket:[39011]",
        8: "/tmp/#1703 (deleted)",
        9: PSM_OTHER_APP,
        10: "/usr/lib/python3.11/__pycache__/json.cpython-311.pyc",
        11: "anon_inode:[pidfd]",
        12: "/dev/urandom",
        13: "/proc/2101/status",
        14: "net:[4026531840]",
    }
    for i in range(15, 64):
        fds[i] = f"/home/alice/data/shard-{i:05d}.parquet"
    h.add_process(
        2101,
        2001,
        ["/usr/bin/python3", "/home/alice/app/etl.py", "--workers", "4"],
        comm="python3",
        start_ticks=h.ticks(1200),
        environ=ALICE_ENV,
        threads=9,
        pgrp=2101,
        session=2001,
        tty_nr=34816,
        fds=fds,
        maps=[maps_line(PSM_OTHER_APP, 5101, 0x7F3C2A000000, 0x100000)],
    )
    # its multiprocessing resource tracker: same cmdline as vLLM's, but not vLLM's
    h.add_process(
        2102,
        2101,
        [
            "/usr/bin/python3",
            "-B",
            "-c",
            "from multiprocessing.resource_tracker import main;main(6)",
        ],
        comm="python3",
        start_ticks=h.ticks(1201),
        environ=ALICE_ENV,
        pgrp=2101,
        session=2001,
        tty_nr=34816,
        fds={0: "/dev/null", 1: "pipe:[39001]", 2: "pipe:[39002]", 6: "pipe:[39020]"},
    )
    h.add_file(PSM_OTHER_APP, uid=1000, size=1 << 20, mtime=h.at(1210), mode=0o600)
    h.add_file("/tmp/notes.txt", uid=1000, size=120, mtime=h.at(1000))
    h.add_file(
        "/tmp/systemd-private-4e1b8c2d-chrony.service-Xy12Ab", uid=0, kind="dir", mtime=h.at(6)
    )
    h.add_file("/tmp/.X11-unix", uid=0, kind="dir", mode=0o1777, mtime=h.at(6))
    h.paths["other_app_shm"] = PSM_OTHER_APP


def clean_host(root: Path) -> FakeHost:
    """(a) Two idle xe GPUs and ordinary processes only."""
    return _base_host(root)


def _vllm_tp2(h: FakeHost, api_alive: bool) -> None:
    """The TP=2 vLLM tree of scenarios (b) and (c). pgrp 3000, session 2001 (alice's shell)."""
    API, TRACKER, ENGINE, TP0, TP1 = 3000, 3001, 3010, 3020, 3021
    common = {"uid": 1000, "pgrp": API, "session": 2001, "tty_nr": 34816, "cwd": "/home/alice"}
    spawn = [
        "/usr/bin/python3",
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=33, pipe_handle=35)",
        "--multiprocessing-fork",
    ]
    if api_alive:
        h.add_process(
            API,
            2001,
            [
                "/usr/bin/python3",
                "/usr/local/bin/vllm",
                "serve",
                "/models/llama",
                "--tensor-parallel-size",
                "2",
                "--port",
                "8000",
            ],
            comm="vllm",
            environ=ALICE_ENV,
            start_ticks=h.ticks(3000),
            threads=41,
            fds={
                0: "/dev/pts/0",
                1: "/dev/pts/0",
                2: "/dev/pts/0",
                13: "socket:[40001]",
                17: "socket:[40002]",
                14: "socket:[40021]",
                15: "socket:[40022]",
                16: "anon_inode:[eventpoll]",
                32: "pipe:[40030]",
            },
            **common,
        )
        h.add_tcp_listen(8000, 40001)
        # a client connected to the API server
        h.add_tcp(8000, 40002, addr="127.0.0.1", st=0x01, rem_addr="127.0.0.1", rem_port=51234)
        for uuid, inode in zip(UUIDS_API, (40021, 40022), strict=True):
            h.add_unix_socket(f"/tmp/{uuid}", inode)
    else:
        # the HTTP port is free at once; only a TIME_WAIT row of an old connection is left
        h.add_tcp(8000, 0, addr="127.0.0.1", st=0x06, rem_addr="127.0.0.1", rem_port=51234)
    for uuid in UUIDS_API:
        h.add_file(f"/tmp/{uuid}", uid=1000, kind="socket", mtime=h.at(3004))
    h.pids.update(api=API)

    h.add_process(
        TRACKER,
        API if api_alive else 1,
        [
            "/usr/bin/python3",
            "-B",
            "-c",
            "from multiprocessing.resource_tracker import main;main(32)",
        ],
        comm="python3",
        environ=ALICE_ENV,
        start_ticks=h.ticks(3002),
        fds={0: "/dev/null", 1: "/dev/pts/0", 2: "/dev/pts/0", 32: "pipe:[40030]"},
        **common,
    )

    # EngineCore: retitled, environ zeroed by setproctitle; Level Zero opened both devices
    engine_fds = {
        0: "/dev/null",
        1: "/dev/pts/0",
        2: "/dev/pts/0",
        7: "/dev/dri/renderD128",
        8: "/dev/dri/renderD129",
        20: "anon_inode:[eventpoll]",
        35: "pipe:[40031]",
    }
    engine_info = {
        7: xe_fdinfo(11, BDF0, [ENGINE_VRAM0], ino=685),
        8: xe_fdinfo(11, BDF1, [ENGINE_VRAM1], ino=686),
    }  # same id, other device
    for n, (uuid, inode) in enumerate(zip(UUIDS_ENGINE, (40011, 40012, 40013), strict=True)):
        engine_fds[21 + n] = f"socket:[{inode}]"
        h.add_unix_socket(f"/tmp/{uuid}", inode)
        h.add_file(f"/tmp/{uuid}", uid=1000, kind="socket", mtime=h.at(3006))
    h.add_process(
        ENGINE,
        API if api_alive else 1,
        spawn,
        title="VLLM::EngineCore",
        environ_zeroed=1816,
        start_ticks=h.ticks(3005),
        threads=33,
        fds=engine_fds,
        fdinfo=engine_info,
        maps=[
            maps_line(SEM_ENGINE, 5201, 0x7F1100000000, perms="rw-s"),
            maps_line("/dev/dri/renderD128", 685, 0x7F1200000000, 0x200000, dev="00:05"),
            maps_line(
                "/usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1.6.31294",
                2310,
                0x7F1300000000,
                perms="r-xp",
                dev="08:02",
            ),
        ],
        **common,
    )
    h.add_file(SEM_ENGINE, uid=1000, size=32, mtime=h.at(3006), mode=0o600)
    # the engine's unbound helper sockets (no path)
    h.add_unix_socket(None, 40050, listening=False)

    worker_maps = [maps_line(PSM_BCAST, 5301, 0x7E0000000000, 0x1000000)]
    for rank, pid, node, bdf, vram, psms, ino in (
        (0, TP0, "renderD128", BDF0, TP0_VRAM, [PSM_BCAST, PSM_TP0], 685),
        (1, TP1, "renderD129", BDF1, TP1_VRAM, [PSM_BCAST, PSM_TP1, PSM_TP1B], 686),
    ):
        fds = {
            0: "/dev/null",
            1: "/dev/pts/0",
            2: "/dev/pts/0",
            9: f"/dev/dri/{node}",
            12: "anon_inode:[eventfd]",
            14: f"socket:[{40100 + rank}]",
            33: "pipe:[40032]",
        }
        info = {9: xe_fdinfo(12, bdf, [vram], ino=ino, cycles_ccs=4242)}  # id 12 on both devices
        for k, psm in enumerate(psms):
            fds[10 + k * 10] = psm
        h.add_tcp_listen(41235 + 2 * rank, 40100 + rank, addr="127.0.0.1")
        h.add_process(
            pid,
            ENGINE,
            spawn,
            title=f"VLLM::Worker_TP{rank}",
            environ_zeroed=1816,
            start_ticks=h.ticks(3010 + rank),
            threads=64,
            fds=fds,
            fdinfo=info,
            maps=worker_maps
            + [maps_line(f"/dev/dri/{node}", ino, 0x7F0000000000, 0x200000, dev="00:05")],
            **common,
        )
        h.pids[f"tp{rank}"] = pid
    for psm, size in (
        (PSM_BCAST, 16 * MiB),
        (PSM_TP0, 4 * MiB),
        (PSM_TP1, 4 * MiB),
        (PSM_TP1B, 4 * MiB),
    ):
        h.add_file(psm, uid=1000, size=size, mtime=h.at(3020), mode=0o600)
    # the FileStore is written during collective set-up, after the processes started
    h.add_file(FILESTORE_LIVE, uid=1000, size=64, mtime=h.at(3040), mode=0o600)
    h.pids.update(tracker=TRACKER, engine=ENGINE)
    h.paths.update(
        filestore_live=FILESTORE_LIVE,
        sem=SEM_ENGINE,
        psm_bcast=PSM_BCAST,
        psm_tp0=PSM_TP0,
        psm_tp1=PSM_TP1,
        psm_tp1b=PSM_TP1B,
    )


def _attrs(h: FakeHost) -> FakeHost:
    for k, v in h.pids.items():
        if not k.isdigit():
            setattr(h, k, v)
    return h


def healthy_host(root: Path) -> FakeHost:
    """(b) A healthy TP=2 vLLM server on both GPUs.

    api 3000 (`vllm serve`, LISTEN 0.0.0.0:8000, socket inode 40001), tracker 3001,
    engine 3010 (`VLLM::EngineCore`, both render nodes, client id 11 on each, 4 MiB / 2 MiB),
    tp0 3020 (renderD128, client 12, 12 GiB), tp1 3021 (renderD129, client 12, 12800 MiB).
    Artifacts all in use: psm_* open by the workers, sem.mp-* mapped by the engine, uuid
    sockets bound by api and engine, FileStore written after the processes started."""
    h = _base_host(root)
    _vllm_tp2(h, api_alive=True)
    return _attrs(h)


# (c) extra pids
MONITOR, ZOMBIE, DECOY_TAIL, DECOY_TRAIN, DEAD_PID = 4000, 2950, 5000, 5001, 2900


def orphan_host(root: Path) -> FakeHost:
    """(c) Scenario (b) after `kill -9` of the API server, plus leftovers, decoys and a monitor.

    Orphans: engine 3010 (ppid 1), tp0 3020 and tp1 3021 (ppid 3010), tracker 3001 (ppid 1).
    tp0 also has fd 15, a dup of fd 9 (same client 12 on 0000:03:00.0: counted once).
    tp1 is in D state (wchan dma_fence_default_wait) and holds a dma-buf fd (not a DRM client).
    monitor 4000 (root, xpu-smi) holds renderD128 with drm-total-vram0 0.
    zombie 2950 (comm VLLM::Worker_TP, state Z, ppid 1, empty cmdline, no fds) holds nothing.
    decoys 5000 (`tail -f /var/log/notes-about-vllm-serve.txt`), 5001 (`python3 train.py
    --engine vllm serve`, ppid 1, uid 1000, started before every vLLM process) are not vLLM.

    Files and whether they are stale (paths in h.paths):
    - stale_shm /dev/shm/psm_dead1: uid 1000, open and mapped by nobody -> stale.
    - psm_* of the workers (open) and sem.mp-* (mapped by the engine) -> not stale.
    - other_app_shm (open by the non-vLLM python 2101) -> not stale.
    - shm_symlink /dev/shm/psm_link -> /etc/passwd: a symlink is never stale.
    - filestore_live (uid 1000, mtime 3040 s): the orphans of uid 1000 started at 3005-3011 s,
      before it was written, and are alive -> NOT stale (it belongs to their run).
    - filestore_old (uid 1000, mtime 500 s): every live vLLM process of uid 1000 started after
      it; the zombie (start 400 s) is not live and the decoy train.py (start 100 s) is not
      vLLM -> stale.
    - filestore_bob (uid 1001, mtime 3040 s): no live vLLM process of uid 1001 -> stale.
    - ccl_dead /tmp/ccl-ipc-fd-sock-2900:0-1-2: pid 2900 is dead, not bound -> stale.
    - ccl_live /tmp/ccl-ipc-fd-sock-3020:0-1-2: bound in proc/net/unix (tp0's socket) -> not stale.
    - ccl_handle /tmp/ccl-handle-0-1-0-0-1000-<uuid>: not bound -> stale.
    - ccl_cache /tmp/ccl-module-cache-0-abcdef: a cache -> never stale.
    - zmq_engine_*: uuid sockets bound by the engine -> not stale; zmq_api_*: bound by the dead
      API server -> stale; zmq_old_*: left by an earlier clean run -> stale.
    - uuid_regular /tmp/<uuid> that is a regular file, not a socket -> not a zmq artifact.
    """
    h = _base_host(root)
    _vllm_tp2(h, api_alive=False)
    TP0, TP1 = 3020, 3021
    # tp0: a dup'ed render fd (same struct drm_file -> same client id); tp1: stuck in the driver
    p = h.root / f"proc/{TP0}"
    h._symlink(f"proc/{TP0}/fd/15", "/dev/dri/renderD128")
    (p / "fdinfo/15").write_text((p / "fdinfo/9").read_text())
    h._symlink(f"proc/{TP0}/fd/40", "socket:[40201]")
    (p / "fdinfo/40").write_text(generic_fdinfo(40201, flags="02000002", mnt_id=8))
    for f in ("fd/15", "fdinfo/15", "fd/40", "fdinfo/40"):
        os.chown(p / f, 1000, 1000, follow_symlinks=False)
    _set_state(h, TP1, "D", wchan="dma_fence_default_wait")
    q = h.root / f"proc/{TP1}"
    h._symlink(f"proc/{TP1}/fd/50", "/dmabuf:")
    (q / "fdinfo/50").write_text(dmabuf_fdinfo(2 * MiB, "xe", ino=77001))
    for f in ("fd/50", "fdinfo/50"):
        os.chown(q / f, 1000, 1000, follow_symlinks=False)

    # a monitor holding renderD128 (root, idle client: vram0 0)
    h.add_process(
        MONITOR,
        1,
        ["/usr/bin/xpu-smi", "dump", "-d", "0", "-m", "1"],
        uid=0,
        start_ticks=h.ticks(3500),
        environ={"PATH": "/usr/bin:/bin"},
        fds={0: "/dev/null", 1: "pipe:[45001]", 2: "pipe:[45001]", 3: "/dev/dri/renderD128"},
        fdinfo={3: xe_fdinfo(40, BDF0, [0], gtt=64 * KiB, ino=685)},
    )
    # a zombie worker of an earlier run, never reaped by PID 1
    h.add_process(ZOMBIE, 1, [], state="Z", comm="VLLM::Worker_TP", start_ticks=h.ticks(400))
    # decoys: contain "vllm" but are not vLLM
    h.add_process(
        DECOY_TAIL,
        2001,
        ["tail", "-f", "/var/log/notes-about-vllm-serve.txt"],
        start_ticks=h.ticks(2500),
        environ=ALICE_ENV,
        exe="/usr/bin/tail",
        fds={
            0: "/dev/pts/0",
            1: "/dev/pts/0",
            2: "/dev/pts/0",
            3: "/var/log/notes-about-vllm-serve.txt",
        },
    )
    h.add_process(
        DECOY_TRAIN,
        1,
        ["python3", "train.py", "--engine", "vllm", "serve"],
        start_ticks=h.ticks(100),
        environ=ALICE_ENV,
        threads=3,
        fds={0: "/dev/null", 1: "/home/alice/train.log", 2: "/home/alice/train.log"},
    )

    # leftovers
    paths = h.paths
    paths["stale_shm"] = "/dev/shm/psm_dead1"
    h.add_file(paths["stale_shm"], uid=1000, size=4 * MiB, mtime=h.at(700), mode=0o600)
    paths["shm_symlink"] = "/dev/shm/psm_link"
    h.add_file(
        paths["shm_symlink"], uid=1000, kind="symlink", target="/etc/passwd", mtime=h.at(710)
    )
    paths["filestore_old"] = FILESTORE_OLD
    h.add_file(FILESTORE_OLD, uid=1000, size=64, mtime=h.at(500), mode=0o600)
    paths["filestore_bob"] = FILESTORE_BOB
    h.add_file(FILESTORE_BOB, uid=1001, size=64, mtime=h.at(3040), mode=0o600)
    paths["ccl_dead"] = f"/tmp/ccl-ipc-fd-sock-{DEAD_PID}:0-1-2"
    h.add_file(paths["ccl_dead"], uid=1000, kind="socket", mtime=h.at(800))
    paths["ccl_live"] = f"/tmp/ccl-ipc-fd-sock-{TP0}:0-1-2"
    h.add_file(paths["ccl_live"], uid=1000, kind="socket", mtime=h.at(3050))
    h.add_unix_socket(paths["ccl_live"], 40201)
    paths["ccl_handle"] = "/tmp/ccl-handle-0-1-0-0-1000-8c6f0b2e-1d3a-4f5b-9e7c-2a4b6d8f0e1c"
    h.add_file(paths["ccl_handle"], uid=1000, kind="socket", mtime=h.at(810))
    paths["ccl_cache"] = "/tmp/ccl-module-cache-0-abcdef"
    h.add_file(paths["ccl_cache"], uid=0, size=81920, mtime=h.at(300))
    for n, uuid in enumerate(UUIDS_ENGINE):
        paths[f"zmq_engine_{n}"] = f"/tmp/{uuid}"
    for n, uuid in enumerate(UUIDS_API):
        paths[f"zmq_api_{n}"] = f"/tmp/{uuid}"
    for n, uuid in enumerate(UUIDS_OLD_RUN):
        paths[f"zmq_old_{n}"] = f"/tmp/{uuid}"
        h.add_file(paths[f"zmq_old_{n}"], uid=1000, kind="socket", mtime=h.at(650))
    paths["uuid_regular"] = "/tmp/7e6d5c4b-3a29-4817-9605-f4e3d2c1b0a9"
    h.add_file(paths["uuid_regular"], uid=1000, size=10, mtime=h.at(660))
    # the abstract sockets Level Zero leaves are not files
    h.add_unix_socket(f"@neo_ipc_{TP0}", 40300)

    h.pids.update(
        monitor=MONITOR,
        zombie=ZOMBIE,
        decoy_tail=DECOY_TAIL,
        decoy_train=DECOY_TRAIN,
        stuck=TP1,
        dead_pid=DEAD_PID,
    )
    return _attrs(h)


def _set_state(h: FakeHost, pid: int, state: str, wchan: str | None = None) -> None:
    """Rewrite the state letter in stat/status (and wchan) of an existing process."""
    d = h.root / f"proc/{pid}"
    st = (d / "stat").read_text()
    head, _, tail = st.rpartition(") ")
    fields = tail.split(" ")
    fields[0] = state
    (d / "stat").write_text(f"{head}) {' '.join(fields)}")
    status = (d / "status").read_text().splitlines(keepends=True)
    status = [f"State:\t{STATE_NAMES[state]}\n" if s.startswith("State:") else s for s in status]
    (d / "status").write_text("".join(status))
    if wchan is not None:
        (d / "wchan").write_text(wchan)


# (d) i915
IGPU_BDF, A770_BDF = "0000:00:02.0", "0000:03:00.0"
A770_LOCAL = 14680064 * KiB  # the worker's drm-total-local0
A770_ENGINE_LOCAL = 3 * MiB
A770_LMEM = 16 * GiB
RUN_ID = "run-20261129-7f3a"


def i915_host(root: Path) -> FakeHost:
    """(d) An Arc A770 (i915, 0x56a0, card1/renderD129 at 0000:03:00.0, lmem_total_bytes 16 GiB,
    a DP connector) plus a Raptor Lake iGPU (i915, 0xa780, card0/renderD128 at 0000:00:02.0).
    A TP=1 vLLM started by `xpuctl serve` (XPUCTL_RUN_ID and SPT_NOENV=1 in every environ):
    api 3100 (`python -m vllm.entrypoints.openai.api_server`, port 8001), engine 3110 holding
    both devices (iGPU: system0 only; A770: local0 3 MiB), worker 3120 `VLLM::Worker` on the
    A770 with drm-total-local0 14680064 KiB. Level Zero index: iGPU 0, A770 1."""
    h = FakeHost(root)
    h.add_device(
        "renderD128",
        "card0",
        IGPU_BDF,
        device=0xA780,
        driver="i915",
        bridge="",
        connectors=["eDP-1", "HDMI-A-1"],
    )
    h.add_device(
        "renderD129",
        "card1",
        A770_BDF,
        device=0x56A0,
        driver="i915",
        lmem_total=A770_LMEM,
        connectors=["DP-1", "HDMI-A-2"],
        subsystem_vendor=0x8086,
        subsystem_device=0x1020,
    )
    _add_ordinary_processes(h)
    env = dict(ALICE_ENV, XPUCTL_RUN_ID=RUN_ID, SPT_NOENV="1", ZE_FLAT_DEVICE_HIERARCHY="FLAT")
    common = {"uid": 1000, "pgrp": 3100, "session": 3100, "environ": env}
    h.add_process(
        3100,
        2001,
        [
            "/home/alice/venv/bin/python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/models/qwen",
            "--port",
            "8001",
            "--shutdown-timeout",
            "30",
        ],
        comm="python",
        start_ticks=h.ticks(4000),
        threads=30,
        fds={
            0: "/dev/null",
            1: "/home/alice/.local/state/xpuctl/runs/r.log",
            2: "/home/alice/.local/state/xpuctl/runs/r.log",
            11: "socket:[60001]",
        },
        **common,
    )
    h.add_tcp_listen(8001, 60001)
    h.add_tcp_listen(8001, 60002, addr="::", v6=True)
    spawn = [
        "/home/alice/venv/bin/python",
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=8, pipe_handle=10)",
        "--multiprocessing-fork",
    ]
    h.add_process(
        3110,
        3100,
        spawn,
        title="VLLM::EngineCore",
        start_ticks=h.ticks(4004),
        threads=20,
        fds={0: "/dev/null", 5: "/dev/dri/renderD128", 6: "/dev/dri/renderD129"},
        fdinfo={
            5: i915_fdinfo(31, IGPU_BDF, system0=6044 * KiB),
            6: i915_fdinfo(7, A770_BDF, local0=A770_ENGINE_LOCAL, ino=286),
        },
        **common,
    )
    h.add_process(
        3120,
        3110,
        spawn,
        title="VLLM::Worker",
        start_ticks=h.ticks(4008),
        threads=40,
        fds={0: "/dev/null", 9: "/dev/dri/renderD129", 10: "/dev/shm/psm_77aa88bb"},
        fdinfo={9: i915_fdinfo(8, A770_BDF, local0=A770_LOCAL, ino=286)},
        **common,
    )
    # SPT_NOENV=1: the titles still replace argv, the environment stays readable
    h.add_file("/dev/shm/psm_77aa88bb", uid=1000, size=4 * MiB, mtime=h.at(4010), mode=0o600)
    h.pids.update(api=3100, engine=3110, worker=3120)
    return _attrs(h)


# (e) non-Intel + Intel
AMD_BDF, XE_BDF = "0000:03:00.0", "0000:04:00.0"


def mixed_vendor_host(root: Path) -> FakeHost:
    """(e) An AMD RX 7900 XTX (amdgpu, 0x1002:0x744c, renderD128/card0 at 0000:03:00.0) and an
    Intel B580 (xe, 0xe20b, renderD129/card1 at 0000:04:00.0, no tile sysfs: total unknown).
    Level Zero index 0 is the Intel device; the AMD one has index null. No GPU users."""
    h = FakeHost(root)
    h.add_device(
        "renderD128",
        "card0",
        AMD_BDF,
        vendor=0x1002,
        device=0x744C,
        driver="amdgpu",
        connectors=["DP-1"],
    )
    h.add_device("renderD129", "card1", XE_BDF, device=0xE20B, driver="xe", vram_tiles=None)
    _add_ordinary_processes(h)
    return _attrs(h)


# (f) no Intel GPU: no DRM device at all, or a non-Intel one only


def no_drm_host(root: Path) -> FakeHost:
    """(f) No DRM device at all (a VM, or a container started without /dev/dri): the ordinary
    processes of (a) and an empty /sys/class/drm."""
    h = _base_host(root, devices=False)
    h.path("/sys/class/drm").mkdir(parents=True, exist_ok=True)
    return _attrs(h)


def amd_only_host(root: Path) -> FakeHost:
    """(g) The AMD RX 7900 XTX of (e) alone: a DRM device, but no Intel GPU."""
    h = FakeHost(root)
    h.add_device("renderD128", "card0", AMD_BDF, vendor=0x1002, device=0x744C, driver="amdgpu",
                 connectors=["DP-1"])
    _add_ordinary_processes(h)
    return _attrs(h)


# (h) vLLM as a library (issue 29 §1)
EMBEDDED_VRAM = 6 * GiB


def embedded_host(root: Path, reused_parent: bool = False) -> FakeHost:
    """(h) vLLM run as a library: alice's `python3 batch.py` 6000 (pgrp 6000, session 2001:
    her shell's job) called `LLM(...)`, which spawned EngineCore 6010 and it a worker 6020
    (titles as vLLM sets them, same session and group as the script). The worker holds device
    0 with 6 GiB, the script itself an idle Level Zero context on it.

    `reused_parent`: the script died, and its pid 6000 now names `sleep 600`, started after
    the EngineCore (a recycled pid: the same session and group, only the start time tells):
    the engine and worker are orphans."""
    h = _base_host(root)
    SCRIPT, ENGINE, WORKER = 6000, 6010, 6020
    common = {"uid": 1000, "pgrp": SCRIPT, "session": 2001, "tty_nr": 34816,
              "cwd": "/home/alice", "environ": ALICE_ENV}
    if reused_parent:
        h.add_process(SCRIPT, 2001, ["sleep", "600"], comm="sleep", start_ticks=h.ticks(6000),
                      **common)
    else:
        h.add_process(SCRIPT, 2001, ["python3", "batch.py", "--prompts", "/data/p.jsonl"],
                      comm="python3", start_ticks=h.ticks(5000), threads=12,
                      fds={0: "/dev/pts/0", 1: "/dev/pts/0", 2: "/dev/pts/0",
                           7: "/dev/dri/renderD128"},
                      fdinfo={7: xe_fdinfo(21, BDF0, [0], ino=685)}, **common)
    spawn = ["/usr/bin/python3", "-c",
             "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=9, pipe_handle=11)",
             "--multiprocessing-fork"]
    h.add_process(ENGINE, SCRIPT, spawn, title="VLLM::EngineCore", environ_zeroed=900,
                  start_ticks=h.ticks(5005), threads=30, fds={0: "/dev/null"},
                  **{k: v for k, v in common.items() if k != "environ"})
    h.add_process(WORKER, ENGINE, spawn, title="VLLM::Worker_TP0", environ_zeroed=900,
                  start_ticks=h.ticks(5010), threads=60,
                  fds={0: "/dev/null", 9: "/dev/dri/renderD128"},
                  fdinfo={9: xe_fdinfo(22, BDF0, [EMBEDDED_VRAM], ino=685)},
                  **{k: v for k, v in common.items() if k != "environ"})
    h.pids.update(script=SCRIPT, engine=ENGINE, worker=WORKER)
    return _attrs(h)


# (i) orphans of several devices (issue 29 §3)
def device_scope_host(root: Path) -> FakeHost:
    """(i) Three orphaned trees of alice's (each API server SIGKILLed: the engines were
    reparented to init), and a stale file:
    - on1: engine 3510 holds nothing, its worker 3520 holds device 1 (renderD129) only;
    - masked: engine 3610 holds nothing yet, ZE_AFFINITY_MASK=0 in its readable environ
      (SPT_NOENV=1): tied to device 0 (Level Zero index 0);
    - bare: engine 3710 holds nothing and names no device;
    - stale: /dev/shm/psm_dead2, opened by nobody."""
    h = _base_host(root)
    spawn = ["/usr/bin/python3", "-c",
             "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=9, pipe_handle=11)",
             "--multiprocessing-fork"]
    for key, engine, env in (("on1", 3510, None), ("masked", 3610, "0"), ("bare", 3710, None)):
        common = {"uid": 1000, "pgrp": engine - 10, "session": 2001, "cwd": "/home/alice"}
        environ = dict(ALICE_ENV, ZE_AFFINITY_MASK=env, SPT_NOENV="1") if env else None
        h.add_process(engine, 1, spawn, title="VLLM::EngineCore", start_ticks=h.ticks(4000),
                      fds={0: "/dev/null"}, environ=environ,
                      environ_zeroed=None if environ else 900, **common)
        h.pids[key] = engine
    h.add_process(3520, 3510, spawn, title="VLLM::Worker_TP0", environ_zeroed=900,
                  start_ticks=h.ticks(4005), fds={0: "/dev/null", 9: "/dev/dri/renderD129"},
                  fdinfo={9: xe_fdinfo(31, BDF1, [8 * GiB], ino=686)},
                  uid=1000, pgrp=3500, session=2001)
    h.pids["on1_worker"] = 3520
    h.paths["stale"] = "/dev/shm/psm_dead2"
    h.add_file(h.paths["stale"], uid=1000, size=MiB, mtime=h.at(3900), mode=0o600)
    return _attrs(h)


# --- as a program -------------------------------------------------------------------------

#: the scenarios by the name the program takes
SCENARIOS = {
    "clean": clean_host,
    "healthy": healthy_host,
    "orphan": orphan_host,
    "i915": i915_host,
    "mixed-vendor": mixed_vendor_host,
    "no-drm": no_drm_host,
    "amd-only": amd_only_host,
    "embedded": embedded_host,
    "device-scope": device_scope_host,
}
STANDIN = "standin"


def _usage() -> str:
    lines = ["usage: python tests/support/fakehost.py SCENARIO DIR", "",
             "Write a fake host under DIR (new or empty), then: xpuctl --root DIR doctor", ""]
    for name, fn in SCENARIOS.items():
        said = " ".join((fn.__doc__ or "").split("\n\n")[0].split())
        if len(said) > 64:
            said = said[:63].rsplit(" ", 1)[0] + " …"
        lines.append(f"  {name:<13} {said}")
    lines.append(f"  {STANDIN:<13} a root whose proc is the live /proc and whose render nodes")
    lines.append(f"  {'':<13} are plain files: for serve with the fake vLLM")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in (*SCENARIOS, STANDIN):
        print(_usage(), file=sys.stderr if argv else sys.stdout)
        return 2 if argv else 0
    name, target = argv
    root = Path(target).absolute()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        print(f"fakehost: {root} exists and is not an empty directory", file=sys.stderr)
        return 2
    if name == STANDIN:
        from proctools import StandInRoot

        StandInRoot(root=root)
        print(f"stand-in root written to {root}: xpuctl --root {root} devices")
        return 0
    SCENARIOS[name](root)
    print(f"fake host {name!r} written to {root}: xpuctl --root {root} doctor")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
