"""The collective stand-ins' scenario: the JSON at $XPUCTL_STANDIN, section "collective".

    {"collective": {"version": "2.9.0+xpu", "devices": 2, "xccl": true,
                    "hang": {"1": "init"}, "crash": {"0": "all_reduce"},
                    "hang_group": "all_reduce", "files": "TOKEN", "pidfile": "PATH"}}

`hang`/`crash`: by physical device index (phases import... destroy, and `compute`: one device's
check adding a tensor on the card) (torch's index through ZE_AFFINITY_MASK), the phase
where that device's rank never returns (a grandchild sleeps beside it, in its group) or
dies (SIGSEGV-like `os._exit(-11)` is impossible, so exit 139 after a line on stderr).
`hang_group`: every rank hangs in that phase when the world size is above 1 (two cards that
are fine alone). `files`: each rank makes oneCCL-like files named with TOKEN at init.
`record_env`: each rank writes its environment to PATH.<pid>.
`pidfile`: each rank appends "pid" there (the test checks none survives). `hold`: with
`files`, each rank also binds a listening /tmp/ccl-handle-TOKEN-r<rank>-x socket and keeps
/dev/shm/ze_TOKEN_held<rank>_x open, names without its pid (oneCCL's handle sockets carry
rank, comm, sched and op ids, not the pid).
`oneccl`: each rank makes, at init, the files real oneCCL left behind after
`doctor --collective` (issue 31 §8, seen with real oneCCL, healthy or hung): a listening unix
socket /tmp/ccl-ipc-fd-sock-<pid>:0, a regular file /tmp/ccl-handle-<pid>-0 and a
/dev/shm/fi_ccl-<random> region it keeps mapped (its descriptor closed, as libfabric does),
and removes none of them, not even at exit (the XCCL process group has no shutdown:
torch-xpu-ops #5071). `made`: each rank appends the paths it made there, one a line.
`calls`: each rank appends what it did on the card there, one a line: `alloc <device>`
(a tensor allocated on xpu:<device>), `init <world>`, `all_reduce <world>` (torch.distributed).
`crash_alone`: the phase where a rank dies when the world size is 1 (vLLM #52386: an
all_reduce in a group of one segfaulted in oneCCL's `ccl_comm::post_coll` on an Arc B390 iGPU,
after `|CCL_WARN| failed to get PCI device`).
"""

import json
import os
import subprocess
import sys
import time


def conf():
    path = os.environ.get("XPUCTL_STANDIN")
    if not path:
        return {}
    with open(path) as f:
        return json.load(f).get("collective") or {}


def physical(index):
    mask = os.environ.get("ZE_AFFINITY_MASK")
    if mask:
        shown = [int(p.split(".")[0]) for p in mask.split(",") if p.strip()]
        return shown[index] if index < len(shown) else index
    return index


def note(line):
    if conf().get("calls"):
        with open(conf()["calls"], "a") as f:
            f.write(line + "\n")


def allocated(device):
    note(f"alloc {physical(device)}")


def at(phase, device, world):
    """Hang or crash here when the scenario says so for this device."""
    c = conf()
    if phase in ("init", "all_reduce"):
        note(f"{phase} {world}")
    if world == 1 and c.get("crash_alone") == phase:
        sys.stderr.write("|CCL_WARN| failed to get PCI device\n"
                         "Segmentation fault in ccl_comm::post_coll\n")
        sys.stderr.flush()
        os._exit(139)
    key = str(physical(device)) if device is not None else None
    if c.get("pidfile"):
        with open(c["pidfile"], "a") as f:
            f.write(f"{os.getpid()}\n")
    if c.get("record_env"):
        with open(f"{c['record_env']}.{os.getpid()}", "w") as f:
            json.dump(dict(os.environ), f)
    if key is not None and c.get("crash", {}).get(key) == phase:
        sys.stderr.write(f"stand-in: device {key} crashed in {phase}\n")
        sys.stderr.flush()
        os._exit(139)
    hang = key is not None and c.get("hang", {}).get(key) == phase
    if hang or (world > 1 and c.get("hang_group") == phase):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if c.get("pidfile"):
            with open(c["pidfile"], "a") as f:
                f.write(f"{child.pid}\n")
        time.sleep(600)


_held = []


def make_oneccl_files():
    import mmap
    import socket
    import uuid

    pid = os.getpid()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(f"/tmp/ccl-ipc-fd-sock-{pid}:0")
    sock.listen(4)
    _held.append(sock)
    with open(f"/tmp/ccl-handle-{pid}-0", "w") as f:
        f.write("x")
    region = f"/dev/shm/fi_ccl-{uuid.uuid4().hex[:12]}"
    fd = os.open(region, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 1 << 16)
        _held.append(mmap.mmap(fd, 1 << 16))
    finally:
        os.close(fd)  # mapped only, as libfabric keeps its regions
    made = [f"/tmp/ccl-ipc-fd-sock-{pid}:0", f"/tmp/ccl-handle-{pid}-0", region]
    if conf().get("made"):
        with open(conf()["made"], "a") as f:
            f.write("".join(p + "\n" for p in made))
    return made


def make_files(rank):
    if conf().get("oneccl"):
        make_oneccl_files()
    token = conf().get("files")
    if not token:
        return []
    if conf().get("hold"):  # names without the pid, kept open/bound like oneCCL's handle sockets
        import socket

        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(f"/tmp/ccl-handle-{token}-r{rank}-x")
        s.listen(1)
        _held.append(s)
        _held.append(open(f"/dev/shm/ze_{token}_held{rank}_x", "w"))  # noqa: SIM115 (kept open until the rank dies)
    pid = os.getpid()
    paths = [f"/tmp/ccl-ipc-fd-sock-{pid}:{rank}-{token}", f"/tmp/ccl-handle-{token}-{pid}",
             f"/dev/shm/ze_{token}_{pid}"]
    for p in paths:
        with open(p, "w") as f:
            f.write("x")
    return paths
