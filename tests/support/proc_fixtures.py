"""The pytest fixtures built on proctools (the only helper module that needs pytest).

tests/conftest.py offers them to every test; ``from proctools import proc_token`` also works
(proctools hands these out on first use, so proctools itself imports without pytest)."""

from __future__ import annotations

import pytest
from proctools import StandInRoot, new_token, reap_token


@pytest.fixture
def proc_token():
    """A fresh token; every process carrying it is SIGKILLed at teardown (even on failure)."""
    token = new_token()
    try:
        yield token
    finally:
        reap_token(token)


@pytest.fixture
def standin_root(tmp_path):
    """A StandInRoot with 2 devices, removed at teardown."""
    with StandInRoot(tmp_path, n_devices=2) as r:
        yield r
