"""A storage fault never stops a stop (issue 29 §6).

- A foreground serve whose state directory turned full or read-only while vLLM ran, stopped
  by SIGTERM or Ctrl-C (SIGINT): the whole ladder runs (the fake vLLM's event log shows the
  SIGTERM to its top, the tree is gone) and serve exits as on a writable directory, with one
  warning line that the record could not be written (main exited 70 and left vLLM to its
  parent-death signal).
- serve started on a full or read-only state directory refuses before vLLM starts: exit 2,
  one line (the "unusable state directory" code; 1 would make the systemd unit in deploy/
  restart it in a loop, `RestartForceExitStatus=1`).
- A state directory replaced while a run lives: a second run may take the name in the new
  one, and the first run's supervisor never writes over its record (it supervises and stops
  its own run, and says so in its run log).

Full disks are small tmpfs mounts filled to the last page. Read-only is the state
directory's own tmpfs remounted read-only while the run lives (its `logs/` and `locks/`,
which serve keeps open for writing for the whole run, are other mounts: Linux refuses to
make a filesystem read-only under an open writer), or, before a start, a read-only bind
mount over the directory. Root only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from proctools import is_gone, wait_for
from serverig import wait_ready

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                                reason="mounts a tmpfs and a read-only bind mount: needs root")


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """`directory` read-only from now on, through its path (a bind mount of itself)."""
    _mount("--bind", str(directory), str(directory))
    try:
        _mount("-o", "remount,bind,ro", str(directory))
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30)


def fill(directory: Path) -> None:
    """Write into `directory` until its filesystem has no page left (ENOSPC)."""
    n = 0
    while True:
        try:
            with open(directory / f"filler{n}", "wb") as fh:
                while True:
                    fh.write(b"\0" * 4096)
                    fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            if n > 0:
                return
        n += 1


def _state_dir(base: Path) -> Path:
    state = base / "state"
    for sub in ("runs", "locks", "logs"):
        (state / sub).mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    return state


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning" in line]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("fault", ["writable", "full", "read-only"])
def test_a_stop_runs_its_whole_ladder_whatever_the_state_dir(rig, tmp_path, fault, sig):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        rig.state = str(_state_dir(mnt))
        if fault == "read-only":  # what serve holds open for writing lives elsewhere
            for sub in ("logs", "locks"):
                (tmp_path / sub).mkdir(mode=0o700)
                _mount("--bind", str(tmp_path / sub), str(mnt / "state" / sub))
        fg = rig.serve_bg()
        wait_ready(rig, fg)
        rec = rig.record(fg.name)
        api = rec["pid"]
        core, workers = rig.tree(api)
        if fault == "full":
            fill(mnt)
        elif fault == "read-only":
            _mount("-o", "remount,ro", str(mnt))
            with pytest.raises(OSError) as ro:
                Path(rig.state, "runs", "probe").write_text("x")
            assert ro.value.errno == errno.EROFS
        fg.proc.send_signal(sig)
        rc = fg.proc.wait(120)
        # as on a writable directory: a stop asked for by a signal to serve exits 0
        assert rc == 0, str(fg)
        err = fg.err()
        assert "stopping (signal received" in err and "xpuctl: stopped: clean" in err, str(fg)
        assert rig.signals(api) == ["SIGTERM"]  # the drain: one SIGTERM to the top
        assert rig.signals(core) == ["SIGTERM"] and all(rig.signals(w) == [] for w in workers)
        rig.assert_clean()  # the tree is gone, the devices free
        warned = _warnings(err)
        if fault == "writable":
            assert warned == [], str(fg)
            assert rig.record(fg.name)["state"] == "stopped"
        else:
            assert len(warned) == 1, str(fg)  # once, one line
            assert warned[0].startswith(f"xpuctl: warning: state directory {rig.state} "
                                        "cannot be written ("), warned
            assert "the run is still supervised and stopped as usual" in warned[0]
            assert rig.record(fg.name)["state"] == "ready"  # what could be written


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_serve_refuses_to_start_on_a_state_dir_it_cannot_write(rig, tmp_path, fault):
    with tmpfs(tmp_path / "mnt", "64k") as mnt:
        state = _state_dir(mnt)
        rig.state = str(state)
        with contextlib.ExitStack() as faults:
            if fault == "full":
                fill(mnt)
            else:
                faults.enter_context(read_only(state))
            res = rig.serve(name="refused", retry_foreign=False, timeout=120)
            assert res.rc == 2, str(res)
            assert res.err.strip().splitlines()[-1].startswith(
                f"xpuctl: error: state directory {state} cannot be written ("), str(res)
            assert len(res.err.strip().splitlines()) == 1, str(res)
            assert [e for e in rig.events() if e["event"] == "start"] == []  # vLLM never ran
            assert not (state / "runs" / "refused.json").exists()


@pytest.mark.slow
def test_a_replaced_state_dir_never_gets_the_old_runs_record(rig, tmp_path):
    """The first run's directory is moved away and a new one made at its path; a second run
    takes the same name there. The first run's supervisor, stopped by SIGTERM, stops its own
    run and writes no record: the second run's record stays the second run's."""
    first = rig.serve(name="twin", opts=["--devices", "0"], tp=1)
    assert first.rc == 0, str(first)
    one = rig.record("twin")
    old = tmp_path / "state.old"
    os.rename(rig.state, old)  # the path now names nothing; a second serve makes it anew
    second = rig.serve(name="twin", opts=["--devices", "1", "--force"], tp=1)
    assert second.rc == 0, str(second)
    two = rig.record("twin")
    assert two["run_id"] != one["run_id"]
    before = Path(rig.state, "runs", "twin.json").read_bytes()

    sup = one["supervisor_pid"]
    os.kill(sup, signal.SIGTERM)  # the detached supervisor of the first run: its own drain
    assert wait_for(lambda: is_gone(sup), 60), "the first supervisor did not end"
    assert is_gone(one["pid"]) and rig.signals(one["pid"]) == ["SIGTERM"]
    assert Path(rig.state, "runs", "twin.json").read_bytes() == before  # never touched
    assert json.loads(before)["run_id"] == two["run_id"]
    assert not is_gone(two["pid"])  # the second run lives on
    assert json.loads((old / "runs" / "twin.json").read_text())["state"] == "ready"
    log = (old / "logs" / "twin.log").read_text()
    assert (f"xpuctl: warning: state directory {rig.state} was replaced by another directory "
            "while twin ran: its record is no longer written") in log, log
    assert "xpuctl: stopped: clean" in log, log
    assert "warning" not in Path(rig.state, "logs", "twin.log").read_text()

    res = rig.shutdown("twin", "--kill-after", "1", "--release-timeout", "5")
    assert res.rc == 0, str(res)
    rig.assert_clean()
    assert rig.record("twin")["state"] == "stopped"
