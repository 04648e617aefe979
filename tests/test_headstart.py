"""doctor's head start (issue 23 §1): its pass over /proc is posted to the reader before the
command line is parsed (cli/headstart.py, host/ahead.py, Reader.post), the scan takes it,
and the CLI leaves without the interpreter's teardown (cli.leave).

What is checked: which command lines get a head start (every doctor option is classified);
a posted pass is the one the next scan takes, once; posted work that fails or blocks costs
nothing but the head start; a reader busy with posted work nobody asked for is killed; and
the exit keeps its status, its exit handlers and its silence on a closed pipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import fakehost as fh
import proctools
import pytest
import typer

from xpuctl.cli import headstart
from xpuctl.host import ahead
from xpuctl.host.reads import protocol as P
from xpuctl.host.reads.caller import Reader
from xpuctl.host.scan import take_scan
from xpuctl.host.seam import Host

DEADLINE = 60  # a command that hangs fails the test; generous for a slow machine


# -- which runs get one -----------------------------------------------------------------------


def test_plan_reads_the_root_and_bound_of_a_doctor_run(tmp_path):
    root = str(tmp_path)
    assert headstart.plan(["doctor"], {}) == ("/", 2.0)
    assert headstart.plan(["--root", root, "doctor", "--json"], {}) == (root, 2.0)
    assert headstart.plan([f"--root={root}", "--read-timeout", "0.5", "--debug", "doctor"], {}) == (root, 0.5)
    assert headstart.plan(["doctor", "-p", "8001", "--strict"], {"XPUCTL_ROOT": root,
                                                                  "XPUCTL_READ_TIMEOUT": "3"}) == (root, 3.0)
    # after "--" nothing is an option
    assert headstart.plan(["doctor", "--", "--deep"], {}) == ("/", 2.0)


@pytest.mark.parametrize("argv", [
    [], ["ps"], ["--version"], ["--help"], ["doctor", "--help"], ["doctor", "-h"],
    ["doctor", "--deep"], ["doctor", "--collective"], ["doctor", "--from", "x.tar.gz"],
    ["doctor", "--from=x.tar.gz"], ["--unknown", "doctor"], ["--root"], ["--debug=1", "doctor"],
    ["--read-timeout", "0", "doctor"], ["--read-timeout", "inf", "doctor"],
    ["--read-timeout", "soon", "doctor"], ["--root", "/no/such/dir", "doctor"],
])
def test_plan_says_no_to_anything_else(argv):
    assert headstart.plan(argv, {}) is None


def test_no_head_start_while_completing():
    assert headstart.plan(["doctor"], {"_XPUCTL_COMPLETE": "complete_bash"}) is None


def test_every_doctor_option_is_classified():
    """A new doctor option must say whether doctor's first scan stays its first action (the
    head start is then taken) or not: an unclassified one fails here."""
    from xpuctl.cli.doctor import app

    command = typer.main.get_command(app)
    names = {n for p in command.params for n in (*p.opts, *p.secondary_opts)} | {"--help"}
    known = set(headstart.NOT_FIRST) | set(headstart.SCANS_FIRST)
    assert names - known == set()
    assert set(headstart.SCANS_FIRST) & set(headstart.NOT_FIRST) == set()


# -- the reader's side --------------------------------------------------------------------------


def keep(reads, key, value):  # posted; module level: the reader unpickles it by name
    reads.keep_ahead(key, value)


def take(reads, key):
    return reads.take_ahead(key)


def explode(reads):
    raise RuntimeError("posted work that fails")


def read_posted(reads, path):
    reads.read("", "all", path, 1 << 10)


def test_posted_work_is_kept_for_the_call_that_asks_and_taken_once(tmp_path):
    reader = Reader(5.0)
    try:
        reader.post(keep, reader, "k", [1, 2])
        assert reader.posted == 1
        assert reader.call(take, reader, "k") == [1, 2]
        assert reader.posted == 0
        assert reader.call(take, reader, "k") is None
        assert Host(tmp_path, read_timeout=None).take_ahead("k") is None  # kept in no other way
    finally:
        reader.close()


def test_posted_work_that_fails_costs_only_its_result():
    reader = Reader(5.0)
    try:
        reader.post(explode, reader)
        first = reader.pid
        assert reader.call(take, reader, "k") is None
        assert reader.pid == first and reader.round_trips == 1  # same reader, one trip
    finally:
        reader.close()


def test_a_posted_read_that_blocks_is_found_by_the_next_call(tmp_path):
    os.mkfifo(tmp_path / "never")
    reader = Reader(0.3)
    try:
        reader.post(read_posted, reader, str(tmp_path / "never"))
        first = reader.pid
        assert reader.call(take, reader, "k") is None  # in a fresh reader, after one bound
        assert reader.pid != first
        (blocked,) = reader.blocked_reads()
        assert blocked.path == str(tmp_path / "never")
        assert proctools.wait_for(lambda: proctools.is_gone(first), 10)
    finally:
        reader.close()


def test_a_reader_busy_with_work_nobody_asked_for_is_killed_on_close(tmp_path):
    os.mkfifo(tmp_path / "never")
    reader = Reader(30.0)
    reader.post(read_posted, reader, str(tmp_path / "never"))
    pid = reader.pid
    started = time.monotonic()
    reader.close()
    assert proctools.wait_for(lambda: proctools.is_gone(pid), 10)
    assert time.monotonic() - started < 10


# -- the scan takes the pass ---------------------------------------------------------------------


def test_the_next_scan_takes_the_posted_pass_once(tmp_path):
    """The pass is the one posted: a process that appears after it is not in the first scan
    (taken when the pass was) and is in the next one."""
    h = fh.orphan_host(tmp_path / "root")
    reader = Reader(5.0)
    try:
        ahead.start_pass(reader, str(h.root))
        host = Host(h.root, reads=reader)
        posted_at = time.time()
        assert host.call(_wait_kept, ahead.key(host, frozenset()))  # the pass is done
        h.add_process(4242, 1, ["python3", "-m", "vllm.entrypoints.openai.api_server"], uid=1000,
                      comm="python3", start_ticks=h.ticks(100), fds={3: "/dev/dri/renderD128"})
        first = take_scan(host)
        assert 4242 not in {p.pid for p in first.processes}
        assert first.taken_at <= posted_at + 5
        second = take_scan(host)
        assert 4242 in {p.pid for p in second.processes}
    finally:
        reader.close()


def _wait_kept(host, key):
    """In the reader: is the posted pass kept (posted work runs before this request)?"""
    value = host.take_ahead(key)
    if value is not None:
        host.keep_ahead(key, value)
    return value is not None


def test_a_pass_for_other_pids_or_another_root_is_not_taken(tmp_path):
    h = fh.orphan_host(tmp_path / "root")
    reader = Reader(5.0)
    try:
        ahead.start_pass(reader, str(tmp_path))  # another root
        host = Host(h.root, reads=reader)
        assert not host.call(_wait_kept, ahead.key(host, frozenset()))
        assert 3010 in {p.pid for p in take_scan(host).processes}
    finally:
        reader.close()


def test_claim_gives_the_reader_only_to_the_host_it_was_started_for(tmp_path, monkeypatch):
    reader = Reader(2.0)
    monkeypatch.setattr(headstart, "_early", (str(tmp_path), reader))
    assert headstart.claim(str(tmp_path) + "/", 2.0) is reader
    assert headstart.claim(str(tmp_path), 2.0) is None  # once
    other = Reader(2.0)
    monkeypatch.setattr(headstart, "_early", (str(tmp_path), other))
    assert headstart.claim(str(tmp_path), 1.0) is None  # another bound: ended
    assert other.pid is None
    reader.close()


# -- the command, end to end ------------------------------------------------------------------------


def _xpuctl(*args: str, token: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xpuctl", *args], capture_output=True, text=True,
                          timeout=DEADLINE, env=proctools.token_env(token), stdin=subprocess.DEVNULL,
                          **kw)


def test_doctor_with_and_without_a_head_start_says_the_same(tmp_path, proc_token):
    """The installed entry (cli.main, head start) and the group alone (no head start)."""
    import json

    h = fh.orphan_host(tmp_path / "root")
    args = ["--root", str(h.root), "doctor", "--json"]
    fast = _xpuctl(*args, token=proc_token)
    without = "import sys; from xpuctl.cli.group import main; sys.argv[0] = 'xpuctl'; main()"
    slow = subprocess.run([sys.executable, "-c", without, *args], capture_output=True, text=True,
                          timeout=DEADLINE, env=proctools.token_env(proc_token),
                          stdin=subprocess.DEVNULL)
    assert fast.returncode == slow.returncode == 1 and fast.stderr == slow.stderr == "", fast.stderr
    a, b = json.loads(fast.stdout), json.loads(slow.stdout)
    for doc in (a, b):  # the clock moved between the two runs
        doc.pop("taken_at")
        for artifact in doc["artifacts"]:
            artifact.pop("age_seconds")
    assert a == b
    assert {p["pid"] for p in a["processes"]} >= {3001, 3010, 3020, 3021}
    assert proctools.wait_for(lambda: not proctools.pids_with_token(proc_token), 10)


def test_the_exit_keeps_status_handlers_and_silence_on_a_closed_pipe(tmp_path, proc_token):
    h = fh.orphan_host(tmp_path / "root")
    # exit status of a failing doctor, and of a usage error
    assert _xpuctl("--root", str(h.root), "doctor", token=proc_token).returncode == 1
    bad = _xpuctl("--root", str(tmp_path / "none"), "doctor", token=proc_token)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    # exit handlers run before the process leaves
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('handler ran'))\n"
            "sys.argv = ['xpuctl', '--version']\n"
            "runpy.run_module('xpuctl', run_name='__main__')\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE)
    assert ran.returncode == 0 and ran.stdout.splitlines() == ["xpuctl 0.1.0", "handler ran"]
    # the reader of the output went away: no traceback, no "Exception ignored", and a run
    # that would pass exits 1
    clean = fh.clean_host(tmp_path / "clean")
    assert _xpuctl("--root", str(clean.root), "doctor", "--json", token=proc_token).returncode == 0
    r, w = os.pipe()
    os.close(r)
    try:
        gone = subprocess.run([sys.executable, "-m", "xpuctl", "--root", str(clean.root), "doctor",
                               "--json"], stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=DEADLINE, env=proctools.token_env(proc_token),
                              stdin=subprocess.DEVNULL)
    finally:
        os.close(w)
    assert gone.returncode == 1 and gone.stderr == "", gone.stderr


def test_a_posted_pass_is_a_protocol_request_like_any_other():
    """A posted request says it wants no reply; everything else in it is a call's."""
    reader = Reader(1.0)
    data = reader._request(take, (reader, "k"), {}, wanted=False)
    import io
    import pickle

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            return pid

    fn, args, kwargs, reads, bound, wanted = Unpickler(io.BytesIO(data)).load()
    assert (fn, args, kwargs, reads, bound, wanted) == (take, (P.READS, "k"), {}, (), 1.0, False)


def test_the_collector_paused_for_start_up_runs_again_for_the_command(tmp_path):
    """cli.main pauses the garbage collector while modules load; a command runs with it on
    (serve runs for days)."""
    h = fh.clean_host(tmp_path / "root")
    code = ("import atexit, gc, runpy, sys\n"
            "atexit.register(lambda: print('collector', gc.isenabled()))\n"
            f"sys.argv = ['xpuctl', '--root', {str(h.root)!r}, 'ps', '--json']\n"
            "runpy.run_module('xpuctl', run_name='__main__')\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[-1] == "collector True"

