"""The bounded-read package (xpuctl/host/reads/): a Host reads the way it was built with,
a failure inside the reader carries the reader's traceback (shown by --debug), and a per-pid
pass is one round trip to the reader, whatever the number of pids."""

from __future__ import annotations

import os
import signal
import time
import traceback

import fakehost as fh
from proctools import is_gone, wait_for
from typer.testing import CliRunner

from xpuctl.actions.signals import Target, survivors, wait_gone
from xpuctl.cli import app
from xpuctl.host.processes import stat_of
from xpuctl.host.reads import protocol as P
from xpuctl.host.reads.caller import Reader, let_go
from xpuctl.host.seam import Host
from xpuctl.shutdown.targets import ServerTree, members, topmost
from xpuctl.sweep import _parents

runner = CliRunner()
ORPHANS = (3010, 3020, 3021)  # fakehost.orphan_host: the engine and its two workers


def _fails_in_reader(host: Host, word: str) -> None:
    raise ValueError(f"{word} in the reader")


def test_a_host_reads_the_way_it_was_built_with(tmp_path):
    assert Host(tmp_path, read_timeout=None).reader is None
    assert isinstance(Host(tmp_path).reader, Reader)
    host = Host(tmp_path, reads=P.DIRECT)
    assert host.reader is None
    (tmp_path / "f").write_bytes(b"abc")
    assert host.read_bytes("/f") == b"abc"
    assert host.blocked_reads() == ()


def test_a_failure_in_the_reader_carries_its_traceback(tmp_path):
    host = Host(tmp_path)
    try:
        host.call(_fails_in_reader, "kaboom")
    except ValueError as exc:
        cause = exc.__cause__
        assert isinstance(cause, P.ReaderTraceback)
        assert "_fails_in_reader" in cause.text and "kaboom in the reader" in cause.text
        shown = "".join(traceback.format_exception(exc))
        assert "in the reader process:" in shown and "_fails_in_reader" in shown
    else:
        raise AssertionError("the reader's exception was not raised")
    finally:
        host.reader.close()


def _echo(host: Host, word: str, after: float = 0.0) -> tuple[str, int]:
    time.sleep(after)
    return word, os.getpid()


def test_a_submitted_call_is_collected_later_and_calls_between_wait_their_turn(tmp_path):
    """Reader.submit (doctor asks for its scan, then loads what judges it): the request goes
    now, the reply is read when collected; a call made meanwhile gets its own reply, an
    exception reaches the collector only, and the pipe never hands one request's reply to
    another."""
    host = Host(tmp_path)
    reader = host.reader
    try:
        before = reader.round_trips
        first = reader.submit(_echo, host, "first")
        assert reader.round_trips == before + 1  # sent at once
        assert host.call(_echo, "second")[0] == "second"
        failing = reader.submit(_fails_in_reader, host, "kaboom")
        third = reader.submit(_echo, host, "third")  # settles `failing` first, keeps its error
        assert first()[0] == "first" and first()[0] == "first"
        assert third()[0] == "third"
        try:
            failing()
        except ValueError as exc:
            assert isinstance(exc.__cause__, P.ReaderTraceback)
        else:
            raise AssertionError("the reader's exception was not raised to its collector")
        assert reader.round_trips == before + 4
    finally:
        reader.close()


def test_a_submitted_call_outlives_its_reader(tmp_path):
    """A reader that dies between the request and its collection (an OOM kill, a stray
    signal): the collector asks a new one."""
    host = Host(tmp_path)
    reader = host.reader
    try:
        later = reader.submit(_echo, host, "asked", 0.5)  # killed before it answers
        dead = reader.pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)  # our own reader, started by this Host
        word, pid = later()
        assert word == "asked" and pid != dead and pid == reader.pid
    finally:
        reader.close()


def test_an_idle_reader_let_go_leaves_before_the_exit(tmp_path):
    """doctor lets its reader go once its report is taken (the reader's exit overlaps the
    rendering; the exit reaps it: tests/test_exit.py holds that nothing is left). A read
    after that starts a new reader; a reader with a request out is not let go."""
    (tmp_path / "f").write_bytes(b"x")
    host = Host(tmp_path)
    reader = host.reader
    try:
        assert host.read_bytes("/f") == b"x"
        first = reader.pid
        assert first is not None
        let_go()
        assert reader.pid is None
        assert wait_for(lambda: is_gone(first), 10)  # our child: a zombie until the exit
        assert host.read_bytes("/f") == b"x" and reader.pid not in (None, first)
        busy = reader.pid
        later = reader.submit(_echo, host, "out", 0.3)
        let_go()
        assert reader.pid == busy and later()[1] == busy
    finally:
        reader.close()


def test_debug_shows_where_in_the_reader_it_failed(tmp_path, monkeypatch):
    """The scan runs in a reader forked from this process, so the patch is there too."""
    import xpuctl.host.scan

    def exploded_in_the_scan(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(xpuctl.host.scan, "_processes", exploded_in_the_scan)
    h = fh.clean_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "doctor"])
    assert res.exit_code == 70
    assert "internal error: RuntimeError: kaboom (run with --debug" in res.stderr
    res = runner.invoke(app, ["--root", str(h.root), "--debug", "doctor"])
    assert isinstance(res.exception, RuntimeError)
    shown = "".join(traceback.format_exception(res.exception))
    assert "exploded_in_the_scan" in shown and "take_scan" in shown


def _orphans(host: Host) -> list[Target]:
    out = []
    for pid in ORPHANS:
        st = stat_of(host, pid)
        assert st is not None
        out.append(Target(pid, st.start_ticks, str(pid)))
    return out


def _trips(host: Host, fn, *args):
    before = host.reader.round_trips
    result = fn(host, *args)
    return result, host.reader.round_trips - before


def test_per_pid_passes_are_one_round_trip_each(tmp_path):
    h = fh.orphan_host(tmp_path / "host")
    host = Host(h.root)
    try:
        engine, *workers = _orphans(host)
        tree = ServerTree(top=engine, role="engine-core", orphan=True, known=[engine])
        found, trips = _trips(host, members, tree)
        assert {t.pid for t in found} >= set(ORPHANS) and trips == 1
        found, trips = _trips(host, topmost, [engine, *workers])
        assert [t.pid for t in found] == [engine.pid] and trips == 1
        parents, trips = _trips(host, _parents)
        assert parents[3020] == 3010 and trips == 1
        gone = Target(engine.pid, engine.start_ticks + 1, "another process")
        alive, trips = _trips(host, survivors, [engine, *workers, gone])
        assert alive == [engine, *workers] and trips == 1
        left, trips = _trips(host, wait_gone, [gone], 0.0)
        assert left == [] and trips == 1
    finally:
        host.reader.close()


def test_the_package_imports_one_way():
    """protocol <- child <- process <- caller, and none of them imports the seam: no import
    circle."""
    import ast
    from pathlib import Path

    import xpuctl.host.reads as pkg

    allowed = {"protocol": set(), "child": {"protocol"}, "process": {"protocol", "child"},
               "caller": {"protocol", "child", "process"}}
    for name, ok in allowed.items():
        tree = ast.parse((Path(pkg.__file__).parent / f"{name}.py").read_text())
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xpuctl"):
                mod = node.module or ""
                if mod == "xpuctl.host.reads":
                    used |= {a.name for a in node.names}
                else:
                    assert mod.startswith("xpuctl.host.reads."), (name, mod)
                    used.add(mod.rsplit(".", 1)[1])
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("xpuctl") for a in node.names), name
        assert used == ok, (name, used)
