"""serve's preflight as a newcomer meets it (issue 32 §6).

- The run's locks (its name, port and devices) are taken before the preflight: a second
  serve of the same run is refused at once (exit 5) while the first is still in its
  preflight, instead of waiting for it.
- The collective check's warning (nothing was proven: here no oneCCL bindings for an old
  torch) is said when serve goes on, as its pass is.

The collective ranks are the stand-ins of tests/standins/collective (a card that hangs in
`compute`: a one-device check; torch 2.7 without oneccl_bindings_for_pytorch); vLLM is
`/bin/false`, which is never reached or exits at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from proctools import StandInRoot, wait_for

STANDINS = Path(__file__).parent / "standins" / "collective"
XPUCTL = [sys.executable, "-m", "xpuctl"]


@pytest.fixture
def root(tmp_path):
    r = StandInRoot(tmp_path, n_devices=2)
    try:
        yield r.root
    finally:
        r.close()


def _env(tmp: Path, scenario: dict) -> dict[str, str]:
    (tmp / "scenario.json").write_text(json.dumps({"collective": scenario}))
    env = {k: v for k, v in os.environ.items()
           if k not in ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR", "XPUCTL_ROOT",
                        "XPUCTL_STATE_DIR", "XPUCTL_TEST_COLLECTIVE_BACKEND")}
    env.update(XPUCTL_STANDIN=str(tmp / "scenario.json"), PYTHONPATH=str(STANDINS))
    return env


def _serve_cmd(tmp: Path, root: str, *args: str) -> list[str]:
    return [*XPUCTL, "--root", root, "serve", "--vllm", "/bin/false never-started", "--state-dir",
            str(tmp / "state"), "--name", "one", *args, "model", "--port", "1"]


def _pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_second_serve_of_the_same_run_is_refused_during_the_firsts_preflight(tmp_path, root):
    # one device: its check computes on the card (no process group: issue 37 §1)
    env = _env(tmp_path, {"hang": {"1": "compute"}, "pidfile": str(tmp_path / "pids")})
    first = subprocess.Popen(_serve_cmd(tmp_path, root, "--devices", "1", "--preflight",
                                        "collective", "--collective-timeout", "20"),
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        # the first serve is in its preflight: its rank on card 1 hangs in compute
        assert wait_for(lambda: _pids(tmp_path / "pids") or first.poll() is not None, 60), \
            first.communicate()
        assert first.poll() is None
        second = subprocess.run(_serve_cmd(tmp_path, root, "--devices", "1", "--preflight", "fast"),
                                env=env, capture_output=True, text=True, timeout=120,
                                stdin=subprocess.DEVNULL)
        still_in_preflight = first.poll() is None
        assert second.returncode == 5, second.stderr
        assert "run-one is already claimed by another xpuctl run (one pid " in second.stderr
        assert "(preflight)" in second.stderr, second.stderr  # who holds it, and where it is
        assert still_in_preflight  # refused before the first's preflight ended
    finally:
        _, err = first.communicate(timeout=120)
    assert first.returncode == 1 and "preflight fail collective" in err, err
    assert all(_gone(p) for p in _pids(tmp_path / "pids"))
    # the first let go of the locks when its preflight failed: the name is free again
    again = subprocess.run(_serve_cmd(tmp_path, root, "--devices", "0", "--preflight", "fast"),
                           env=env, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
    assert "already claimed" not in again.stderr, again.stderr


def test_serve_keeps_the_collective_warning_when_it_goes_on(tmp_path, root):
    env = _env(tmp_path, {"version": "2.7.1+xpu", "no_ccl": True})
    p = subprocess.run(_serve_cmd(tmp_path, root, "--devices", "0", "--preflight", "collective"),
                       env=env, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert "xpuctl: started one" in p.stderr, p.stderr  # it went on (to /bin/false)
    warned = [line for line in p.stderr.splitlines()
              if line.startswith("xpuctl: preflight warn collective: ")]
    assert len(warned) == 1 and "oneccl_bind_pt" in warned[0], p.stderr
