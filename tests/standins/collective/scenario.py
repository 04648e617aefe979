"""The collective stand-ins' scenario: the JSON at $XPUCTL_STANDIN, section "collective".

    {"collective": {"version": "2.9.0+xpu", "devices": 2, "xccl": true,
                    "hang": {"1": "init"}, "crash": {"0": "all_reduce"},
                    "hang_group": "all_reduce", "files": "TOKEN", "pidfile": "PATH"}}

`hang`/`crash`: by physical device index (torch's index through ZE_AFFINITY_MASK), the phase
where that device's rank never returns (a grandchild sleeps beside it, in its group) or
dies (SIGSEGV-like `os._exit(-11)` is impossible, so exit 139 after a line on stderr).
`hang_group`: every rank hangs in that phase when the world size is above 1 (two cards that
are fine alone). `files`: each rank makes oneCCL-like files named with TOKEN at init.
`record_env`: each rank writes its environment to PATH.<pid>.
`pidfile`: each rank appends "pid" there (the test checks none survives). `hold`: with
`files`, each rank also binds a listening /tmp/ccl-handle-TOKEN-r<rank>-x socket and keeps
/dev/shm/ze_TOKEN_held<rank>_x open, names without its pid (oneCCL's handle sockets carry
rank, comm, sched and op ids, not the pid).
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


def at(phase, device, world):
    """Hang or crash here when the scenario says so for this device."""
    c = conf()
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


def make_files(rank):
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
