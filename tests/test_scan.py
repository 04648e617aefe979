"""The passes over a live /proc: fd reading with and without a listing, the split pass,
and the member pass of shutdown (which reads little of what it does not need).

Real processes (tagged with a reaper token) hold stand-in device nodes and files under a
StandInRoot whose `proc` links to /proc, on fd numbers chosen to make the fd table dense
or gapped. The split pass (a forked helper scans every other pid) must find exactly what
the plain pass finds, and fall back to scanning everything itself when the helper fails.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import shutil
import subprocess
import sys
import threading

import pytest
from proctools import (
    holders,
    is_gone,
    proc_token,  # noqa: F401  (fixture)
    standin_root,  # noqa: F401  (fixture)
    token_env,
    wait_for,
)

from xpuctl.host import processes
from xpuctl.host import split as Sp
from xpuctl.host.seam import Host
from xpuctl.parse.procfs import parse_stat

PY = sys.executable

# Holds argv[1] on fd argv[2] after closing every fd from 3 up, so its table is exactly
# {0, 1, 2, fd} (dense when fd is 3, gapped above), plus a shm file when argv[3] is given.
_HOLDER = r"""
import os, sys, time
node, fd = sys.argv[1], int(sys.argv[2])
os.closerange(3, 1 << 16)
t = os.open(node, os.O_RDWR)
if t != fd:
    os.dup2(t, fd)
    os.close(t)
if len(sys.argv) > 3:
    os.open(sys.argv[3], os.O_RDWR | os.O_CREAT, 0o600)  # lands on fd 3: gap 4..fd-1
print("ready", flush=True)
time.sleep(60)
"""


def start_holder(token: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([PY, "-c", _HOLDER, *args], env=token_env(token),
                         stdout=subprocess.PIPE, close_fds=True)
    assert p.stdout.readline().strip() == b"ready"
    return p


def fds_by_listing(pid: int) -> dict[str, str]:
    base = f"/proc/{pid}/fd"
    out = {}
    for name in os.listdir(base):
        try:
            out[name] = os.readlink(f"{base}/{name}")
        except OSError:
            pass
    return out


@pytest.fixture
def population(standin_root, proc_token):
    root = standin_root
    shm = os.path.join(root.root, "dev/shm/psm_scan_test")
    procs = [
        start_holder(proc_token, root.node(0), "3"),  # dense: 0 1 2 3
        start_holder(proc_token, root.node(0), "9"),  # gapped: 0 1 2 9
        start_holder(proc_token, root.node(1), "700", shm),  # gapped, and a shm file
    ]
    try:
        assert wait_for(lambda: len(holders(root.node(0))) == 2, 10)
        yield root, [p.pid for p in procs], shm
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_fd_links_reads_dense_and_gapped_tables_completely(population):
    root, pids, _ = population
    host = Host(root.root)
    for pid in pids:
        got = dict(host.fd_links(pid))
        assert got == fds_by_listing(pid), pid
    # the filter keeps only the fds that start with one of the prefixes
    node = root.node(1)
    assert host.fd_links(pids[2], (node,)) == [("700", node)]


def test_fd_links_on_a_fake_tree_lists_the_directory(tmp_path):
    fd_dir = tmp_path / "proc/42/fd"
    fd_dir.mkdir(parents=True)
    for name, target in {"0": "/dev/null", "5": "/dev/dri/renderD128", "7": "socket:[99]"}.items():
        os.symlink(target, fd_dir / name)
    host = Host(str(tmp_path))
    assert not host.proc_is_live
    assert sorted(host.fd_links(42)) == [("0", "/dev/null"), ("5", "/dev/dri/renderD128"),
                                         ("7", "socket:[99]")]


def summary(scan: processes.FdTable, pids: list[int]) -> dict:
    mine = set(pids)
    return {
        "procs": sorted(p for p in scan.procs if p in mine),
        "stats": {p: tuple(scan.procs[p].stat) for p in pids},
        "drm": sorted(x for x in scan.drm_fds if x[0] in mine),
        "files": {k: sorted(v) for k, v in scan.files.items() if set(v) & mine},
        "paths": sorted(x for x in scan.paths if x[0] in mine),
        "sockets": sorted(i for i, owners in scan.sockets.items() if set(owners) & mine),
    }


def children_left() -> list[int]:
    """Our children, zombies included (a helper must be reaped, not just gone)."""
    me = str(os.getpid())
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if fields[1].decode() == me:
                out.append(int(d))
    return out


def test_split_pass_finds_what_the_plain_pass_finds(population, monkeypatch):
    root, pids, _ = population
    host = Host(root.root, read_timeout=None)  # the split itself, in this process
    before = set(children_left())
    monkeypatch.setattr(Sp, "SPLIT_ABOVE", 10**9)
    plain = processes.scan_processes(host)
    forks = []
    real_fork = os.fork
    monkeypatch.setattr(Sp.os, "fork", lambda: forks.append(1) or real_fork())
    _split_env(monkeypatch)  # whatever this machine's cores and other tests' threads
    split = processes.scan_processes(host)
    assert forks == [1]
    assert summary(split, pids) == summary(plain, pids)
    assert {(pid, path) for pid, _, path in split.drm_fds if pid in pids} == {
        (pids[0], "/dev/dri/renderD128"), (pids[1], "/dev/dri/renderD128"),
        (pids[2], "/dev/dri/renderD129")}
    # on the kernel's /proc a file to judge is held by identity: its fds are kept by number,
    # no link text (a fake tree's pass keeps the text: test_fakehosts)
    assert split.paths_for == ("psm_scan_test",) and not split.files
    assert {pid for pid, _ in split.paths if pid in pids} == {pids[2]}
    assert set(split.procs) >= set(pids)
    assert set(children_left()) <= before  # the helper was reaped
    # what the scan reads of a device holder was read by the half of the pass that found it
    # (processes._read_ahead): its fdinfo, uid, cgroup and command line; its environment
    # only when asked for
    for pid, fd, _ in (d for d in split.drm_fds if d[0] in pids):
        assert split.fdinfo[pid, fd] is not None and b"pos:" in split.fdinfo[pid, fd]
        uid, env, cgroup = split.procs[pid].facts
        assert uid == os.getuid() and env is None and cgroup is not None
        assert split.procs[pid].cmdline
    with_env = processes.scan_processes(host, env=True)
    assert all(with_env.procs[pid].facts[1] is not None for pid in pids)
    assert not any(p.facts for pid, p in split.procs.items() if pid not in pids
                   and p.role is None and pid not in {d[0] for d in split.drm_fds})


def test_split_pass_falls_back_when_the_helper_fails(population, monkeypatch):
    root, pids, _ = population
    host = Host(root.root, read_timeout=None)
    monkeypatch.setattr(Sp, "SPLIT_ABOVE", 0)
    monkeypatch.setattr(Sp, "can_split", lambda: True)
    plain_pids = set(processes.list_pids(host))

    def broken(self):  # runs in the helper: it exits 1 without writing anything
        raise RuntimeError("helper broke")

    monkeypatch.setattr(processes.FdTable, "dumps", broken)
    before = set(children_left())
    scan = processes.scan_processes(host)
    assert set(pids) <= set(scan.procs)
    assert len(scan.procs) >= len(plain_pids) - 5  # both halves (give or take exits)
    assert sorted(p for p, _, _ in scan.drm_fds if p in pids) == sorted(pids)
    assert set(children_left()) <= before


def test_no_split_while_other_threads_run(monkeypatch):
    monkeypatch.setattr(Sp, "SPLIT_ABOVE", 0)
    monkeypatch.setattr(Sp.os, "fork", lambda: pytest.fail("forked with a second thread running"))
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        scan = processes.scan_processes(Host("/"))
        assert os.getppid() in scan.procs or os.getpid() in scan.procs
    finally:
        stop.set()
        t.join()


def test_fdscan_survives_the_pipe():
    st = processes.ProcStat("python3", "S", 1, 10, 10, 4, 123456)
    scan = processes.FdTable()
    scan.procs[10] = processes.RawProcess(10, st, ["vllm", "serve", "caf\udcc3"], "api-server", None)
    scan.procs[11] = processes.RawProcess(11, st._replace(state="D"), None, None, None, False)
    scan.drm_fds.append((10, "5", "/dev/dri/renderD128"))
    scan.files["/tmp/odd \udcff name"] = [11]
    scan.dmabuf_fds.append((10, "6"))
    scan.sockets[777] = [10, 11]
    scan.paths.append((11, "7"))
    scan.unreadable.append(11)
    scan.malformed.append(12)
    scan.procs[10].facts = (0, {"ZE_AFFINITY_MASK": "0"}, "0::/system.slice/x.service\n")
    scan.fdinfo[10, "5"] = b"pos:\t0\n"
    scan.fdinfo[10, "6"] = None
    scan.rdev[10, "5"] = (226, 128)
    back = processes.FdTable.loads(scan.dumps())
    assert {p: (r.stat, r.cmdline, r.role, r.rank, r.fds_readable) for p, r in back.procs.items()} == {
        10: (st, ["vllm", "serve", "caf\udcc3"], "api-server", None, True),
        11: (st._replace(state="D"), None, None, None, False),
    }
    assert isinstance(back.procs[10].stat, processes.ProcStat)
    assert back.drm_fds == [(10, "5", "/dev/dri/renderD128")]
    assert back.dmabuf_fds == [(10, "6")]
    assert back.sockets == {777: [10, 11]}
    assert back.files == {"/tmp/odd \udcff name": [11]}
    assert back.paths == [(11, "7")]
    assert (back.unreadable, back.malformed) == ([11], [12])
    assert back.procs[10].facts == (0, {"ZE_AFFINITY_MASK": "0"}, "0::/system.slice/x.service\n")
    assert back.procs[11].facts is None
    assert back.fdinfo == {(10, "5"): b"pos:\t0\n", (10, "6"): None}
    assert back.rdev == {(10, "5"): (226, 128)}


_MAPPER = r"""
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
os.close(fd)  # only the mapping keeps the file in use
print("ready", flush=True)
time.sleep(60)
"""


def test_split_maps_pass_sees_a_file_kept_only_by_a_mapping(standin_root, proc_token, monkeypatch):
    from xpuctl.host.scan import take_scan

    root = standin_root
    mapped = os.path.join(root.root, "dev/shm/psm_mapped_only")
    unused = os.path.join(root.root, "dev/shm/psm_nobody")
    with open(unused, "w"):
        pass
    p = subprocess.Popen([PY, "-c", _MAPPER, mapped], env=token_env(proc_token), stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ready"
        monkeypatch.setattr(Sp, "SPLIT_ABOVE", 0)
        monkeypatch.setattr(Sp, "can_split", lambda: True)
        before = set(children_left())
        snap = take_scan(Host(root.root), port=None, want_env=False)
        arts = {a.path: a for a in snap.artifacts}
        assert arts["/dev/shm/psm_mapped_only"].stale is False
        assert p.pid in arts["/dev/shm/psm_mapped_only"].open_by
        assert arts["/dev/shm/psm_nobody"].stale is True
        assert set(children_left()) <= before
    finally:
        p.kill()
        p.wait()


def _split_env(monkeypatch):
    monkeypatch.setattr(Sp, "SPLIT_ABOVE", 0)
    monkeypatch.setattr(Sp, "can_split", lambda: True)


def test_in_two_covers_every_item_once(monkeypatch):
    import marshal

    _split_env(monkeypatch)
    items = list(range(1000))
    parts = Sp.in_two(list, items, marshal.dumps, marshal.loads)
    assert len(parts) == 2
    assert sorted(parts[0] + parts[1]) == items


def test_in_two_shares_by_speed(monkeypatch):
    """The items go to whoever takes them: a slow process takes fewer chunks."""
    import marshal
    import time

    _split_env(monkeypatch)
    me = os.getpid()

    def work(xs):
        out = []
        for x in xs:
            if os.getpid() == me:
                time.sleep(0.01)  # this process is the slow one (by far, even on a loaded host)
            out.append(x)
        return out

    items = list(range(800))
    here, helper = Sp.in_two(work, items, marshal.dumps, marshal.loads)
    assert sorted(here + helper) == items
    assert len(helper) > 2 * len(here)


def test_in_two_without_fork_or_helper_still_covers_everything(monkeypatch):
    import marshal

    _split_env(monkeypatch)
    items = list(range(300))

    def no_fork():
        raise OSError("EAGAIN")

    monkeypatch.setattr(Sp.os, "fork", no_fork)
    parts = Sp.in_two(list, items, marshal.dumps, marshal.loads)
    assert sorted(functools.reduce(operator.iadd, parts, [])) == items
    monkeypatch.undo()
    _split_env(monkeypatch)
    before = set(children_left())

    def garbled(_):
        return b"\xff\xfe"  # not marshal data

    parts = Sp.in_two(list, items, garbled, marshal.loads)
    assert sorted(functools.reduce(operator.iadd, parts, [])) == items
    assert set(children_left()) <= before


# /proc/2/stat of this machine's kthreadd (proc(5): field 9 is the flags; PF_KTHREAD is
# 0x00200000 in include/linux/sched.h): 2129984 = 0x208040
KTHREADD_STAT = (b"2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 25 0 0 "
                 b"18446744073709551615 0 0 0 0 0 0 0 2147483647 0 1 0 0 0 1 0 0 0 0 0 0 0 0 0 0 "
                 b"0 0 0\n")


def _kthreads() -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    st = parse_stat(f.read())
            except OSError:
                continue
            if st is not None and st.kthread:
                out.add(int(d))
    return out


def test_the_pass_reads_no_fds_of_kernel_threads(monkeypatch):
    """A kernel thread (PF_KTHREAD in its stat's flags) has no fds: the pass does not open
    its fd directory (a listing, the fd count being 0), and a process that may not look into
    it (EACCES for anyone but root) does not count it unreadable."""
    st = parse_stat(KTHREADD_STAT)
    assert st is not None and st.kthread and st.comm == "kthreadd"
    assert parse_stat(KTHREADD_STAT.replace(b" 2129984 ", b" 4194304 ")).kthread is False
    kthreads = _kthreads()
    if not kthreads:
        pytest.skip("no kernel thread visible here (a PID namespace of its own)")
    looked: list[int] = []
    real = Host.fd_links_ending

    def spy(self, pid, keep, ends):
        looked.append(pid)
        return real(self, pid, keep, ends)

    monkeypatch.setattr(Host, "fd_links_ending", spy)
    fds = processes.scan_processes(Host("/", read_timeout=None))
    seen = {pid for pid in kthreads if pid in fds.procs}
    assert seen and all(fds.procs[pid].stat.kthread for pid in seen)
    assert looked and not seen & set(looked)
    assert not seen & set(fds.unreadable)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a command as nobody (setpriv): needs root")
def test_a_command_that_may_not_look_into_kernel_threads_does_not_count_them(standin_root):
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv (util-linux)")
    os.chmod(standin_root.root, 0o755)
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", PY, "-m",
                          "xpuctl", "--root", standin_root.root, "doctor", "--json"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                         cwd="/")
    unreadable = {u["pid"] for u in json.loads(out.stdout)["unreadable_processes"]}
    assert os.getpid() in unreadable  # root's processes are not nobody's to look into
    assert not unreadable & _kthreads()


_SOCKETS = r"""
import os, socket, sys, time
pair = socket.socketpair()
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
print(os.fstat(pair[0].fileno()).st_ino, os.fstat(pair[1].fileno()).st_ino,
      os.fstat(listener.fileno()).st_ino, flush=True)
time.sleep(600)
"""


def test_the_pass_keeps_the_sockets_of_listeners_only(standin_root, proc_token):
    """Of a process's sockets the pass keeps those whose inode a TCP listener has (a port's
    owners: the listeners are read first), unless a socket file in /dev/shm or /tmp may be
    judged by what is bound to it: then every one (liveness.Holdings.bound)."""
    r = standin_root
    p = subprocess.Popen([PY, "-c", _SOCKETS], env=token_env(proc_token), stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
    try:
        assert p.stdout is not None
        a, b, listener = map(int, p.stdout.readline().split())
        fds = processes.scan_processes(Host(r.root, read_timeout=None))
        assert fds.sockets.get(listener) == [p.pid]
        assert a not in fds.sockets and b not in fds.sockets
        assert listener in {s.inode for s in fds.listeners or ()}
        assert fds.sockets_for is not None and listener in fds.sockets_for
        # a socket file a rule knows (vLLM's ZMQ sockets): every socket is kept
        import socket
        import uuid

        bound = socket.socket(socket.AF_UNIX)
        try:
            bound.bind(os.path.join(r.root, "tmp", str(uuid.uuid4())))
            fds = processes.scan_processes(Host(r.root, read_timeout=None))
            assert fds.sockets_for is None
            assert {a, b, listener} <= set(fds.sockets)
        finally:
            bound.close()
    finally:
        p.kill()
        p.wait()


_ORPHANED = r"""
import marshal, os, sys, time
from xpuctl.host import split as Sp
Sp.SPLIT_ABOVE = 0
Sp.can_split = lambda: True
me, mark = os.getpid(), sys.argv[1]

def work(xs):
    out = []
    for x in xs:
        if os.getpid() != me and not os.path.exists(mark):
            with open(mark + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(mark + ".tmp", mark)
        time.sleep(0.02)  # 2000 items: 40 s of work
        out.append(x)
    return out

Sp.in_two(work, list(range(2000)), marshal.dumps, marshal.loads)
"""


def test_the_helper_stops_once_the_process_that_forked_it_is_gone(tmp_path, proc_token):
    """A reader killed mid-pass (a read that blocked) leaves no helper
    working on for nobody: it takes no chunk once its parent is gone."""
    mark = tmp_path / "helper"
    p = subprocess.Popen([PY, "-c", _ORPHANED, str(mark)], env=token_env(proc_token),
                         stdin=subprocess.DEVNULL)
    try:
        assert wait_for(mark.exists, 60)
        helper = int(mark.read_text())
        p.kill()
        p.wait()
        # a chunk is 16 items, 0.3 s; the rest of the work would take 40 s
        assert wait_for(lambda: is_gone(helper), 15)
    finally:
        p.kill()
        p.wait()


def test_helper_runs_no_signal_handler_of_the_caller(monkeypatch, tmp_path):
    import marshal
    import signal

    _split_env(monkeypatch)
    me = os.getpid()
    ran = tmp_path / "handler-ran"
    old = signal.signal(signal.SIGUSR1, lambda *a: ran.write_text(str(os.getpid())))
    try:
        def work(xs):
            out = list(xs)
            if os.getpid() != me:  # the helper: the signal must end it, not run our handler
                os.kill(os.getpid(), signal.SIGUSR1)
            return out

        before = set(children_left())
        parts = Sp.in_two(work, list(range(400)), marshal.dumps, marshal.loads)
        assert sorted(functools.reduce(operator.iadd, parts, [])) == list(range(400))  # its chunks were redone here
        assert not ran.exists()
        assert set(children_left()) <= before
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_shutdown_members_read_environ_only_since_the_run_and_cmdline_only_of_members(proc_token):
    """members() reads stat for every process, but environ (run id) only for processes
    started since the run began, and cmdline only for the members it returns: both take
    the target's mmap lock, which a process stuck in the kernel can hold for good."""
    import time

    from xpuctl.actions.signals import target_of
    from xpuctl.host.processes import stat_of
    from xpuctl.shutdown import targets

    run_id = "scan-test-" + proc_token[-8:]
    env = token_env(proc_token, XPUCTL_RUN_ID=run_id)
    old = subprocess.Popen(["sleep", "60"], env=env)  # carries the id, but predates the run
    time.sleep(0.1)  # start times have a 10 ms grain
    top = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    time.sleep(0.1)
    tagged = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)  # left the session
    try:
        class Recording(Host):
            def __init__(self, root):
                super().__init__(root, read_timeout=None)  # read here, to be recorded
                self.reads: list[str] = []

            def read_bytes(self, hostpath, limit=None):
                self.reads.append(hostpath)
                return super().read_bytes(hostpath, limit)

        host = Recording("/")
        t = target_of(host, top.pid, "sleep")
        tree = targets.ServerTree(top=t, role="api-server", orphan=False, run_id=run_id,
                                 session=top.pid)
        got = {m.pid for m in targets.members(host, tree)}
        assert top.pid in got and tagged.pid in got and old.pid not in got
        environ_read = {int(p.split("/")[2]) for p in host.reads if p.endswith("/environ")}
        assert old.pid not in environ_read and tagged.pid in environ_read
        for pid in environ_read:
            st = stat_of(host, pid)
            assert st is None or st.start_ticks >= t.start_ticks, pid
        cmdline_read = {int(p.split("/")[2]) for p in host.reads if p.endswith("/cmdline")}
        assert cmdline_read == got
    finally:
        for p in (old, top, tagged):
            p.kill()
            p.wait()


def test_fds_refused_even_to_root_are_not_remedied_by_running_as_root(monkeypatch):
    """Not root: others' processes are unreadable and root is the remedy. Root refused (Yama's
    ptrace_scope, an LSM, another user namespace: PID 1 of this machine's sandbox): the
    finding names the pids and does not tell root to run as root."""
    from xpuctl.core.checks.inspection import _REMEDY_BY_SOURCE
    from xpuctl.core.model import Issue
    from xpuctl.host import scan

    live = Host("/", read_timeout=None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert scan._unreadable_fds(live, [1, 7]) == Issue("/proc",
                                                       "could not read the fds of 2 process(es)")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    issue = scan._unreadable_fds(live, [7, 1])
    assert issue.reason == "could not read the fds of 2 process(es) even as root (pids 1, 7)"
    assert issue.remedy and "run as root" not in issue.remedy
    assert _REMEDY_BY_SOURCE["/proc"].startswith("run as root")  # the usual remedy, not for root
