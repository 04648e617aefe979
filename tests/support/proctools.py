"""Helpers for tests that start real processes.

* ``wait_for`` / ``is_gone`` (a zombie counts as gone: PID 1 here does not reap orphans);
* a token-based reaper: everything a test starts carries ``XPUCTL_TEST_TOKEN=<token>`` (and
  ``SPT_NOENV=1`` so setproctitle keeps ``/proc/<pid>/environ`` readable); ``reap_token`` SIGKILLs
  exactly the live processes carrying that token, verified through a pidfd, and nothing else;
* ``StandInRoot``: a root directory with ``proc -> /proc``, plain-file render nodes, ``dev/shm``,
  ``tmp`` and a small xe sysfs tree;
* helpers for the fake vLLM (``tests/fake_vllm/vllm``): ``start_fake_vllm``, ``free_port``,
  ``http_get``/``http_post``, ``holders``, ``read_events``, ``wait_log``.

Importable without pytest (bench/ uses it). The fixtures ``proc_token`` and ``standin_root`` are
in proc_fixtures.py; ``from proctools import proc_token`` still gives them (``__getattr__``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

TOKEN_VAR = "XPUCTL_TEST_TOKEN"
FAKE_VLLM = Path(__file__).resolve().parent.parent / "fake_vllm" / "vllm"


# ---------------------------------------------------------------------------------------------
# waiting and process state


def wait_for(pred: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``pred`` until it is truthy (True) or ``timeout`` seconds pass (False)."""
    end = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the comm, i.e. [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].decode().split()


def proc_state(pid: int) -> str | None:
    """One-letter state (R, S, D, Z, T, ...) or None if the pid does not exist."""
    f = _stat_fields(pid)
    return f[0] if f else None


def is_gone(pid: int) -> bool:
    """True if the process no longer exists or is a zombie (state Z/X)."""
    st = proc_state(pid)
    return st is None or st in ("Z", "X")


def is_alive(pid: int) -> bool:
    return not is_gone(pid)


def ppid_of(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[1]) if f else None


def pgid_of(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[2]) if f else None


def sid_of(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[3]) if f else None


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")] if raw else []


def environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def children_of(pid: int) -> list[int]:
    """Direct children (including zombies)."""
    return [p for p in all_pids() if ppid_of(p) == pid]


def descendants_of(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for p in all_pids():
        pp = ppid_of(p)
        if pp is not None:
            kids.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def holders(path: str | os.PathLike) -> list[int]:
    """PIDs with an open fd on ``path`` (readlink of /proc/*/fd/*)."""
    target = os.path.realpath(path)
    out = []
    for p in all_pids():
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p}/fd/{fd}") == target:
                    out.append(p)
                    break
            except OSError:
                continue
    return out


# ---------------------------------------------------------------------------------------------
# token-based reaper


def new_token() -> str:
    return f"xpt-{uuid.uuid4().hex}"


def token_env(token: str, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for a started process: ``base`` (default os.environ) + token + SPT_NOENV=1."""
    env = dict(os.environ if base is None else base)
    env[TOKEN_VAR] = token
    env["SPT_NOENV"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _has_token(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def _protected() -> set[int]:
    """This process and its ancestors: never signalled, even if a test leaked the token into them."""
    out, p = set(), os.getpid()
    while p and p not in out:
        out.add(p)
        p = ppid_of(p) or 0
    return out


def pids_with_token(token: str, include_zombies: bool = False) -> list[int]:
    needle = f"{TOKEN_VAR}={token}".encode()
    prot = _protected()
    out = []
    for p in all_pids():
        if p in prot:
            continue
        if not include_zombies and is_gone(p):
            continue
        if _has_token(p, needle):
            out.append(p)
    return out


def _signal_if_token(pid: int, needle: bytes, sig: int) -> bool:
    """Send ``sig`` to pid only if it (still) carries the token; identity pinned by a pidfd."""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        pidfd = None
    try:
        # checked after the pidfd is open: the pidfd cannot be re-pointed to a recycled pid
        if not _has_token(pid, needle) or is_gone(pid):
            return False
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)
        return True
    except OSError:
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def reap_token(token: str, timeout: float = 30.0) -> list[int]:
    """SIGCONT + SIGKILL every live non-zombie process carrying the token; wait until gone.

    Rescans until nothing is left (a process may fork while being reaped). Returns the pids
    that were signalled. Zombies are left alone (they are already gone).
    """
    needle = f"{TOKEN_VAR}={token}".encode()
    killed: list[int] = []
    end = time.monotonic() + timeout
    while True:
        pids = pids_with_token(token)
        if not pids:
            return killed
        for p in pids:
            _signal_if_token(p, needle, signal.SIGCONT)
            if _signal_if_token(p, needle, signal.SIGKILL) and p not in killed:
                killed.append(p)
        wait_for(lambda left=pids: all(is_gone(p) for p in left), 2.0, 0.02)
        if time.monotonic() > end:
            left = pids_with_token(token)
            if left:
                raise RuntimeError(f"reap_token: still alive after {timeout}s: {left}")
            return killed


# ---------------------------------------------------------------------------------------------
# stand-in root


class StandInRoot:
    """A root dir R: R/proc -> /proc, R/dev/dri/renderD128.. (plain files), R/dev/shm, R/tmp,
    R/sys/class/drm/renderD12X/{dev, device -> ../../../devices/pci0000:00/<bdf>} and PCI dirs
    with vendor 0x8086, device 0xe20b, driver -> ../../../bus/pci/drivers/xe.

    R is ``tempfile.mkdtemp(prefix="xr", dir="/tmp")`` (short, so unix socket paths under R/tmp
    stay below 108 bytes), whatever ``tmp_path`` is; ``tmp_path`` is accepted for symmetry.
    Device i is renderD(128+i) at BDF 0000:(03+i):00.0.
    """

    VENDOR = "0x8086"
    DEVICE = "0xe20b"
    DRIVER = "xe"

    def __init__(self, tmp_path: str | os.PathLike | None = None, n_devices: int = 2,
                 device_id: str = DEVICE, driver: str = DRIVER,
                 root: str | os.PathLike | None = None):
        """`root`: build it there (an empty or new directory, e.g. for a person trying
        xpuctl: `python tests/support/fakehost.py standin DIR`) instead of a new one."""
        self.tmp_path = tmp_path
        self.n_devices = n_devices
        if root is None:
            self.root = tempfile.mkdtemp(prefix="xr", dir="/tmp")
        else:
            os.makedirs(root, exist_ok=True)
            self.root = os.path.abspath(root)
        R = Path(self.root)
        os.symlink("/proc", R / "proc")
        for d in ("dev/dri", "dev/shm", "tmp", "sys/class/drm", f"sys/bus/pci/drivers/{driver}"):
            (R / d).mkdir(parents=True, exist_ok=True)
        os.chmod(R / "tmp", 0o1777)
        os.chmod(R / "dev/shm", 0o1777)
        for i in range(n_devices):
            minor = 128 + i
            node = R / "dev/dri" / f"renderD{minor}"
            node.touch()
            os.chmod(node, 0o666)
            pci = R / "sys/devices/pci0000:00" / self.bdf(i)
            pci.mkdir(parents=True, exist_ok=True)
            (pci / "vendor").write_text(self.VENDOR + "\n")
            (pci / "device").write_text(device_id + "\n")
            os.symlink(f"../../../bus/pci/drivers/{driver}", pci / "driver")
            cls = R / "sys/class/drm" / f"renderD{minor}"
            cls.mkdir()
            (cls / "dev").write_text(f"226:{minor}\n")
            os.symlink(f"../../../devices/pci0000:00/{self.bdf(i)}", cls / "device")

    @property
    def path(self) -> Path:
        return Path(self.root)

    def node(self, i: int) -> str:
        return os.path.join(self.root, "dev", "dri", f"renderD{128 + i}")

    @staticmethod
    def bdf(i: int) -> str:
        return f"0000:{3 + i:02x}:00.0"

    def shm(self) -> list[str]:
        return sorted(os.listdir(os.path.join(self.root, "dev", "shm")))

    def tmp(self) -> list[str]:
        return sorted(os.listdir(os.path.join(self.root, "tmp")))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> StandInRoot:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __fspath__(self) -> str:
        return self.root

    def __str__(self) -> str:
        return self.root


# ---------------------------------------------------------------------------------------------
# network / HTTP


def read_pty(master: int) -> str:
    """Everything written to the pty whose master side is `master` until its last writer is
    gone (read answers EIO, or nothing), decoded; the master is closed."""
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer of the pty is gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_listening(port: int, host: str = "127.0.0.1") -> bool:
    """True if something accepts TCP connections (vLLM listens before it is ready)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def http_get(url: str, timeout: float = 2.0) -> tuple[int | None, str]:
    """(status, body); status None if no HTTP answer (refused, reset, timeout)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError):
        return None, ""


def http_post(url: str, body: dict, timeout: float = 30.0) -> tuple[int | None, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (OSError, ValueError):
        return None, ""
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def metric(text: str, name: str) -> float | None:
    """Sum of a Prometheus sample over all label sets (None if absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(None, 1)[1])
            seen = True
    return total if seen else None


# ---------------------------------------------------------------------------------------------
# fake vLLM


class FakeVllm:
    """A running fake vLLM started by ``start_fake_vllm``."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, events_path: Path,
                 model: str, token: str):
        self.proc = proc
        self.token = token
        self.pid = proc.pid
        self.port = port
        self.log_path = log_path
        self.events_path = events_path
        self.model = model
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def events(self) -> list[dict]:
        return read_events(self.events_path)

    def wait_ready(self, timeout: float = 60.0) -> bool:
        return wait_for(lambda: http_get(self.url + "/health", 0.5)[0] == 200, timeout, 0.05)

    def tree(self) -> list[int]:
        """Live (non-zombie) descendants of the top process."""
        return [p for p in descendants_of(self.pid) if not is_gone(p)]

    def pids_by_title(self, title_prefix: str) -> list[int]:
        """Live processes carrying this run's token whose cmdline[0] starts with title_prefix."""
        return [p for p in pids_with_token(self.token) if (cmdline(p) or [""])[0].startswith(title_prefix)]


def start_fake_vllm(token: str, root: str | os.PathLike | None, *, port: int | None = None,
                    tp: int = 1, shutdown_timeout: int | None = None, model: str = "fake-model",
                    args: Iterable[str] = (), env: dict[str, str] | None = None,
                    workdir: str | os.PathLike | None = None, python: str | None = None,
                    new_session: bool = True) -> FakeVllm:
    """Start ``python tests/fake_vllm/vllm serve MODEL ...`` with the token in its environment.

    stdout+stderr go to ``<workdir or root>/fake-vllm-<port>.log``; events to ``...-events.jsonl``.
    ``root`` becomes FAKE_VLLM_ROOT (None: the real /). ``python`` defaults to sys.executable.
    """
    port = port or free_port()
    wd = Path(workdir or root or tempfile.gettempdir())
    log_path = wd / f"fake-vllm-{port}.log"
    events_path = wd / f"fake-vllm-{port}-events.jsonl"
    extra = {"FAKE_VLLM_EVENTS": str(events_path)}
    if root is not None:
        extra["FAKE_VLLM_ROOT"] = str(root)
    e = token_env(token, **extra)
    if env:
        e.update(env)
    cmd = [python or sys.executable, str(FAKE_VLLM), "serve", model, "--port", str(port),
           "--tensor-parallel-size", str(tp)]
    if shutdown_timeout is not None:
        cmd += ["--shutdown-timeout", str(shutdown_timeout)]
    cmd += list(args)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, env=e, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=new_session)
    return FakeVllm(proc, port, log_path, events_path, model, token)


def read_events(path: str | os.PathLike) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def wait_log(fv_or_path, text: str, timeout: float = 30.0) -> bool:
    """Wait until ``text`` appears in a FakeVllm's log (or in a log file)."""
    if isinstance(fv_or_path, FakeVllm):
        get = fv_or_path.log
    else:
        p = Path(fv_or_path)
        def get() -> str:
            return p.read_text(errors="replace") if p.exists() else ""
    return wait_for(lambda: text in get(), timeout, 0.05)


def pause_env(marker: str | os.PathLike, step: str) -> dict[str, str]:
    """The variables that make xpuctl pause at `step` (xpuctl/pausepoint.py) and write
    `marker` there: the step, the marker, and the per-run secret, which this writes into the
    arming file beside the marker (0600, ours). Without the arming file and its secret the
    variables do nothing: a production environment never pauses."""
    marker = os.path.abspath(marker)
    key = uuid.uuid4().hex
    arm = f"{marker}.arm"
    fd = os.open(arm, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.encode())
    finally:
        os.close(fd)
    return {"XPUCTL_TEST_PAUSE_AT": step, "XPUCTL_TEST_PAUSE_FILE": marker,
            "XPUCTL_TEST_PAUSE_KEY": key}


def foreign_targets(root: str | os.PathLike, token: str) -> list[int]:
    """The processes `xpuctl --root ROOT reset --yes --kill-holders` would stop today that do
    not carry this test's token: orphaned vLLM trees anywhere on this host (a stand-in root's
    /proc is the real one) and holders of ROOT's devices. A test that runs `reset --yes` on a
    stand-in root outside a private PID namespace calls this first and skips when it is not
    empty: a test never signals what it did not start (a developer's host may hold a real
    orphan)."""
    import json

    out = subprocess.run([sys.executable, "-m", "xpuctl", "--root", str(root), "reset",
                          "--dry-run", "--kill-holders", "--json"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    plan = json.loads(out.stdout)["plan"]
    pids = set(plan["orphan_pids"]) | {h["pid"] for h in plan["holders"] if h["stop"]}
    ours = set(pids_with_token(token, include_zombies=True))
    return sorted(p for p in pids if p not in ours)


def skip_unless_only_ours(root: str | os.PathLike, token: str) -> None:
    """pytest.skip, saying why, when `reset --yes` on ROOT would stop a process this test did
    not start (foreign_targets)."""
    foreign = foreign_targets(root, token)
    if foreign:
        import pytest

        pytest.skip(f"this host has orphaned vLLM processes or holders this test did not "
                    f"start (pids {foreign[:10]}): reset --yes would stop them")


def pidns_available() -> bool:
    """`unshare --pid --fork --mount-proc` works here (root, or user namespaces): tests that
    need a private PID namespace skip without it."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    try:
        p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0


def __getattr__(name: str):
    """``from proctools import proc_token`` (or ``standin_root``): the fixtures live in
    proc_fixtures.py, which needs pytest; they are imported only when asked for."""
    if name in ("proc_token", "standin_root"):
        import proc_fixtures

        return getattr(proc_fixtures, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
