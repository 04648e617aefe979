"""The pytest fixtures built on proctools and serverig (the only helper module that needs pytest).

tests/conftest.py offers them to every test; ``from proctools import proc_token`` also works
(proctools hands these out on first use, so proctools itself imports without pytest)."""

from __future__ import annotations

import subprocess

import pytest
from proctools import StandInRoot, holders, new_token, reap_token, wait_for
from serverig import Rig


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


@pytest.fixture
def rig(tmp_path):
    token = new_token()
    root = StandInRoot(tmp_path, n_devices=2)
    r = Rig(token, root, tmp_path)
    try:
        yield r
    finally:
        ok = wait_for(lambda: not r.alive(), 10.0, 0.1)
        left = [] if ok else r.describe(r.alive())
        reap_token(token)
        r.reap_untagged()
        for p in r.popens:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        held = {i: holders(root.node(i)) for i in range(root.n_devices)}
        root.close()
        if left or any(held.values()):
            pytest.fail(f"test left processes behind: {left}; node holders: {held}")

