"""Shared fixtures: process reaping by token and stand-in roots live in proctools."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from proctools import proc_token, standin_root  # noqa: E402,F401

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path, monkeypatch):
    """Commands that write to the state directory (reset and shutdown append to its audit
    log) never touch the real one (/run/xpuctl, $XDG_RUNTIME_DIR/xpuctl) from a test."""
    monkeypatch.setenv("XPUCTL_STATE_DIR", str(tmp_path / "xpuctl-state"))


@pytest.fixture(autouse=True)
def _close_readers():
    """Each Host keeps a reader process (xpuctl/host/reader.py) until it is collected; hosts
    made in this process (CliRunner, direct calls) can wait for a full garbage collection.
    Close them after each test, so idle readers do not pile up over a run."""
    yield
    from xpuctl.host import reader

    reader.close_all()
