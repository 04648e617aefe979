"""Shared fixtures. The helpers they use live in tests/support/ (importable without pytest,
so bench/ uses them too); this file puts that directory on sys.path, so test files import
them by module name: ``import fakehost``, ``import proctools as pt``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from proc_fixtures import proc_token, rig, standin_root  # noqa: F401 (fixtures for every test)


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path, monkeypatch):
    """Commands that write to the state directory (reset and shutdown append to its audit
    log) never touch the real one (/run/xpuctl, $XDG_RUNTIME_DIR/xpuctl) from a test."""
    monkeypatch.setenv("XPUCTL_STATE_DIR", str(tmp_path / "xpuctl-state"))


@pytest.fixture(autouse=True)
def _close_readers():
    """Each Host keeps a reader process (xpuctl/host/reads/caller.py) until it is collected; hosts
    made in this process (CliRunner, direct calls) can wait for a full garbage collection.
    Close them after each test, so idle readers do not pile up over a run."""
    yield
    from xpuctl.host.reads import caller as reader

    reader.close_all()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile xpuctl's modules once, as an installed package has them: most tests run
    xpuctl as a subprocess, and where PYTHONDONTWRITEBYTECODE is set (this environment sets
    it) each run would compile every module it imports from source. On a loaded machine that
    took 8 s of a shutdown's 12 s to its first SIGTERM, and the drain test's requests were
    done before it. Python reads these .pyc files whether or not it may write them."""
    import compileall
    import time

    import leftovers

    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "xpuctl"), quiet=1)
    # the session-wide check of /dev/shm and /tmp (tests/support/leftovers.py)
    session.config.stash[_LEFT] = (leftovers.snapshot(), time.time())
    leftovers.sample_other_sessions(every=0.0)


_LEFT = pytest.StashKey[tuple[dict[str, tuple[int, int]], float]]()
_REPORT = pytest.StashKey[object]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    import leftovers

    leftovers.sample_other_sessions()  # at most every 30 s: who else runs tests here


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when it left files of a known stale kind in /dev/shm or /tmp (issue 38
    §5): every tier removes what its processes made; this is the net under them."""
    import leftovers

    start = session.config.stash.get(_LEFT, None)
    if start is None or os.environ.get("XPUCTL_TESTS_NO_LEFTOVER_CHECK") == "1":
        return
    report = leftovers.compare(*start)
    session.config.stash[_REPORT] = report
    if report.failed and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    report = config.stash.get(_REPORT, None)
    if report is None or not report.lines():
        return
    terminalreporter.section("files left in /dev/shm and /tmp", sep="=",
                             red=report.failed, yellow=not report.failed)
    for line in report.lines():
        terminalreporter.write_line(line)
