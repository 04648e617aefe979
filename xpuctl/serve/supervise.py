"""serve: launch vLLM with a forced drain timeout and supervise it.

The supervisor (this process, or a detached child of it) is a child subreaper; vLLM runs in
a new session with SIGTERM as its parent-death signal, `XPUCTL_RUN_ID` and `SPT_NOENV=1` in
its environment, output streamed to the terminal and a log file, and a run record in the
state directory. Readiness has a deadline vLLM itself lacks.
"""

from __future__ import annotations

import collections
import glob
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from xpuctl.host import http
from xpuctl.output import progress
from xpuctl.errors import ExitCode, UsageError, XpuctlError
from xpuctl.host.seam import Host
from xpuctl.host.devices import scan_devices, select_devices
from xpuctl.state.runs import Locks, RunRecord, ensure_state_dir, list_records, update_record
from xpuctl.output.safetext import safe
from xpuctl.actions.signals import (
    EXITED,
    become_subreaper,
    can_signal,
    reap_children,
    set_parent_death_signal,
    target_of,
)

MIN_SHUTDOWN_TIMEOUT = 5
FLAG_VERSION = (0, 18)  # first vLLM with --shutdown-timeout
DEFAULT_VLLM = "vllm serve"
_VERSION_RE = re.compile(r"^(vllm(?:[_-][a-z]+)?)-(\d+(?:\.\d+)*)[^/]*\.dist-info$", re.IGNORECASE)
READY_POLL = 0.1  # seconds between readiness probes
READY_PROBE_TIMEOUT = 0.3  # one probe of /health (and /v1/models)


@dataclass
class ServeOptions:
    model: str
    vllm_args: list[str]
    vllm_cmd: str = DEFAULT_VLLM
    drain_timeout: float = 30.0
    teardown_timeout: float = 20.0
    allow_abort: bool = False
    devices: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    force: bool = False
    name: str | None = None
    state_dir: str = ""
    ready_timeout: float = 900.0
    detach: bool = False
    kill_after: float = 10.0
    deep_preflight: object | None = None  # doctor.DeepOptions: `--preflight deep`
    quiet: bool = False
    port: int | None = None  # --port/--host given before MODEL (passed on to vLLM once)
    host: str | None = None


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    notes: list[str]
    port: int
    bind: str | None
    bdfs: list[str]
    shutdown_timeout: int | None
    version: str | None


# -- planning (pure-ish) ------------------------------------------------------------------


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _interpreter(cmd: list[str]) -> str | None:
    exe = shutil.which(cmd[0]) if cmd else None
    if exe is None:
        return None
    if re.match(r"^python[\d.]*$", os.path.basename(exe)):
        return exe
    try:
        with open(exe, "rb") as fh:
            first = fh.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    if not parts:
        return None
    if os.path.basename(parts[0]) == "env" and len(parts) > 1:
        return shutil.which(parts[1])
    return parts[0]


def vllm_version(cmd: list[str]) -> str | None:
    """vLLM's version from the package metadata beside the interpreter that runs `cmd`.

    No import of vllm (seconds, and it may initialise the GPU): just the dist-info name.
    """
    interp = _interpreter(cmd)
    if interp is None:
        return None
    prefix = os.path.dirname(os.path.dirname(interp))
    for pattern in ("lib/python3*/site-packages/vllm*.dist-info", "lib/python3*/dist-packages/vllm*.dist-info"):
        for path in sorted(glob.glob(os.path.join(prefix, pattern))):
            m = _VERSION_RE.match(os.path.basename(path))
            if m:
                return m.group(2)
    return None


def _parse_env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise UsageError(f"--env {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _strip_flag(args: list[str], flag: str) -> tuple[list[str], str | None, bool]:
    """Remove `flag N`/`flag=N` (also the _ spelling) from args: (rest, value, found)."""
    names = {flag, flag.replace("-", "_").replace("__", "--")}
    rest: list[str] = []
    value = None
    found = False
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, val = arg.partition("=")
        if key in names:
            found = True
            if eq:
                value = val
            elif i + 1 < len(args):
                value = args[i + 1]
                i += 1
            i += 1
            continue
        rest.append(arg)
        i += 1
    return rest, value, found


def _merge_shared(args: list[str], flag: str, before: str | None) -> list[str]:
    """vLLM's args with `flag` given before MODEL passed on exactly once.

    Given after MODEL only: kept as it is. Before only: put first after MODEL. Both: one
    value (the caller's spelling after MODEL stays), or a usage error when they differ."""
    if before is None:
        return args
    _, after, found = _strip_flag(args, flag)
    if not found:
        return [flag, before, *args]
    same = after == before or (after or "").isdigit() and before.isdigit() and int(after or 0) == int(before)
    if not same:
        raise UsageError(f"{flag} {before} before MODEL and {flag} {after} after it disagree: give it once")
    return args


def plan_launch(opts: ServeOptions, host: Host, environ: dict[str, str], run_id: str) -> LaunchPlan:
    from xpuctl.shutdown.ladder import port_from_argv

    vllm_args = _merge_shared(list(opts.vllm_args), "--port", None if opts.port is None else str(opts.port))
    vllm_args = _merge_shared(vllm_args, "--host", opts.host)
    cmd = shlex.split(opts.vllm_cmd)
    if not cmd:
        raise UsageError("--vllm is empty")
    if shutil.which(cmd[0]) is None:
        raise UsageError(f"--vllm: {cmd[0]!r} not found on PATH")
    notes: list[str] = []
    version = vllm_version(cmd)
    supports_flag = version is None or _version_tuple(version) >= FLAG_VERSION
    args, given, had_flag = _strip_flag(vllm_args, "--shutdown-timeout")
    # whole seconds for vLLM, rounded up: never less than what was asked
    wanted = max(MIN_SHUTDOWN_TIMEOUT, math.ceil(opts.drain_timeout + opts.teardown_timeout))
    shutdown_timeout: int | None = wanted
    if had_flag:
        if given is None or not given.isdigit():
            raise UsageError(f"--shutdown-timeout {given!r}: expected whole seconds")
        n = int(given)
        if n == 0 and opts.allow_abort:
            shutdown_timeout = 0
            notes.append("--shutdown-timeout 0 kept (--allow-abort): in-flight requests are aborted")
        elif n == 0:
            notes.append(
                f"replaced --shutdown-timeout 0 (abort) with {wanted}s: on XPU an abort skips Level "
                "Zero/oneCCL teardown and the next server hangs (use --allow-abort to keep it)"
            )
        elif n < MIN_SHUTDOWN_TIMEOUT:
            notes.append(f"raised --shutdown-timeout {n} to the {MIN_SHUTDOWN_TIMEOUT}s minimum")
            shutdown_timeout = MIN_SHUTDOWN_TIMEOUT
        else:
            shutdown_timeout = n
    if not supports_flag:
        notes.append(
            f"vLLM {version} predates --shutdown-timeout (0.18): not passing it; shutdown waits "
            "for idle before signalling"
        )
        shutdown_timeout = None
    argv = [*cmd, opts.model, *args]
    if shutdown_timeout is not None:
        argv += ["--shutdown-timeout", str(shutdown_timeout)]
    port, bind = port_from_argv(args)
    port = port or 8000

    devices, _ = scan_devices(host)
    env = dict(environ)
    bdfs: list[str] = []
    if opts.devices:
        specs = [s for item in opts.devices for s in item.split(",") if s.strip()]
        chosen = select_devices(devices, specs)
        for d in chosen:
            if not d.is_intel or d.index is None:
                raise UsageError(f"device {d.bdf} is not an Intel GPU (vendor {d.vendor_id})")
        bdfs = [d.bdf for d in chosen]
        env["ZE_AFFINITY_MASK"] = ",".join(str(d.index) for d in chosen)
    else:
        bdfs = [d.bdf for d in devices if d.is_intel]
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env.update(_parse_env(opts.env))
    env["XPUCTL_RUN_ID"] = run_id
    env["SPT_NOENV"] = "1"  # keep environ readable after setproctitle (the run tag!)
    if host.root:
        env["XPUCTL_ROOT"] = host.root
    return LaunchPlan(argv, env, notes, port, bind, bdfs, shutdown_timeout, version)


# -- supervision --------------------------------------------------------------------------


class _Pump(threading.Thread):
    """Copy vLLM's output to the log file, keeping the last lines, and hand each line to
    `on_line` (the start-up tracker) and `echo` (foreground: the terminal)."""

    def __init__(self, stream, log_path: str, on_line: Callable[[str], None],
                 echo: Callable[[str], None] | None) -> None:
        super().__init__(daemon=True, name="xpuctl-log")
        self.stream = stream
        self.log = open(log_path, "ab", buffering=0)  # noqa: SIM115
        self.on_line = on_line
        self.echo = echo
        self.tail: collections.deque[str] = collections.deque(maxlen=200)

    def run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            if not raw.endswith(b"\n"):
                raw += b"\n"
            try:
                self.log.write(raw)
            except OSError:
                pass
            text = raw.decode("utf-8", "surrogateescape").rstrip("\n")
            self.tail.append(text)
            if self.echo is not None:  # the log keeps the exact bytes; the terminal, escapes
                self.echo(text)
            self.on_line(text)
        self.log.close()


class _Interrupted(Exception):
    pass


class Supervisor:
    """One run from launch to exit, in named steps: `launch`, `wait_ready` (the start shown
    as it happens; a readiness deadline), then `not_ready` (diagnose, stop with the teardown
    budget, advise) or `watch` (until vLLM exits or a signal asks for a stop)."""

    def __init__(self, host: Host, opts: ServeOptions, plan: LaunchPlan, rec: RunRecord,
                 state_dir: str, view: progress.View, foreground: bool) -> None:
        self.host = host
        self.opts = opts
        self.plan = plan
        self.rec = rec
        self.state_dir = state_dir
        self.view = view
        self.foreground = foreground
        self.signals = 0
        self.proc: subprocess.Popen | None = None
        self.pump: _Pump | None = None
        self.t0 = time.monotonic()
        self.tracker = progress.Tracker(self.t0)
        self.track_lock = threading.Lock()
        self.ready = False

    def say(self, msg: str) -> None:
        self.view.say(msg)

    def _set(self, **changes) -> None:
        update_record(self.state_dir, self.rec, **changes)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self.signals += 1
        if self.signals >= 2:
            raise _Interrupted()

    def _on_line(self, line: str) -> None:
        if self.ready:
            return
        with self.track_lock:
            changed = self.tracker.feed(line, time.monotonic())
        if changed is not None:
            self.view.phase(time.monotonic() - self.t0, changed.label)
        self.view.line(line)

    # -- steps ----------------------------------------------------------------------------

    def launch(self) -> None:
        become_subreaper()
        self.t0 = self.tracker.t0 = self.tracker.since = time.monotonic()
        self.proc = subprocess.Popen(
            self.plan.argv,
            env=self.plan.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=set_parent_death_signal,  # noqa: PLW1509 (no threads yet)
            close_fds=True,
        )
        self.pump = _Pump(self.proc.stdout, self.rec.log_path, self._on_line,
                          self.view.echo if self.foreground else None)
        self.pump.start()
        t = target_of(self.host, self.proc.pid)
        self._set(pid=self.proc.pid, start_ticks=t.start_ticks if t else None,
                  session=self.proc.pid, started_at=time.time(), state="starting")
        self.say(f"xpuctl: started {self.rec.name} (pid {self.proc.pid}, run {self.rec.run_id}), "
                 f"log {self.rec.log_path}")

    def wait_ready(self) -> str | int:
        """"ready", "signal", "timeout", or vLLM's exit code when it exited first.

        /health is probed every POLL seconds with a short timeout: vLLM binds its port
        before the engine starts and answers once it is up, so readiness is noticed within
        about POLL + one probe of /health first answering."""
        deadline = self.t0 + self.opts.ready_timeout
        local = http.local_host(self.plan.bind)
        while True:
            code = self.exit_code()
            if code is not None:
                return code
            if self.signals:
                return "signal"
            if http.ready(local, self.plan.port, READY_PROBE_TIMEOUT):
                return "ready"
            if time.monotonic() >= deadline:
                return "timeout"
            self.view.tick()
            time.sleep(READY_POLL)

    def became_ready(self) -> None:
        now = time.monotonic()
        with self.track_lock:
            self.tracker.ready(now)
            summary = self.tracker.summary()
        self.ready = True
        self._set(state="ready", ready_at=time.time())
        url = f"http://{http.local_host(self.plan.bind)}:{self.plan.port}"
        took = f"after {now - self.t0:.1f}s"
        if self.foreground:  # the wording scripts and units already look for, per mode
            self.view.ready(f"xpuctl: ready on {url} {took} ({self.rec.name}: {summary})")
        else:
            self.view.ready(f"xpuctl: {self.rec.name} is ready on port {self.plan.port} ({url}) "
                            f"{took}: {summary}")

    def watch(self) -> int:
        """Supervise a ready server until vLLM exits or a signal asks for a stop."""
        while True:
            code = self.exit_code()
            if code is not None:
                return self._after_exit(code, requested=False, ready=True)
            if self.signals:
                return self._stop_on_signal()
            time.sleep(0.2)

    def run(self) -> int:
        """Supervise until vLLM is gone. Returns the exit code for xpuctl."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.launch()
        outcome = self.wait_ready()
        if outcome == "ready":
            self.became_ready()
            self.end("ready")
            return self.watch()
        self.view.finish()  # no status line over the diagnosis or the stop timeline
        if outcome == "signal":
            return self._stop_on_signal()
        if outcome == "timeout":
            return self.not_ready()
        assert isinstance(outcome, int)
        return self._after_exit(outcome, requested=False, ready=False)

    def end(self, status: str) -> None:
        """Tell a waiting `serve --detach` how the start ended (nothing in the foreground)."""
        if isinstance(self.view, progress.PipeSink):
            self.view.end(status)

    # -- helpers --------------------------------------------------------------------------

    def exit_code(self) -> int | None:
        assert self.proc is not None
        reap_children()
        code = EXITED.get(self.proc.pid)
        if code is not None:
            self.proc.returncode = code  # we reaped it, not Popen
        return code

    def _tree(self):
        from xpuctl.shutdown.ladder import Tree
        from xpuctl.actions.signals import Target

        assert self.proc is not None
        top = Target(self.proc.pid, self.rec.start_ticks or 0, "api-server")
        return Tree(top=top, role="api-server", orphan=False, run_id=self.rec.run_id,
                    session=self.rec.session, devices=tuple(self.plan.bdfs), port=self.plan.port,
                    bind=self.plan.bind, shutdown_timeout=self.plan.shutdown_timeout,
                    log_path=self.rec.log_path, record=self.rec, known=[top],
                    never_ready=not self.ready)

    def _show(self, ev) -> None:
        self.say(f"xpuctl: {ev.t:7.2f}s {ev.phase:<17} {safe(ev.detail)}")

    def stop_tree(self):
        """The ladder on our own tree. A server that never became ready has nothing to
        drain: the tree gets the teardown budget only (Tree.never_ready)."""
        from xpuctl.shutdown.ladder import stop

        self._set(state="stopping")
        try:
            return stop(self.host, [self._tree()], kill_after=self.opts.kill_after,
                        release_timeout=self.opts.teardown_timeout, on_event=self._show)
        except _Interrupted:
            self.say("xpuctl: second interrupt: killing the tree now")
            return stop(self.host, [self._tree()], kill_after=0,
                        release_timeout=self.opts.teardown_timeout, on_event=self._show,
                        skip_drain=True)

    def _stop_on_signal(self) -> int:
        self.say("xpuctl: stopping (signal received; press Ctrl-C again to kill)")
        result = self.stop_tree()
        code = self._after_stop(result)
        self.end(f"exit {int(code)}")
        return code

    def not_ready(self) -> int:
        """Readiness timeout: diagnose (on the terminal and in the log), stop with the
        teardown budget, and say what to try before the next launch."""
        from xpuctl.core import advice
        from xpuctl.parse.vllmlog import hang_signatures

        assert self.pump is not None
        lines = list(self.pump.tail)
        with self.track_lock:
            phase = self.tracker.phase
        where = phase.label if phase.rank else "an unknown phase (no start-up line recognised)"
        self.say(f"xpuctl: {self.rec.name}: not ready after {self.opts.ready_timeout:g}s; "
                 f"stuck in: {where}" + (f": {phase.hint}" if phase.hint else ""))
        for line in lines[-10:]:
            self.say(f"xpuctl:   | {safe(line, 300)}")
        try:
            from xpuctl.doctor import diagnose

            report = diagnose(self.host, self.plan.bdfs or None, None)
            for f in report.findings:
                if f.severity != "info":
                    self.say(f"xpuctl:   doctor {f.severity} {f.check}: {safe(f.message)}")
        except XpuctlError:
            pass
        self._set(notes=[*self.rec.notes,
                         f"not ready after {self.opts.ready_timeout:g}s: {phase.label}"])
        self.stop_tree()
        self._set(state="failed", exit_code=int(ExitCode.NOT_READY), stopped_at=time.time())
        keys = ["not-ready"] + [s.key for s in hang_signatures(lines, ever_ready=False)]
        self.say("xpuctl: before the next launch, try (advice only; each has a cost):")
        for line in advice.lines(keys):
            self.say(f"xpuctl:   - {line}")
        self.end(f"failed {int(ExitCode.NOT_READY)}")
        return ExitCode.NOT_READY

    def _after_stop(self, result) -> int:
        code = self.exit_code()
        leftovers = result.verdict == "leftovers"
        self._set(state="stopped" if not leftovers else "failed", exit_code=code, stopped_at=time.time())
        self.say(f"xpuctl: stopped: {result.verdict}")
        return ExitCode.PROBLEMS if leftovers else ExitCode.OK

    def _after_exit(self, code: int, requested: bool, ready: bool) -> int:
        from xpuctl.shutdown.ladder import stop

        self.say(f"xpuctl: vLLM exited with code {code}")
        if self.pump is not None:
            self.pump.join(timeout=0.5)  # orphans may keep the pipe open
        # its tree should follow; whatever carries our run id and stays is a leftover.
        # When `xpuctl shutdown` is stopping the run, it owns the ladder: only watch.
        from xpuctl.state.runs import read_record

        def someone_else() -> bool:
            disk = read_record(self.state_dir, self.rec.name)
            return bool(disk and disk.run_id == self.rec.run_id and disk.state == "stopping")

        passive = someone_else()

        result = stop(self.host, [self._tree()], timeout=self.opts.teardown_timeout,
                      kill_after=self.opts.kill_after, release_timeout=self.opts.teardown_timeout,
                      on_event=lambda ev: self._show(ev) if ev.phase not in ("gone", "drain") else None,
                      passive=passive, yield_to=someone_else)
        leftovers = result.verdict != "clean"
        requested = requested or passive
        self._set(state="failed" if ((code != 0 and not requested) or leftovers) else "stopped",
                  exit_code=code,
                  stopped_at=time.time())
        if not ready:
            self.end(f"exit {code}")
        if code < 0:
            code = 128 - code
        if leftovers and code == 0:
            return ExitCode.PROBLEMS
        return code


# -- serve: plan, preflight, claim, then supervise here or in a detached child -------------


class _Prepared(NamedTuple):
    state_dir: str
    plan: LaunchPlan
    rec: RunRecord
    keys: list[str]


def _prepare(host: Host, opts: ServeOptions, environ: dict[str, str], out: Callable[[str], None],
             show_findings: Callable[[object], None]) -> _Prepared:
    """Plan the launch, check the name, run the preflight doctor; the record to write."""
    if not can_signal(host):
        raise UsageError("serve needs the live /proc (a root whose proc is the real /proc)")
    state_dir = ensure_state_dir(opts.state_dir)
    run_id = uuid.uuid4().hex[:16]
    plan = plan_launch(opts, host, environ, run_id)
    for note in plan.notes:
        out(f"xpuctl: note: {note}")
    name = opts.name or f"vllm-{plan.port}"
    if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", name):
        raise UsageError(f"--name {name!r}: use letters, digits, '.', '_' or '-'")
    if not opts.force:
        from xpuctl.doctor import diagnose

        report = diagnose(host, plan.bdfs or None, plan.port, caller_env=plan.env,
                          deep=opts.deep_preflight)  # type: ignore[arg-type]
        if report.failed:
            show_findings(report)
            raise XpuctlError(
                "preflight failed: the devices or port are not clean (fix the findings above, "
                "e.g. `xpuctl reset`, or start anyway with --force)"
            )
    log_path = os.path.join(state_dir, "logs", f"{name}.log")
    rec = RunRecord(name=name, run_id=run_id, pid=None, start_ticks=None, session=None,
                    command=plan.argv, devices=plan.bdfs, port=plan.port, host=plan.bind or "127.0.0.1",
                    shutdown_timeout=plan.shutdown_timeout, drain_timeout=opts.drain_timeout,
                    teardown_timeout=opts.teardown_timeout, log_path=log_path,
                    notes=list(plan.notes))
    keys = [f"run-{name}", f"port-{plan.port}"] + [f"device-{b}" for b in plan.bdfs]
    return _Prepared(state_dir, plan, rec, keys)


def _run_foreground(host: Host, opts: ServeOptions, p: _Prepared, view: progress.View) -> int:
    locks = Locks(p.state_dir)
    locks.acquire(p.keys, f"{p.rec.name} pid {os.getpid()}")
    p.rec.supervisor_pid = os.getpid()
    try:
        return Supervisor(host, opts, p.plan, p.rec, p.state_dir, view, foreground=True).run()
    finally:
        locks.release()


def _run_detached(host: Host, opts: ServeOptions, p: _Prepared, view: progress.View) -> int:
    """A supervisor child keeps running; this process shows its start (through a pipe) and
    returns once it is ready or failed.

    The locks are taken here and inherited: flock belongs to the open file, which the child
    shares, so there is no moment where another run could slip in."""
    name, log_path = p.rec.name, p.rec.log_path
    locks = Locks(p.state_dir)
    locks.acquire(p.keys, f"{name} (starting)")
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # supervisor
        os.close(rfd)
        code = 1

        def log(msg: str) -> None:
            try:
                with open(log_path, "a") as fh:
                    fh.write(msg + "\n")
            except OSError:
                pass

        sink = progress.PipeSink(wfd, log)
        try:
            os.setsid()
            locks.relabel(f"{name} pid {os.getpid()}")
            p.rec.supervisor_pid = os.getpid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            code = Supervisor(host, opts, p.plan, p.rec, p.state_dir, sink, foreground=False).run()
            sink.end(f"exit {code}")
        except BaseException as exc:  # noqa: BLE001
            log(f"xpuctl: supervisor error: {exc}")
            sink.end(f"error {exc}")
        finally:
            os._exit(int(code) if isinstance(code, int) else 1)
    os.close(wfd)
    locks.release()  # our copies only: the supervisor's keep the locks
    view.say(f"xpuctl: {name}: supervisor {pid}, log {log_path}; waiting for readiness "
             f"(up to {opts.ready_timeout:g}s)")
    try:
        msg = progress.replay(rfd, view)
    finally:
        os.close(rfd)
        view.finish()
    if msg == "ready":
        return ExitCode.OK
    if msg.startswith("failed"):
        view.say(f"xpuctl: {name} was not ready in time; stopped (see {log_path})")
        return ExitCode.NOT_READY
    if msg.startswith("exit"):
        code = int(msg.split()[1])
        view.say(f"xpuctl: {name} exited before it was ready (code {code}); see {log_path}")
        return code or ExitCode.PROBLEMS
    view.say(f"xpuctl: {name}: supervisor failed: {msg or 'no answer'}; see {log_path}")
    return ExitCode.PROBLEMS


def serve(host: Host, opts: ServeOptions, environ: dict[str, str], out: Callable[[str], None],
          show_findings: Callable[[object], None], view: progress.View | None = None) -> int:
    prepared = _prepare(host, opts, environ, out, show_findings)
    if view is None:
        view = progress.choose(sys.stderr, prepared.rec.name, quiet=opts.quiet)
    if opts.detach:
        return _run_detached(host, opts, prepared, view)
    return _run_foreground(host, opts, prepared, view)


#: seconds serve may take to notice a signal (its loop polls; a readiness probe waits 0.3 s)
NOTICE_SECONDS = 2.0


def worst_stop_seconds(drain_timeout: float, teardown_timeout: float, kill_after: float) -> float:
    """The longest a foreground serve can take from a SIGTERM to its own exit.

    What a supervisor's stop timeout (systemd `TimeoutStopSec`, Kubernetes
    `terminationGracePeriodSeconds`) must exceed, or it SIGKILLs vLLM in the middle of the
    Level Zero/oneCCL teardown this whole tool exists to protect. The steps of
    `Supervisor.stop_tree` -> `stop.stop`: notice the signal; wait for the tree up to vLLM's
    shutdown timeout + the drain margin; SIGTERM survivors and wait `kill_after`; SIGKILL and
    wait; wait up to the teardown timeout for the devices and port to be released.
    """
    from xpuctl.shutdown.ladder import DRAIN_MARGIN, KILL_WAIT

    vllm_deadline = max(MIN_SHUTDOWN_TIMEOUT, math.ceil(drain_timeout + teardown_timeout))
    return NOTICE_SECONDS + vllm_deadline + DRAIN_MARGIN + kill_after + KILL_WAIT + teardown_timeout


def active_records(state_dir: str) -> list[RunRecord]:
    return [r for r in list_records(state_dir) if r.state in ("starting", "ready", "stopping")]


class RunRow(NamedTuple):
    """One run for `xpuctl ps`: its record's state and its age."""

    name: str
    state: str  # starting | ready | stopping
    age_seconds: float | None  # since launch
    pid: int | None
    port: int
    devices: tuple[str, ...]
    run_id: str


def live_runs(host: Host, state_dir: str) -> list[RunRow]:
    """The records that say starting, ready or stopping and whose API server or supervisor
    still runs (a record left by a killed supervisor is not a run)."""
    from xpuctl.host.processes import stat_of

    def alive(pid: int | None, ticks: int | None = None) -> bool:
        st = stat_of(host, pid) if pid else None
        return st is not None and st.state != "Z" and (ticks is None or st.start_ticks == ticks)

    now = time.time()
    out = []
    for r in active_records(state_dir):
        if not (alive(r.pid, r.start_ticks) or alive(r.supervisor_pid)):
            continue
        age = now - r.started_at if r.started_at else None
        out.append(RunRow(r.name, r.state, age, r.pid, r.port, tuple(r.devices), r.run_id))
    return out
