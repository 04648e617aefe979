"""What to try before relaunching after a oneCCL hang or crash: mitigations and their cost.

Advice only: xpuctl never sets these itself (docs/oneccl.md has the table; the known-bad
versions and their rows are core/known.py's, which serve's diagnosis names as well). After a failed
start serve leaves `RESET` out (`skip`): the command to run next is said once, after the
list (output.lines.next_line). Sources: vLLM
#50545 / oneCCL #215 (ring all-reduce), vLLM #41663 (IPC handle cache), #48953 and
llm-scaler #486 (IPC exchange), oneCCL #209 (KVS interface), torch-ccl #71 (sockets exchange
crash), vLLM #14612 and ipex-llm #12990 (render nodes not visible), vLLM #10109 (oneCCL
workers), vLLM #27313 (shared memory broadcast), oneCCL's own sources and real oneCCL runs
(atl_ofi_helper.cpp: fi_getinfo -61; internal_kvs.cpp: the KVS connection limit).
"""

from __future__ import annotations

from typing import NamedTuple

from xpuctl.core import known  # the rows these mitigations answer (one table)


class Mitigation(NamedTuple):
    setting: str
    why: str
    cost: str


RESET = Mitigation(
    "xpuctl reset",
    "stop orphans and remove stale oneCCL/shm files left by the last run",
    "none for a stopped server; it refuses to touch a live one",
)
RING = Mitigation(
    "CCL_ALLREDUCE=ring",
    "avoids oneCCL 2022.x's default all-reduce, which hangs at warm-up (oneCCL #215, vLLM "
    f"#50545; known issue {known.ONECCL_ALLREDUCE.key}, docs/known-issues.md)",
    "replaces oneCCL's tuned algorithm choice, at a throughput cost not measured here",
)
IPC_EXCHANGE = Mitigation(
    "CCL_ZE_IPC_EXCHANGE=drmfd|sockets",
    "exchange Level Zero IPC handles another way than pidfd; sockets together with "
    "CCL_TOPO_P2P_ACCESS=0 (vLLM #48953, llm-scaler #486)",
    "drmfd opens the render nodes through /dev/dri/by-path (a container must mount it); sockets "
    "leaves /tmp/ccl-handle-* after a kill and crashed on Max 1550 (torch-ccl #71); P2P off "
    "sends collectives through host memory (slower)",
)
KVS_IFACE = Mitigation(
    "CCL_KVS_IFACE=lo",
    "bind oneCCL's bootstrap KVS to loopback; hosts with many interfaces hang in "
    "create_comm_id (oneCCL #209)",
    "undocumented; single host only (ranks on other nodes cannot reach a loopback KVS)",
)
IPC_CACHE = Mitigation(
    "CCL_ZE_CACHE_OPEN_IPC_HANDLES=0",
    "stop reusing a stale cached IPC handle (oneCCL #212, vLLM #41663; known issue "
    f"{known.ONECCL_IPC_CACHE.key})",
    "about 3 % throughput (CCL_ZE_CACHE=0, the blunt version, about 39 %)",
)
DEVICE = Mitigation(
    "xpuctl reset --device N --device-reset (root), or a reboot",
    "a lost device stays wedged until the driver resets it",
    "drops everything on the device; some states recover only with a reboot",
)
DRI_VISIBLE = Mitigation(
    "make every render node and /dev/dri/by-path visible to vLLM",
    "oneCCL opens the render nodes itself (drmfd exchange, through /dev/dri/by-path) and "
    "crashes when it cannot (vLLM #14612, ipex-llm #12990); a container needs all of /dev/dri "
    "(e.g. `--device /dev/dri -v /dev/dri/by-path:/dev/dri/by-path`), and the user the render group",
    "the container sees every GPU of the host; restrict the ones vLLM uses with ZE_AFFINITY_MASK",
)
WORKERS = Mitigation(
    "check the oneCCL environment (setvars.sh of the same oneAPI as torch/IPEX, CCL_ATL_TRANSPORT, "
    "CCL_WORKER_COUNT)",
    "oneCCL could not start its worker threads (vLLM #10109): a mismatched oneCCL or a worker "
    "setting the host cannot honour",
    "none; it is a set-up fault, not a mitigation",
)
CRASH_LOG = Mitigation(
    "read the traceback before the quoted line in the run's log (`xpuctl logs`)",
    "a segmentation fault in a worker ends the start; the frame above it names the library",
    "none",
)
SHM_BROADCAST = Mitigation(
    "find the worker that stopped answering (py-spy dump of the workers)",
    "vLLM's engine waited 60 s for its workers (shm_broadcast, vLLM #27313); one is hanging in "
    "a collective or a compilation, or is gone",
    "none to look; restarting drops the requests in flight",
)
SHM_ROOM = Mitigation(
    "room in /dev/shm (`df -h /dev/shm`; a container's --shm-size)",
    "oneCCL's transport needs libfabric shared-memory regions (64 MiB each, "
    "/dev/shm/<pid>:<uid>:<n>); a SIGKILLed rank leaks them, and with /dev/shm full "
    "fi_getinfo finds no provider (ret -61) and the ATL does not start; reset removes the "
    "leaked regions once their ranks are gone",
    "none for a stopped server; a larger /dev/shm takes host memory",
)
FI_PROVIDER = Mitigation(
    "check FI_PROVIDER (unset it, or name a provider this libfabric has: shm, tcp)",
    "a provider libfabric lacks (e.g. a host's cxi inside a container) also makes fi_getinfo "
    "find none (ret -61)",
    "none; tcp between ranks of one host is slower than shm",
)
KVS_WAIT = Mitigation(
    "wait a minute after a killed run, or unset CCL_KVS_PORT (oneCCL then picks a free port "
    "from 4096 up)",
    "a KVS port reused within 60 s of a SIGKILL is in TIME_WAIT: oneCCL's KVS waits 120 s "
    "for it, then kvs_init gives up; an unreachable master (another host, a firewall) "
    "looks the same",
    "the wait; a port oneCCL picks must be free between the ranks (one host: any)",
)
READY_TIMEOUT = Mitigation(
    "a longer --ready-timeout",
    "a start that was still making progress may only have been slow (a large model)",
    "a real hang is noticed that much later",
)

# signature key (parse.vllmlog) -> what to try, most likely first
# (the same as README's "Troubleshooting: oneCCL hangs" table)
BY_SIGNATURE: dict[str, tuple[Mitigation, ...]] = {
    "not-ready": (RESET, IPC_CACHE, RING, KVS_IFACE, IPC_EXCHANGE, READY_TIMEOUT),
    "xccl-stuck": (RESET, IPC_CACHE, RING, KVS_IFACE, IPC_EXCHANGE),
    "ipc-handle": (IPC_EXCHANGE, IPC_CACHE),
    "kvs": (IPC_CACHE, KVS_IFACE),
    "device-lost": (RING, DEVICE),
    "oneccl-device-fds": (DRI_VISIBLE, IPC_EXCHANGE),
    "oneccl-workers": (WORKERS,),
    "segfault": (CRASH_LOG, RESET),
    "shm-broadcast": (SHM_BROADCAST, RESET, RING, IPC_CACHE),
    "atl-init": (SHM_ROOM, FI_PROVIDER),
    "kvs-timeout": (KVS_WAIT, KVS_IFACE),
    "oneccl-exception": (CRASH_LOG, RESET),
}


def mitigations(keys: list[str], skip: tuple[Mitigation, ...] = ()) -> list[Mitigation]:
    """The mitigations for these signature keys, each once, in order (but those in `skip`)."""
    out: list[Mitigation] = []
    for key in keys:
        for m in BY_SIGNATURE.get(key, ()):
            if m not in out and m not in skip:
                out.append(m)
    return out


def lines(keys: list[str], skip: tuple[Mitigation, ...] = ()) -> list[str]:
    """One line per mitigation: `SETTING: why (cost: ...)`."""
    return [f"{m.setting}: {m.why} (cost: {m.cost})" for m in mitigations(keys, skip)]
