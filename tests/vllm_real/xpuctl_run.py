"""Drive real vLLM through xpuctl itself (`xpuctl serve --detach`, `shutdown`, `doctor`).

XpuctlRun is one `xpuctl serve` run tagged with a unique XPUCTL_TEST_TOKEN in the
environment of the xpuctl process. xpuctl passes its environment to vLLM (and sets
SPT_NOENV=1 itself, which keeps the token readable in retitled EngineCore and workers), so
the token marks the detached supervisor, the API server and everything under it, and only
those. cleanup() SIGKILLs every live process with the token and removes the files the run
provably left (the same rules as env.VllmServer.cleanup).

Every xpuctl command runs in its own session with a deadline; on timeout its group is
SIGKILLed (the detached supervisor leaves that group with setsid: the token catches it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import realvllm

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class XResult:
    """One finished xpuctl command."""

    argv: list[str]
    rc: int | None  # None: timed out (its group was killed)
    stdout: str
    stderr: str
    seconds: float

    @property
    def json(self):
        try:
            return json.loads(self.stdout)
        except ValueError as e:
            raise AssertionError(f"not JSON from {self.describe()}: {e}") from None

    def describe(self, n: int = 2000) -> str:
        return (
            f"$ {' '.join(self.argv[2:])}\n-> rc {self.rc} in {self.seconds:.1f}s\n"
            f"--- stdout (tail)\n{self.stdout[-n:]}\n--- stderr (tail)\n{self.stderr[-n:]}"
        )


def xpuctl_env(token: str) -> dict[str, str]:
    """vLLM's environment (offline HF, 1 GB KV cache) plus the token, but *without*
    SPT_NOENV: setting it is xpuctl's job, and the token is how we check it did."""
    env = realvllm.vllm_env({realvllm.TOKEN_VAR: token})
    env.pop("SPT_NOENV", None)
    env.pop("XPUCTL_STATE_DIR", None)
    env.pop("XPUCTL_ROOT", None)
    return env


def run_xpuctl(args: list[str], env: dict[str, str], timeout: float, out_dir: Path) -> XResult:
    """Run `python -m xpuctl ARGS` from the repo root; output through files (a detached
    child may inherit pipes), group SIGKILLed on timeout."""
    argv = [sys.executable, "-m", "xpuctl", *map(str, args)]
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    out_p, err_p = out_dir / f"xpuctl-{tag}.out", out_dir / f"xpuctl-{tag}.err"
    t0 = time.monotonic()
    with open(out_p, "wb") as out, open(err_p, "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=env, cwd=REPO_ROOT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        except BaseException:  # Ctrl-C: never leave it running
            _kill_group(proc)
            raise
    return XResult(argv, rc, out_p.read_text(errors="replace"),
                   err_p.read_text(errors="replace"), time.monotonic() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
    # our unreaped child leads its own session: the group id cannot be reused yet
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def in_flight(base_url: str) -> int | None:
    """vllm:num_requests_running + vllm:num_requests_waiting from /metrics."""
    try:
        status, text = realvllm.http_json(base_url + "/metrics", timeout=2.0)
    except OSError:
        return None
    if status != 200 or not isinstance(text, str):
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(None, 1)[1])
                seen = True
    return int(total) if seen else None


@dataclass
class XpuctlRun:
    venv: Path
    model: Path
    work: Path  # per-test directory: state dir and command output live here
    port: int = 0
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    shm_seen: set[str] = field(default_factory=set)
    sockets_seen: set[str] = field(default_factory=set)
    serve_result: XResult | None = None

    def __post_init__(self) -> None:
        if not self.port:
            self.port = realvllm.free_port()
        self.state_dir = self.work / "state"
        self.env = xpuctl_env(self.token)

    # -- names ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"vllm-{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def record_path(self) -> Path:
        return self.state_dir / "runs" / f"{self.name}.json"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "logs" / f"{self.name}.log"

    # -- commands ------------------------------------------------------------------------
    def xpuctl(self, *args: object, timeout: float = 300.0) -> XResult:
        return run_xpuctl([str(a) for a in args], self.env, timeout, self.work / "cmd")

    def serve_argv(self, drain: float = 10, teardown: float = 10, ready: float = 600,
                   vllm_args: tuple[str, ...] = (), opts: tuple[str, ...] = (),
                   detach: bool = True) -> list[str]:
        """`opts`: more of serve's own options (before MODEL). Always `--force`: serve's
        preflight doctor reads the whole host, and another session's vLLM tree on a shared
        machine (orphans its own test left for a moment) must not refuse this run; the
        preflight is tested on its own (tests/test_serve_preflight.py)."""
        vllm = f"{realvllm.venv_python(self.venv)} -m vllm.entrypoints.openai.api_server --model"
        force = [] if "--force" in opts else ["--force"]
        return [
            "serve", "--vllm", vllm, "--state-dir", str(self.state_dir),
            "--drain-timeout", f"{drain:g}", "--teardown-timeout", f"{teardown:g}",
            "--ready-timeout", f"{ready:g}", *(["--detach"] if detach else []), *force, *opts,
            str(self.model), "--port", str(self.port), *realvllm.vllm_flags(), *vllm_args,
        ]

    def serve_foreground(self, **kw) -> subprocess.Popen:
        """`xpuctl serve` in the foreground, left running (its output in files under
        work/cmd): the test waits for it and reads its exit status."""
        argv = [sys.executable, "-m", "xpuctl", *self.serve_argv(detach=False, **kw)]
        out_dir = self.work / "cmd"
        out_dir.mkdir(parents=True, exist_ok=True)
        self.fg_err = out_dir / "serve-fg.err"
        with open(out_dir / "serve-fg.out", "wb") as out, open(self.fg_err, "wb") as err:
            self.fg = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                       env=self.env, cwd=REPO_ROOT, start_new_session=True)
        self.start_noting()
        return self.fg

    def fg_stderr(self) -> str:
        try:
            return self.fg_err.read_text(errors="replace")
        except (OSError, AttributeError):
            return ""

    def serve(self, timeout: float = 660.0, extra_env: dict[str, str] | None = None,
              **kw) -> XResult:
        """`xpuctl serve --detach`; while it waits, note the files the tree binds
        (the start-up handshake sockets are bound only until ready). `extra_env`: for serve
        and its supervisor only (a pause point), never for the test's other commands."""
        argv = [sys.executable, "-m", "xpuctl", *self.serve_argv(**kw)]
        out_dir = self.work / "cmd"
        out_dir.mkdir(parents=True, exist_ok=True)
        out_p, err_p = out_dir / "serve.out", out_dir / "serve.err"
        t0 = time.monotonic()
        self.start_noting()
        with open(out_p, "wb") as out, open(err_p, "wb") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    env={**self.env, **(extra_env or {})}, cwd=REPO_ROOT,
                                    start_new_session=True)
            rc: int | None = None
            try:
                while True:
                    try:
                        rc = proc.wait(timeout=0.5)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    with contextlib.suppress(Exception):
                        self.note_artifacts()
                    if time.monotonic() - t0 > timeout:
                        break
            finally:
                if rc is None:
                    _kill_group(proc)
        with contextlib.suppress(Exception):
            self.note_artifacts()
        self.serve_result = XResult(argv, rc, out_p.read_text(errors="replace"),
                                    err_p.read_text(errors="replace"), time.monotonic() - t0)
        return self.serve_result

    def wait_fg_ready(self, timeout: float = 600.0) -> dict:
        """The foreground serve's record once it says ready (vLLM on a slow machine: up to
        `timeout`); fails with serve's stderr and the log when it never does."""

        def state() -> str | None:
            try:
                return self.record()["state"]
            except (OSError, ValueError):
                return None

        end = time.monotonic() + timeout
        while time.monotonic() < end and state() != "ready" and self.fg.poll() is None:
            time.sleep(0.2)
        assert state() == "ready", (f"serve did not come up (rc {self.fg.poll()}):\n"
                                    f"{self.fg_stderr()[-3000:]}\n--- log\n{self.log_tail()}")
        return self.record()

    # -- what the run is made of ---------------------------------------------------------
    def record(self) -> dict:
        return json.loads(self.record_path.read_text())

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().rstrip().splitlines()[-n:])

    def tree(self) -> list[realvllm.ProcInfo]:
        """Live processes carrying our token (supervisor included; zombies never)."""
        return realvllm.tree_with_token(self.token)

    def parts(self) -> dict[str, list[realvllm.ProcInfo]]:
        return realvllm.by_title(self.tree())

    def describe_tree(self) -> str:
        return "\n".join(f"  {p.pid} ppid={p.ppid} {p.state} {p.cmdline[:100]}"
                         for p in self.tree()) or "  (none)"

    def note_artifacts(self) -> None:
        """The files our live tree holds or binds, noted by inode (realvllm.files_of_tree)."""
        shm, sockets = realvllm.files_of_tree([p.pid for p in self.tree()])
        self.shm_seen |= shm
        self.sockets_seen |= sockets

    def start_noting(self) -> None:
        """Note the run's files every half second until cleanup (realvllm.Noter)."""
        if getattr(self, "_noter", None) is None:
            self._noter = realvllm.Noter(self.note_artifacts)

    def dist_files(self) -> set[str]:
        return set(re.findall(r"distributed_init_method=file://(/tmp/vllm_dist_[0-9A-Za-z_]+)",
                              self.log_text()))

    def wait_gone(self, timeout: float) -> tuple[bool, float]:
        return realvllm.wait_token_gone(self.token, timeout)

    # -- teardown ------------------------------------------------------------------------
    def cleanup(self) -> realvllm.Cleanup:
        """SIGKILL whatever still carries our token (tracker last), then remove the
        files this run left: shm it held (once nobody holds it), ZMQ sockets it bound
        (once unbound), the FileStore its log names."""
        noter = getattr(self, "_noter", None)
        if noter is not None:
            noter.stop()
        with contextlib.suppress(Exception):
            self.note_artifacts()
        killed = realvllm.kill_token_tracker_last(self.token)
        held = set(realvllm.shm_files_open_by(realvllm._all_pids(), prefix="/dev/shm/"))
        removed = realvllm.remove_ours((self.shm_seen - held) | self.sockets_seen)
        # the FileStore our log names (opened only during set-up: never seen held)
        removed += [p for p in sorted(self.dist_files()) if realvllm.remove_if_stale(p)]
        return realvllm.Cleanup(killed, removed)
