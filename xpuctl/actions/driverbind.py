"""The one code that unbinds and binds a PCI device's driver (the kernel's rebind recovery).

A write of the device's BDF to /sys/bus/pci/drivers/DRIVER/unbind removes the device from the
driver (its DRM nodes go; open fds get -ENODEV), one to .../bind probes it again. The write
is made by a child process this one can abandon: an unbind waits in the driver's remove
for as long as it takes, and a process in that sleep cannot be made to exit. Each write is
an audit line (state/audit.py), under `--root` a write of a file below the root.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import NamedTuple

from xpuctl.host.seam import Host
from xpuctl.state import audit

_WRITE = ("import os, sys\n"
          "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CLOEXEC)\n"
          "try:\n"
          "    os.write(fd, sys.argv[2].encode())\n"
          "except OSError as e:\n"
          "    sys.stderr.write(e.strerror or str(e)); sys.exit(1)\n")


class Write(NamedTuple):
    path: str  # host path
    done: bool
    detail: str


def driver_path(driver: str, op: str) -> str:
    return f"/sys/bus/pci/drivers/{driver}/{op}"


def write_bdf(host: Host, driver: str, op: str, bdf: str, bound: float = 30.0) -> Write:
    """Write `bdf` to the driver's `op` file (unbind or bind), bounded: a write that has not
    returned after `bound` seconds is abandoned and reported as not done."""
    path = driver_path(driver, op)
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WRITE, host.path(path), bdf],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + bound
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if child.returncode is None:
        child.kill()  # it dies when the write returns, if ever; not waited for
        result = Write(path, False, f"the write did not return within {bound:g} s")
    elif child.returncode == 0:
        result = Write(path, True, "written")
    else:
        err = child.stderr.read().decode("utf-8", "replace").strip() if child.stderr else ""
        result = Write(path, False, err or f"exit {child.returncode}")
    if child.stderr is not None and child.returncode is not None:
        child.stderr.close()
    audit.record(f"driver-{op}", {"bdf": bdf, "path": path, "driver": driver},
                 "done" if result.done else f"not done: {result.detail}")
    return result
