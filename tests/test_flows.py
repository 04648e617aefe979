"""The shutdown and reset flows called directly (shutdown/flow.py, sweep.py's `run`), below the
CLI, on fake host trees: what they tell `on_event`, when they ask, and what they leave
undone. A fake root's /proc is not the live one, so nothing here can signal anything; the
end-to-end behaviour is held by test_serve_shutdown.py, test_reset.py and test_audit.py."""

from __future__ import annotations

import os

import fakehost as fh
import pytest

from xpuctl import sweep as reset
from xpuctl.errors import UsageError
from xpuctl.host.seam import Host
from xpuctl.shutdown import flow
from xpuctl.state import audit


def test_a_shutdown_request_that_names_nothing_is_refused_once():
    with pytest.raises(UsageError, match="say which server to stop"):
        flow.check(flow.Request(), Host("/"))
    assert not flow.Request().names_something
    assert flow.Request(devices=("0",)).names_something and flow.Request(pid=1).names_something


def test_shutdown_refuses_to_signal_through_a_foreign_root(tmp_path):
    h = fh.orphan_host(tmp_path / "root")
    with pytest.raises(UsageError, match="needs the live /proc"):
        flow.run(Host(str(h.root)), flow.Request(all_=True), None, lambda ev: None)


def test_shutdown_dry_run_plans_and_tells_nothing(tmp_path):
    h = fh.orphan_host(tmp_path / "root")
    heard: list[object] = []
    out = flow.run(Host(str(h.root)), flow.Request(all_=True, dry_run=True), None, heard.append)
    assert heard == [] and out.result is None and out.audit is None and not out.leftovers
    tops = [t.top.pid for t in out.trees]
    assert tops == [3010], tops  # the orphaned EngineCore heads what is left of the server
    assert set(out.members[3010]) >= {3010, 3020, 3021}, out.members


def _state_dir(tmp_path):
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return str(path)


def test_reset_dry_run_tells_the_plan_once_and_asks_nothing(tmp_path):
    h = fh.orphan_host(tmp_path / "root")
    sdir = _state_dir(tmp_path)
    heard: list[object] = []

    def approve(plan: reset.Plan) -> bool:
        raise AssertionError("a dry run asks nothing")

    out = reset.run(Host(str(h.root)), reset.Request(dry_run=True), sdir, heard.append, approve)
    assert [type(ev) for ev in heard] == [reset.Planned]
    assert heard[0].plan is out.plan and out.executed is None and out.remaining == []
    assert out.plan.files  # the orphan host's stale files are planned...
    assert all(os.path.exists(h.root / a.path.lstrip("/")) for a in out.plan.files)  # ...not removed
    assert not os.path.exists(os.path.join(sdir, audit.FILENAME))  # nothing was done


def test_reset_declined_changes_nothing(tmp_path):
    h = fh.orphan_host(tmp_path / "root")
    sdir = _state_dir(tmp_path)
    asked: list[reset.Plan] = []

    def decline(plan: reset.Plan) -> bool:
        asked.append(plan)
        return False

    out = reset.run(Host(str(h.root)), reset.Request(), sdir, lambda ev: None, decline)
    assert asked == [out.plan] and out.executed is None and out.audit is None
    assert all(os.path.exists(h.root / a.path.lstrip("/")) for a in out.plan.files)
    assert not os.path.exists(os.path.join(sdir, audit.FILENAME))


def test_reset_tells_its_steps_as_records_and_prints_nothing(tmp_path, capsys):
    """issue 32 §4: the flow renders nothing; each step is a record the CLI renders
    (cli/reset.py): the plan, then each file removed or kept (actions/cleanup.Removal)."""
    from xpuctl.actions.cleanup import Removal

    h = fh.orphan_host(tmp_path / "root")
    sdir = _state_dir(tmp_path)
    heard: list[object] = []
    out = reset.run(Host(str(h.root)), reset.Request(), sdir, heard.append)
    assert capsys.readouterr() == ("", "")
    assert not [ev for ev in heard if isinstance(ev, str)]
    assert type(heard[0]) is reset.Planned
    removals = [ev for ev in heard if isinstance(ev, Removal)]
    assert out.executed is not None and removals == out.executed.removed
    assert len(heard) == 1 + len(removals)
    assert {r.path for r in removals if r.removed} == {a.path for a in out.plan.files}


def test_the_shutdown_flow_ends_one_way():
    """issue 32 §4: the early way (NAME's recorded top signalled first) and the normal way
    share one tail: one `Found`, one ladder, one marking of the records' end (flow._stop)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(flow.__file__).read_text())

    def calls(name: str) -> list[int]:
        return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
                and name in (getattr(n.func, "attr", None), getattr(n.func, "id", None))]

    assert len(calls("stop")) == 1, calls("stop")  # ladder.stop
    assert len(calls("mark_ended")) == 1, calls("mark_ended")
    assert len(calls("Found")) == 1, calls("Found")
    assert len(calls("_stop")) == 2, calls("_stop")  # both ways end there
