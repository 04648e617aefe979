"""The fault tests' pause hook is inert outside the tests (issue 29 §13): XPUCTL_TEST_PAUSE_AT
in a production environment (root's profile, a shell copied from a test) never makes a
real reset sleep. It pauses only when the test armed it: a 0600 file of the user beside the
marker holding the per-run secret that XPUCTL_TEST_PAUSE_KEY names (xpuctl/pausepoint.py)."""

from __future__ import annotations

import json
import os
import subprocess

import fakehost
import pytest
from proctools import pause_env, wait_for
from serverig import XPUCTL


def _reset(tmp_path, env: dict[str, str]) -> subprocess.Popen:
    h = fakehost.orphan_host(tmp_path / "root")  # stale files: execute is reached
    cmd = [*XPUCTL, "--root", str(h.root), "reset", "--yes", "--json", "--state-dir",
           str(tmp_path / "state")]
    return subprocess.Popen(cmd, env=dict(os.environ, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _unarmed(marker, how: str) -> dict[str, str]:
    env = pause_env(marker, "reset-execute")
    arm = f"{marker}.arm"
    if how == "no arming file":
        os.unlink(arm)
    elif how == "only the step and marker":
        del env["XPUCTL_TEST_PAUSE_KEY"]
    elif how == "another secret":
        env["XPUCTL_TEST_PAUSE_KEY"] = "f" * 32
    elif how == "a readable arming file":
        os.chmod(arm, 0o644)
    elif how == "an arming link":
        os.rename(arm, f"{marker}.real")
        os.symlink(f"{marker}.real", arm)
    elif how == "another owner's file":
        os.chown(arm, 4321, 4321)
    elif how == "a short secret":
        with open(arm, "w") as fh:
            fh.write("abc")
        env["XPUCTL_TEST_PAUSE_KEY"] = "abc"
    elif how == "a relative marker":
        env["XPUCTL_TEST_PAUSE_FILE"] = os.path.relpath(marker)
    return env


@pytest.mark.parametrize("how", ["no arming file", "only the step and marker", "another secret",
                                 "a readable arming file", "an arming link",
                                 "another owner's file", "a short secret", "a relative marker"])
def test_the_step_variable_alone_never_pauses_a_reset(tmp_path, how):
    if how == "another owner's file" and os.geteuid() != 0:
        pytest.skip("chown needs root")
    marker = tmp_path / "paused"
    p = _reset(tmp_path, _unarmed(marker, how))
    try:
        out, err = p.communicate(timeout=120)  # main slept here until killed
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1, err  # done: the fake orphans cannot be stopped, files removed
    assert json.loads(out)["removed"], out
    assert not marker.exists()


def test_an_armed_pause_still_pauses(tmp_path):
    marker = tmp_path / "paused"
    p = _reset(tmp_path, pause_env(marker, "reset-execute"))
    try:
        assert wait_for(lambda: marker.exists() or p.poll() is not None, 120)
        assert marker.read_text().startswith("reset-execute ") and p.poll() is None
    finally:
        p.kill()
        p.wait()
