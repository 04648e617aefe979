"""One rank of the collective check (child process only): what vLLM's XPU workers do first.

Run as `python -m xpuctl.probes.children.collective_rank` by the group's leader
(`collective_group`), with MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK and WORLD_SIZE set, and
XPUCTL_COLLECTIVE_DEVICE (the torch.xpu index this rank uses) and XPUCTL_COLLECTIVE_SLOT (its
slot in the leader's report), and XPUCTL_COLLECTIVE_PROOF (`all_reduce`, the default, or
`compute`). It reports each phase as it enters it, so that a hang has one.

With `all_reduce` (a group of two or more devices, and each device alone after such a group
failed):

- import: `import torch`; torch < 2.8 also imports intel_extension_for_pytorch and
  oneccl_bindings_for_pytorch (backend `ccl`), torch >= 2.8 has `xccl` built in;
  `torch.xpu.set_device(i)`;
- init: `torch.distributed.init_process_group(backend, init_method="env://", rank, world_size)`;
- all_reduce: one all_reduce of a one-element tensor of ones on `xpu:i`, then
  `torch.xpu.synchronize()`; the sum must be the world size;
- destroy: `torch.distributed.destroy_process_group()`.

With `compute` (the check of one device: vLLM skips its warm-up all_reduce at world size 1,
vLLM PR #52389, after an all_reduce in a group of one crashed in oneCCL on an Arc B390 iGPU,
vLLM #52386), no process group and no collective, the card's own runtime path only:

- import: as above (the backend vLLM will need is looked for, not started);
- compute: a tensor of ones allocated on `xpu:i`, added to itself and summed on the card,
  `torch.xpu.synchronize()`; the sum must be twice the tensor's length.

After each phase it passed (and before it fails) it says which files in /tmp and /dev/shm it
holds (`files` events): the backend's (oneCCL's fd-exchange socket and handle files,
libfabric's mapped regions), which stay after the rank ends (the XCCL process group has no
shutdown) and whose names need not carry its pid. The check removes them once the ranks are
gone (`doctor.remove_collective_files`, by the stale-file rules).

Only public torch APIs. Events go to stdout (`xpuctl.parse.collective`), each one line
written whole. Test-only: XPUCTL_TEST_COLLECTIVE_BACKEND=gloo runs the same code over
`gloo` on CPU tensors (no torch.xpu), so tests exercise a real torch.distributed rendezvous
on a machine without an Intel GPU; never set it outside tests.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from xpuctl.probes.children.common import TORCH_XPU_INSTALL

MARKER = "XPUCTL-COLLECTIVE "  # xpuctl.parse.collective.MARKER
TEST_BACKEND = "XPUCTL_TEST_COLLECTIVE_BACKEND"
SLOT = int(os.environ.get("XPUCTL_COLLECTIVE_SLOT", "0") or 0)
COMPUTE_ELEMENTS = 1024


_at = {"phase": "import"}  # the phase this rank last said it entered (an error's phase)


def emit(ev: str, **fields: Any) -> None:
    if ev == "phase":
        _at["phase"] = str(fields["phase"])
    data = (MARKER + json.dumps({"ev": ev, "slot": SLOT, **fields}, ensure_ascii=True)[:3000]
            + "\n").encode("ascii")
    while data:
        data = data[os.write(1, data):]


def _version(text: str) -> tuple[int, int]:
    m = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def report_files() -> None:
    """A `files` event (several, each a line well under emit's cap) naming what this process
    holds in /tmp and /dev/shm: its fds, its mappings, the unix sockets it bound. Its own
    /proc only; a failure to read says nothing (the kill's look and the pid in oneCCL's
    names remain)."""
    try:
        from xpuctl.parse.collective import held_files

        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
        with open("/proc/self/maps") as f:
            maps = f.read()

        def unix() -> str:
            with open("/proc/self/net/unix") as f:
                return f.read()

        paths = sorted(held_files(links, [maps], unix))
    except Exception:
        return
    for i in range(0, min(len(paths), 256), 8):
        emit("files", paths=paths[i:i + 8])


class Unavailable(Exception):
    """The check cannot run here (no torch with XPU, no backend): not a device's fault."""


def _backend(torch: Any) -> str:
    """xccl (torch >= 2.8) or ccl (older torch, with IPEX and oneCCL's bindings)."""
    import torch.distributed as dist

    version = str(getattr(torch, "__version__", "") or "")
    if _version(version) >= (2, 8):
        check = getattr(dist, "is_xccl_available", None)
        if check is not None and not check():
            raise Unavailable(f"torch {version} was built without the xccl backend "
                              f"(its XPU build: {TORCH_XPU_INSTALL})")
        return "xccl"
    for module, package in (("intel_extension_for_pytorch", "intel-extension-for-pytorch"),
                            ("oneccl_bindings_for_pytorch", "oneccl_bind_pt")):
        try:
            __import__(module)
        except ImportError as exc:
            raise Unavailable(f"torch {version} needs {package} for the ccl backend: {exc} "
                              "(or use torch 2.8 or later, which has xccl)") from None
    return "ccl"


def _device(torch: Any, index: int) -> Any:
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        raise Unavailable(f"torch {getattr(torch, '__version__', '?')} sees no XPU "
                          f"(a build without XPU, as PyPI's: {TORCH_XPU_INSTALL}; or no Intel GPU driver)")
    count = int(xpu.device_count())
    if index >= count:
        raise RuntimeError(f"torch sees {count} XPU device(s); device {index} is not among them")
    xpu.set_device(index)
    return xpu


def _compute(torch: Any, xpu: Any, where: str) -> float:
    """Allocate on the card, compute there, wait for it: what one device's launch does first."""
    t = torch.ones(COMPUTE_ELEMENTS, device=where)
    got = float((t + t).sum().item())
    if xpu is not None:
        xpu.synchronize()
    if got != 2.0 * COMPUTE_ELEMENTS:
        raise RuntimeError(f"the computation on {where} gave {got:g}, "
                           f"expected {2 * COMPUTE_ELEMENTS}")
    return got


def _all_reduce(torch: Any, xpu: Any, where: str, backend: str, world: int) -> float:
    """init_process_group, one all_reduce, destroy_process_group (phases init to destroy)."""
    import torch.distributed as dist

    emit("phase", phase="init", backend=backend)
    dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]),
                            world_size=world)
    report_files()
    emit("phase", phase="all_reduce", backend=backend)
    t = torch.ones(1, device=where)
    dist.all_reduce(t)
    if xpu is not None:
        xpu.synchronize()
    got = float(t.item())
    if got != float(world):
        raise RuntimeError(f"all_reduce gave {got:g}, expected {world}")
    report_files()
    emit("phase", phase="destroy", backend=backend)
    dist.destroy_process_group()
    return got


def rank() -> None:
    emit("phase", phase="import")
    try:
        try:
            import torch
        except ImportError as exc:
            raise Unavailable(f"torch is not installed ({exc}); its XPU build: "
                              f"{TORCH_XPU_INSTALL}") from None

        index = int(os.environ["XPUCTL_COLLECTIVE_DEVICE"])
        world = int(os.environ["WORLD_SIZE"])
        compute = os.environ.get("XPUCTL_COLLECTIVE_PROOF") == "compute"
        gloo = os.environ.get(TEST_BACKEND) == "gloo"
        if gloo:
            backend: str | None = "gloo"
            xpu, where = None, "cpu"
        else:
            backend = _backend(torch)  # vLLM needs it at world size 1 too (its process group)
            xpu = _device(torch, index)
            where = f"xpu:{index}"
        if compute:
            emit("phase", phase="compute")
            got = _compute(torch, xpu, where)
            report_files()
            emit("done", sum=got, backend=backend)
            return
        got = _all_reduce(torch, xpu, where, str(backend), world)
        report_files()
        emit("done", sum=got, backend=backend)
    except Unavailable as exc:
        emit("unavailable", reason=str(exc)[:400])
    except Exception as exc:
        report_files()
        emit("error", phase=_at["phase"], error=f"{type(exc).__name__}: {exc}"[:400])
        os._exit(1)


if __name__ == "__main__":
    rank()
