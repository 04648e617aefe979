"""doctor's head start (issue 23 §1, issue 32 §1): its pass over /proc is posted to the
reader before the command line is parsed, on speculation (cli/headstart.py, host/ahead.py,
Reader.post); the command, from the parameters click parsed, claims it or ends it; the scan
takes it (processes.taken_pass); and the CLI leaves without the interpreter's teardown
(cli.leave).

What is checked: which command lines get a head start (any that may be doctor's, for the
environment's root and bound: no option is read before click); that doctor ends it when its
first act is not a scan of this host, and any other command as it starts; that a pass serves
only a Host that reads the same /proc and whose files it kept, a stand-in root's included; a
posted pass is the one the next scan takes, once; posted work that fails or blocks costs
nothing but the head start; a reader busy with posted work nobody asked for is killed; and
the exit keeps its status, its exit handlers and its silence on a closed pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import fakehost as fh
import proctools
import pytest
from typer.testing import CliRunner

from xpuctl.cli import headstart
from xpuctl.cli.group import app
from xpuctl.host import ahead, processes
from xpuctl.host.reads import protocol as P
from xpuctl.host.reads.caller import Reader
from xpuctl.host.scan import take_scan
from xpuctl.host.seam import Host

DEADLINE = 60  # a command that hangs fails the test; generous for a slow machine
PY = sys.executable
WITHOUT = "import sys; from xpuctl.cli.group import main; sys.argv[0] = 'xpuctl'; main()"


@pytest.fixture(autouse=True)
def _no_head_start_left():
    yield
    headstart.end()


# -- which runs get one -----------------------------------------------------------------------


def test_plan_takes_the_environment_root_and_bound_for_any_command_line_with_doctor(tmp_path):
    root = str(tmp_path)
    assert headstart.plan(["doctor"], {}) == ("/", 2.0)
    # the command line's options are click's to read: --root, before or after the command
    assert headstart.plan(["--root", root, "doctor", "--json"], {}) == ("/", 2.0)
    assert headstart.plan(["doctor", "--root", root, "--read-timeout", "5"], {}) == ("/", 2.0)
    # whatever doctor is asked: the command decides once click has parsed it
    assert headstart.plan(["doctor", "--deep", "--from", "x"], {}) == ("/", 2.0)
    env = {"XPUCTL_ROOT": root, "XPUCTL_READ_TIMEOUT": "3"}
    assert headstart.plan(["--debug", "doctor", "-p", "8001"], env) == (root, 3.0)


@pytest.mark.parametrize(("argv", "env"), [
    ([], {}), (["ps"], {}), (["--version"], {}), (["--help"], {}), (["ps", "--json"], {}),
    (["doctor"], {"_XPUCTL_COMPLETE": "complete_bash"}),
    (["doctor"], {"XPUCTL_READ_TIMEOUT": "0"}), (["doctor"], {"XPUCTL_READ_TIMEOUT": "inf"}),
    (["doctor"], {"XPUCTL_READ_TIMEOUT": "soon"}), (["doctor"], {"XPUCTL_ROOT": "/no/such/dir"}),
])
def test_plan_says_no_to_anything_else(argv, env):
    assert headstart.plan(argv, env) is None


def _blocked_head_start(tmp_path) -> int:
    """A head start whose pass blocks for good (a fake tree whose one process's stat is a
    FIFO nobody writes): the pid of its reader."""
    h = fh.clean_host(tmp_path / "blocked")
    stat = h.root / "proc" / "2001" / "stat"
    stat.unlink()
    os.mkfifo(stat)
    headstart.begin(["doctor"], {"XPUCTL_ROOT": str(h.root)})
    early = headstart._early
    assert early is not None and early[1].pid is not None
    return early[1].pid


# -- the command decides ------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--ray", "127.0.0.1:1"], ["--from", "x.tar.gz"],
                                  ["--collective"], ["--deep"]])
def test_doctor_ends_a_head_start_its_first_act_would_not_take(tmp_path, monkeypatch, args):
    """Once click has parsed doctor's options: a run whose first act is no scan of this host
    ends the pass now, before anything else (--ray gathers from the cluster with no pass
    left running)."""
    import typer

    from xpuctl.cli import doctor

    pid = _blocked_head_start(tmp_path)
    seen = []

    def first_act(*_a, **_k):
        seen.append((headstart._early, proctools.is_gone(pid)))
        raise typer.Exit(0)

    monkeypatch.setattr(doctor, "on_cluster", first_act)
    monkeypatch.setattr(doctor, "open_source", first_act)
    result = CliRunner().invoke(app, ["doctor", "--json", *args],
                                env={"XPUCTL_ROOT": str(tmp_path / "blocked")})
    assert result.exit_code == 0, result.output
    assert seen == [(None, True)]


def test_any_other_command_ends_the_head_start(tmp_path):
    pid = _blocked_head_start(tmp_path)
    h = fh.clean_host(tmp_path / "clean")
    result = CliRunner().invoke(app, ["--root", str(h.root), "ps", "--json"])
    assert result.exit_code == 0, result.output
    assert headstart._early is None and proctools.is_gone(pid)


def test_doctor_claims_the_head_start_and_its_scan_takes_the_pass(tmp_path):
    """The pass posted before parsing is the one the scan takes: a process that appears
    after it is missing from doctor's report, and present without a head start."""
    h = fh.orphan_host(tmp_path / "root")
    env = {"XPUCTL_ROOT": str(h.root)}
    headstart.begin(["doctor"], env)
    early = headstart._early
    assert early is not None
    host = Host(h.root, reads=early[1])
    assert host.call(_wait_kept, os.getpid())  # the pass is done
    h.add_process(4242, 1, ["python3", "-m", "vllm.entrypoints.openai.api_server"], uid=1000,
                  comm="python3", start_ticks=h.ticks(100), fds={3: "/dev/dri/renderD128"})
    first = CliRunner().invoke(app, ["doctor", "--json"], env=env)
    assert headstart._early is None
    assert 4242 not in {p["pid"] for p in json.loads(first.stdout)["processes"]}
    again = CliRunner().invoke(app, ["doctor", "--json"], env=env)
    assert 4242 in {p["pid"] for p in json.loads(again.stdout)["processes"]}


def test_claim_gives_the_reader_only_to_a_host_its_pass_can_serve(tmp_path):
    h = fh.clean_host(tmp_path / "root")
    other = fh.clean_host(tmp_path / "other")
    env = {"XPUCTL_ROOT": str(h.root)}

    headstart.begin(["doctor"], env)
    early = headstart._early
    assert early is not None
    claimed = headstart.claim(Host(h.root))
    assert claimed.reader is early[1] and headstart._early is None
    assert headstart.claim(Host(h.root)).reader is not early[1]  # once
    early[1].close()

    for host in (Host(h.root, read_timeout=1.0), Host(other.root), Host(h.root, read_timeout=None)):
        headstart.begin(["doctor"], env)
        early = headstart._early
        assert early is not None
        pid = early[1].pid
        assert headstart.claim(host) is host  # another bound, another /proc, no reader: ended
        assert headstart._early is None
        assert proctools.wait_for(lambda p=pid: proctools.is_gone(p), 10)


def test_a_pass_serves_the_hosts_that_read_its_proc_and_whose_files_it_kept(tmp_path):
    fake = fh.clean_host(tmp_path / "fake")
    with proctools.StandInRoot() as standin:  # under /tmp, its proc the kernel's
        assert processes.pass_serves("", Host(standin.root, read_timeout=None))
        # the pass of R kept what the files of / need only when / has none to judge now
        live = Host("/", read_timeout=None)
        assert processes.pass_serves(Host(standin.root).root, live) == (
            processes._files_to_judge(live) == (None, False))
        assert not processes.pass_serves("", Host(fake.root))  # another /proc
        assert not processes.pass_serves(Host(fake.root).root, Host("/"))
        elsewhere = tmp_path / "elsewhere"
        os.makedirs(elsewhere)
        os.symlink("/proc", elsewhere / "proc")
        # a root the pass of / did not keep the files of (links under it are not kept whole)
        assert processes.pass_serves("", Host(elsewhere, read_timeout=None)) == str(elsewhere).startswith(
            ("/tmp/", "/dev/shm/"))


def test_a_pass_of_another_root_serves_only_when_it_kept_what_that_roots_files_need():
    """`xpuctl --root R doctor` under a head start posted for / (issue 32 §1: the head start
    reads no option): a file to judge in R/dev/shm that / does not have would make the scan
    read every fd again (liveness.Holdings._stat_fds); a pass of R's own costs less."""
    with proctools.StandInRoot() as standin:
        root = Host(standin.root, read_timeout=None)
        assert processes._files_to_judge(root) == (None, False)
        assert processes.pass_serves("", root)  # R has no file to judge: nothing is missed
        name = "psm_0123abcd"  # a psm_* file: judged by who holds it (core/rules.py)
        with open(os.path.join(standin.root, "dev/shm", name), "w"):
            pass
        assert processes._files_to_judge(root) == ((name,), False)
        assert not processes.pass_serves("", root)
        # a pass that kept every fd that may lead to a file serves it; one of other names not
        assert processes._covers((), True, (name,), False)
        assert not processes._covers(("psm_other",), True, (name,), False)
        assert processes._covers((name, "psm_other"), True, (name,), False)
        # a socket file is judged by what is bound to it: every socket must have been kept
        assert not processes._covers((), True, None, True)
        assert processes._covers(None, False, None, True)


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
        assert host.call(_wait_kept, os.getpid())  # the pass is done
        h.add_process(4242, 1, ["python3", "-m", "vllm.entrypoints.openai.api_server"], uid=1000,
                      comm="python3", start_ticks=h.ticks(100), fds={3: "/dev/dri/renderD128"})
        first = take_scan(host)
        assert 4242 not in {p.pid for p in first.processes}
        assert first.taken_at <= posted_at + 5
        second = take_scan(host)
        assert 4242 in {p.pid for p in second.processes}
    finally:
        reader.close()


def _wait_kept(host, caller):
    """In the reader: is the posted pass kept for a scan of this host by `caller` (posted work
    runs before this request)?"""
    skip = processes.own_pids(host, frozenset({caller}))
    value = processes.taken_pass(host, skip)
    if value is not None:
        processes.keep_pass(host, skip, *value)
    return value is not None


def test_a_pass_for_other_pids_or_another_root_is_not_taken(tmp_path):
    h = fh.orphan_host(tmp_path / "root")
    reader = Reader(5.0)
    try:
        ahead.start_pass(reader, str(tmp_path))  # another root
        host = Host(h.root, reads=reader)
        assert not host.call(_wait_kept, os.getpid())
        assert 3010 in {p.pid for p in take_scan(host).processes}
    finally:
        reader.close()


HOLD = """
import os, sys, time
fds = [os.open(p, os.O_RDONLY) for p in sys.argv[1:]]
print("ready", flush=True)
time.sleep(600)
"""


def _hold(token: str, *paths: str) -> subprocess.Popen:
    p = subprocess.Popen([PY, "-c", HOLD, *paths], env=proctools.token_env(token),
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    return p


def _holders(scan, bdf: str) -> set[int]:
    return {p.pid for p in scan.processes if bdf in p.devices}


def test_a_pass_of_this_host_serves_a_stand_in_root_on_its_proc(standin_root, proc_token):
    """The pass posted for / (the environment's root) is taken by the scan of a stand-in root
    whose proc is the kernel's (--root on the command line): its holders are read from the
    links the pass kept, and a holder that appears after the pass is in the next scan only."""
    r = standin_root
    early = _hold(proc_token, r.node(0))
    reader = Reader(5.0)
    try:
        ahead.start_pass(reader, "/")
        host = Host(r.root, reads=reader)
        assert host.call(_wait_kept, os.getpid())  # the pass is done, and serves
        late = _hold(proc_token, r.node(0))
        first = _holders(take_scan(host), r.bdf(0))
        assert early.pid in first and late.pid not in first
        assert {early.pid, late.pid} <= _holders(take_scan(host), r.bdf(0))
    finally:
        reader.close()


def test_a_pass_read_for_another_root_is_the_pass_of_this_one(standin_root, proc_token):
    """FdTable.for_root: the pass of / read for a stand-in root under /tmp is what that
    root's own pass finds, for the processes of this test (others come and go meanwhile)."""
    r = standin_root
    held = os.path.join(r.root, "tmp", "psm_held")
    with open(held, "wb") as f:
        f.write(b"x")
    p = _hold(proc_token, r.node(0), r.node(1), held, "/dev/null")
    mine = {p.pid}
    own = processes.scan_processes(Host(r.root, read_timeout=None))
    whole = processes.scan_processes(Host("/", read_timeout=None))
    served = whole.for_root(Host(r.root).root)
    assert served is not None and served.root == own.root
    # its fds kept by number are still those of the names it kept them for (liveness uses
    # them only when they cover the files it judges)
    assert (served.paths, served.paths_for) == (whole.paths, whole.paths_for)
    for fds in (own, served):
        assert sorted(x for x in fds.drm_fds if x[0] in mine) == [
            (p.pid, "3", "/dev/dri/renderD128"), (p.pid, "4", "/dev/dri/renderD129")]
        assert fds.files.get("/tmp/psm_held") == [p.pid]
    assert processes.pass_serves("", Host(r.root))
    assert whole.for_root(r.root + "/x") is not None
    # a root whose links the pass of / did not keep whole
    assert whole.for_root("/opt/root") is None


_DRIVER = r"""
import json, os, socket, subprocess, sys
sys.path.insert(0, sys.argv[1])
import proctools as pt
PY, WITHOUT = sys.argv[2], sys.argv[3]
root = pt.StandInRoot(n_devices=2)
out = {"pid": os.getpid()}
try:
    shm = os.path.join(root.root, "dev", "shm")
    for name in ("psm_held", "psm_stale"):
        with open(os.path.join(shm, name), "wb") as f:
            f.write(b"x" * 4096)
    node = os.open(root.node(0), os.O_RDWR)
    held = os.open(os.path.join(shm, "psm_held"), os.O_RDONLY)
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    port = listener.getsockname()[1]
    kids = []
    for i in range(260):  # above the split's threshold (host/split.py)
        keep = [node] if i < 5 else [held] if i == 5 else [listener.fileno()] if i == 6 else []
        kids.append(subprocess.Popen(["sleep", "600"], pass_fds=keep))
    os.close(node)
    os.close(held)
    listener.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPUCTL_")}
    args = ["doctor", "--json", "--port", str(port)]
    runs = {
        "head start for /, --root": ([PY, "-m", "xpuctl", "--root", root.root, *args], env),
        "head start for XPUCTL_ROOT": ([PY, "-m", "xpuctl", *args], dict(env, XPUCTL_ROOT=root.root)),
        "no head start": ([PY, "-c", WITHOUT, "--root", root.root, *args], env),
    }
    for name, (argv, e) in runs.items():
        r = subprocess.run(argv, env=e, capture_output=True, text=True, timeout=300)
        out[name] = [r.returncode, r.stdout, r.stderr]
    out["holders"] = [k.pid for k in kids[:5]]
finally:
    root.close()
print(json.dumps(out))
"""


@pytest.mark.skipif(not proctools.pidns_available(), reason="needs unshare --pid (root)")
def test_doctor_says_the_same_with_any_head_start_or_none_on_a_stand_in_root(tmp_path):
    """Real processes in a private PID and network namespace (nothing else comes or goes):
    the head start posted for / and read for the stand-in root given by --root, the one
    posted for XPUCTL_ROOT, and none give the same report, holders, the held and the stale
    file in its /dev/shm, and the port a process listens on."""
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    p = subprocess.run(["unshare", "--pid", "--net", "--fork", "--mount-proc", PY, str(driver),
                        os.path.dirname(proctools.__file__), PY, WITHOUT],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pid"] == 1, out
    docs = {}
    for name in ("head start for /, --root", "head start for XPUCTL_ROOT", "no head start"):
        code, stdout, stderr = out[name]
        assert code == 1 and stderr == "", (name, stderr)
        doc = json.loads(stdout)
        doc.pop("taken_at")  # the clock moved between the runs
        for artifact in doc["artifacts"]:
            artifact.pop("age_seconds")
        docs[name] = doc
    first, *rest = docs.values()
    assert all(doc == first for doc in rest)
    (node,) = [d for d in first["devices"] if d["render_node"] == "/dev/dri/renderD128"]
    assert sorted(node["holders"]) == sorted(out["holders"])
    arts = {a["path"]: a for a in first["artifacts"]}
    assert arts["/dev/shm/psm_stale"]["stale"] and not arts["/dev/shm/psm_held"]["stale"]
    assert [p["state"] for p in first["ports"]] == ["listen"]


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
    (serve runs for days), and what start-up made is frozen: the first collection of the
    command walked all of it (about 20 ms of a doctor run, measured with gc.callbacks), and
    a reader forked during the command keeps it frozen."""
    h = fh.clean_host(tmp_path / "root")
    code = ("import atexit, gc, runpy, sys\n"
            "atexit.register(lambda: print('collector', gc.isenabled(), gc.get_freeze_count()))\n"
            f"sys.argv = ['xpuctl', '--root', {str(h.root)!r}, 'ps', '--json']\n"
            "runpy.run_module('xpuctl', run_name='__main__')\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE)
    assert ran.returncode == 0, ran.stderr
    word, enabled, frozen = ran.stdout.splitlines()[-1].split()
    assert (word, enabled) == ("collector", "True")
    assert int(frozen) > 10_000  # typer's and xpuctl's modules, at least
