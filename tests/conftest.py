"""Shared fixtures. The helpers they use live in tests/support/ (importable without pytest,
so bench/ uses them too); this file puts that directory on sys.path, so test files import
them by module name: ``import fakehost``, ``import proctools as pt``."""

from __future__ import annotations

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

    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "xpuctl"), quiet=1)
