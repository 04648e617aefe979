"""`xpuctl reset --device N --rebind` against fake hosts and a driver stand-in.

The stand-in answers like the kernel's PCI core (Linux drivers/pci/pci-driver.c unbind_store
and bind_store; the writes are `echo BDF > /sys/bus/pci/drivers/DRIVER/unbind`, then
`.../bind`, as in Linux Documentation/ABI/testing/sysfs-bus-pci): an unbind takes the
device's DRM nodes away (/sys/class/drm/cardN, renderDN), a bind brings them back.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehost import BDF0, clean_host
from proctools import StandInRoot, token_env, wait_for
from typer.testing import CliRunner

from xpuctl.cli import app

runner = CliRunner()


class Driver(threading.Thread):
    """Watches ROOT/sys/bus/pci/drivers/DRIVER/{unbind,bind}; moves the device's DRM class
    entries (and /dev/dri nodes) aside on an unbind and back on a bind. `answer_bind=False`:
    a device that does not come back."""

    def __init__(self, root: Path, driver: str = "xe", answer_bind: bool = True) -> None:
        super().__init__(daemon=True)
        self.root = Path(root)
        self.dir = self.root / "sys/bus/pci/drivers" / driver
        self.dir.mkdir(parents=True, exist_ok=True)
        for op in ("unbind", "bind"):
            (self.dir / op).write_text("")
        self.stash = self.root / "stash"
        self.stash.mkdir()
        self.answer_bind = answer_bind
        self.stopping = threading.Event()
        self.seen: list[tuple[str, str]] = []
        self.moved: list[tuple[Path, Path]] = []

    def _take(self, op: str) -> str:
        f = self.dir / op
        text = f.read_text().strip()
        if text:
            f.write_text("")
        return text

    def _entries(self, bdf: str) -> list[Path]:
        out = []
        for entry in sorted((self.root / "sys/class/drm").iterdir()):
            if entry.name.startswith(("card", "renderD")) and "-" not in entry.name and \
                    (entry / "device").resolve().name == bdf:
                out.append(entry)
        return out

    def run(self) -> None:
        try:
            self._serve()
        except FileNotFoundError:
            pass  # the root was removed: the test is over

    def _serve(self) -> None:
        while not self.stopping.wait(0.02):
            bdf = self._take("unbind")
            if bdf:
                self.seen.append(("unbind", bdf))
                for entry in self._entries(bdf):
                    dest = self.stash / entry.name
                    entry.rename(dest)
                    self.moved.append((entry, dest))
            bdf = self._take("bind")
            if bdf:
                self.seen.append(("bind", bdf))
                if self.answer_bind:
                    for entry, dest in self.moved:
                        dest.rename(entry)
                    self.moved.clear()

    def close(self) -> None:
        self.stopping.set()
        self.join(5)


@pytest.fixture
def driver_for() -> Iterator:
    started: list[Driver] = []

    def make(root: Path, **kw: object) -> Driver:
        d = Driver(root, **kw)  # type: ignore[arg-type]
        d.start()
        started.append(d)
        return d

    yield make
    for d in started:
        d.close()


def reset(root: Path, state: Path, *args: str):
    result = runner.invoke(app, ["--root", str(root), "reset", "--state-dir", str(state), *args])
    assert "Traceback" not in result.output, result.output
    return result


def audit_lines(state: Path) -> list[dict]:
    path = state / "audit.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_rebind_unbinds_waits_binds_and_checks_again(tmp_path: Path, driver_for) -> None:
    h = clean_host(tmp_path / "h")
    drv = driver_for(h.root)
    state = tmp_path / "state"
    result = reset(h.root, state, "--device", "0", "--rebind", "--yes", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["rebind"]["bdf"] == BDF0 and data["rebind"]["driver"] == "xe"
    assert [w["path"] for w in data["rebind"]["writes"]] == [
        "/sys/bus/pci/drivers/xe/unbind", "/sys/bus/pci/drivers/xe/bind"]
    assert [w["done"] for w in data["writes"]] == [True, True]
    assert data["nodes_gone"] is True and data["render_node"] == "/dev/dri/renderD128"
    assert data["missing"] == [] and data["status"] == "clean"
    assert drv.seen == [("unbind", BDF0), ("bind", BDF0)]
    actions = [(a["action"], a["target"]["bdf"], a["result"]) for a in audit_lines(state)]
    assert actions == [("driver-unbind", BDF0, "done"), ("driver-bind", BDF0, "done")]


def test_dry_run_writes_nothing(tmp_path: Path, driver_for) -> None:
    h = clean_host(tmp_path / "h")
    drv = driver_for(h.root)
    state = tmp_path / "state"
    result = reset(h.root, state, "--device", "1", "--rebind", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "write 0000:04:00.0 > /sys/bus/pci/drivers/xe/unbind" in result.stdout
    assert "/sys/bus/pci/drivers/xe/bind" in result.stdout
    assert drv.seen == [] and audit_lines(state) == []
    assert (h.root / "sys/class/drm/renderD129").exists()


def test_a_device_that_does_not_come_back_exits_1_with_what_is_missing(tmp_path: Path, driver_for) -> None:
    h = clean_host(tmp_path / "h")
    driver_for(h.root, answer_bind=False)
    result = reset(h.root, tmp_path / "state", "--device", "0", "--rebind", "--yes",
                   "--bind-timeout", "0.5")
    assert result.exit_code == 1, result.output
    assert f"missing: no render node for {BDF0}" in result.stdout


def test_rebind_needs_one_device(tmp_path: Path) -> None:
    h = clean_host(tmp_path / "h")
    result = reset(h.root, tmp_path / "state", "--rebind", "--yes")
    assert result.exit_code == 2 and "exactly one --device" in result.output


HOLD = "import sys, time; f = open(sys.argv[1]); print('ok', flush=True); time.sleep(120)"


def _holder(root: StandInRoot, token: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, root.node(0)],
        env=token_env(token), stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"ok\n"
    return proc


def test_refused_while_a_process_holds_the_device(tmp_path: Path, proc_token, driver_for) -> None:
    with StandInRoot(tmp_path, n_devices=1) as root:
        drv = driver_for(root.path)
        holder = _holder(root, proc_token)
        try:
            result = reset(root.path, tmp_path / "state", "--device", "0", "--rebind", "--yes")
            assert result.exit_code == 1, result.output
            assert f"refused: held by pid {holder.pid}" in result.stdout
            assert drv.seen == [] and holder.poll() is None
        finally:
            holder.kill()
            holder.wait()


def test_kill_holders_stops_the_holder_first(tmp_path: Path, proc_token, driver_for) -> None:
    with StandInRoot(tmp_path, n_devices=1) as root:
        drv = driver_for(root.path)
        holder = _holder(root, proc_token)
        try:
            result = reset(root.path, tmp_path / "state", "--device", "0", "--rebind", "--yes",
                           "--kill-holders", "--kill-after", "2")
            assert result.exit_code == 0, result.output
            assert wait_for(lambda: holder.poll() is not None, 10)
            assert drv.seen == [("unbind", root.bdf(0)), ("bind", root.bdf(0))]
            actions = [a["action"] for a in audit_lines(tmp_path / "state")]
            assert actions.index("signal") < actions.index("driver-unbind") < actions.index("driver-bind")
        finally:
            if holder.poll() is None:
                holder.kill()
            holder.wait()
    shutil.rmtree(tmp_path / "state", ignore_errors=True)


def test_rebind_only_rebinds_xe_and_i915(tmp_path: Path) -> None:
    from fakehost import mixed_vendor_host

    h = mixed_vendor_host(tmp_path / "h")
    amd = next(e.name for e in sorted((h.root / "sys/bus/pci/devices").iterdir())
               if (e / "driver").resolve().name == "amdgpu")
    result = reset(h.root, tmp_path / "state", "--device", amd, "--rebind", "--yes")
    assert result.exit_code == 2 and "xe and i915 devices only" in result.output


STANDINS = Path(__file__).parent / "standins" / "collective"  # the collective check's torch stand-in


@pytest.mark.parametrize(("scenario", "code", "verdict"), [
    ({}, 0, "ok"),
    # one device: the check computes on the card, no collective (issue 37 §1)
    ({"crash": {"0": "compute"}}, 1, "failed"),
    ({"crash_alone": "all_reduce"}, 0, "ok"),  # vLLM #52386's crash is never reached
])
def test_rebind_with_collective_checks_the_device_once_it_is_back(
        tmp_path: Path, driver_for, monkeypatch, scenario, code, verdict) -> None:
    """issue 21 §4: with --collective the device is checked by the collective check too, once
    its render node is back; a failure there is what is missing (exit 1)."""
    h = clean_host(tmp_path / "h")
    driver_for(h.root)
    (tmp_path / "scenario.json").write_text(json.dumps({"collective": scenario}))
    monkeypatch.setenv("XPUCTL_STANDIN", str(tmp_path / "scenario.json"))
    monkeypatch.setenv("PYTHONPATH", str(STANDINS))
    monkeypatch.delenv("XPUCTL_TEST_COLLECTIVE_BACKEND", raising=False)
    (tmp_path / "state" / "runs").mkdir(parents=True)  # a state directory where runs are recorded
    result = reset(h.root, tmp_path / "state", "--device", "0", "--rebind", "--yes", "--json",
                   "--collective", "--collective-timeout", "20")
    assert result.exit_code == code, result.output
    data = json.loads(result.stdout)
    (found,) = [f for f in data["findings"] if f["check"] == "collective"]
    assert (found["severity"] == "fail") == (verdict != "ok"), found
    if verdict != "ok":
        assert any(m.startswith("collective:") for m in data["missing"]), data["missing"]
    # issue 32 §4: a check that passed proves the device clean, as doctor --collective does
    # (state/lastrun.py's PROOFS: serve then asks no collective check after an unclean end)
    proofs = tmp_path / "state" / "proved-clean.json"
    proven = json.loads(proofs.read_text())["devices"] if proofs.exists() else {}
    if verdict == "ok":
        assert proven[BDF0]["by"] == "collective check", proven
    else:
        assert BDF0 not in proven, proven


def test_the_rebind_flow_tells_its_steps_as_records_and_prints_nothing(
        tmp_path: Path, driver_for, capsys) -> None:
    """issue 32 §4: rebind.run is a flow like reset.run: request in, outcome out, each step
    told through the callback as a record; the CLI renders them (cli/reset.py)."""
    from xpuctl import rebind
    from xpuctl.host.seam import Host
    from xpuctl.shutdown.ladder import Event

    h = clean_host(tmp_path / "h")
    driver_for(h.root)
    told: list[object] = []
    host = Host(h.root, read_timeout=None)
    out = rebind.run(host, rebind.Request(("0",)), str(tmp_path / "state"), told.append)
    assert capsys.readouterr() == ("", "")
    assert [type(ev).__name__ for ev in told] == ["Planned", "Written", "Written", "Back"]
    assert not [ev for ev in told if isinstance(ev, Event | str)]
    assert [(ev.op, ev.write.done) for ev in told if isinstance(ev, rebind.Written)] == [
        ("unbind", True), ("bind", True)]
    assert out.executed is not None and out.missing == () and out.audit is not None
    assert out.executed.back == "/dev/dri/renderD128" and out.audit.lines == 2
    declined = rebind.run(host, rebind.Request(("0",)), str(tmp_path / "state"), told.append,
                          approve=lambda plan: False)
    assert declined.declined and declined.executed is None


def test_collective_without_rebind_is_a_usage_error(tmp_path: Path) -> None:
    h = clean_host(tmp_path / "h")
    result = reset(h.root, tmp_path / "state", "--collective", "--dry-run")
    assert result.exit_code == 2 and "--collective" in result.output
