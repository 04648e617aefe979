"""Files in /dev/shm and /tmp are judged live by identity, never by path text (issue 29 §2).

Real processes hold files of a stand-in root (its own /tmp and /dev/shm, so nothing of the
host's is touched) in the ways main judged wrong: a listener in another network namespace,
sockets bound as `/tmp//x` and by a relative path (the text /proc/net/unix keeps), a file
open and mapped, or only mapped, by a process in another mount namespace through a bind mount
(its fd links and maps lines name the bind mount's path), and a file of a non-root user held
by a root process that user cannot inspect. Each is kept by `reset --yes`; a file nothing
holds, beside it, is removed (the reset did judge and delete).

Root only (unshare, mount, setpriv); every process carries the test's reaper token.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid

import pytest
from proctools import StandInRoot, skip_unless_only_ours, token_env, wait_for

PY = sys.executable

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces, mounts and setpriv need root")
needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None,
                                   reason="no unshare (util-linux)")

# Binds argv[1] as argv[2] says (plain, "double": dir + "//" + name, "relative": chdir into its
# directory and bind the bare name), listens, says ready.
LISTENER = r"""
import os, socket, sys, time
path, how = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX)
d, n = os.path.split(path)
if how == "relative":
    os.chdir(d)
    s.bind(n)
elif how == "double":
    s.bind(d + "//" + n)
else:
    s.bind(path)
s.listen(8)
print("ready", flush=True)
time.sleep(600)
"""

# Bind-mounts argv[1] on argv[2] (directories, or files) in this process's own mount
# namespace, then opens argv[2]/argv[3] (argv[2] itself when argv[3] is "-"), and maps it
# and keeps the fd ("open"), only maps it ("close"), or only keeps the fd ("fd").
HOLDER = r"""
import mmap, os, subprocess, sys, time
src, dst, name, keep = sys.argv[1:5]
if src != dst:
    subprocess.run(["mount", "--bind", src, dst], check=True)
fd = os.open(dst if name == "-" else os.path.join(dst, name), os.O_RDWR)
if keep != "fd":
    m = mmap.mmap(fd, 4096)
if keep == "close":
    os.close(fd)  # only the mapping keeps the file in use
print("ready", flush=True)
time.sleep(600)
"""


def _start(token: str, argv: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(argv, env=token_env(token), stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    assert line == b"ready", (argv, line)
    return p


def _reset(root: str, state: str, token: str, *, user: str | None = None) -> dict:
    skip_unless_only_ours(root, token)  # outside a PID namespace: never stop another's orphan
    argv = [PY, "-m", "xpuctl", "--root", root, "reset", "--yes", "--json", "--state-dir", state]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL, cwd="/")
    assert out.stdout, (out.returncode, out.stderr)
    return json.loads(out.stdout)


def _doctor_artifacts(root: str) -> dict[str, dict]:
    out = subprocess.run([PY, "-m", "xpuctl", "--root", root, "doctor", "--json"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return {a["path"]: a for a in json.loads(out.stdout)["artifacts"]}


def _answers(path: str) -> bool:
    """A connect() through the file is accepted: its listener still lives."""
    c = socket.socket(socket.AF_UNIX)
    try:
        c.connect(path)
        return True
    except OSError:
        return False
    finally:
        c.close()


def _shm_file(root: StandInRoot, name: str, uid: int = 0) -> str:
    path = os.path.join(root.root, "dev", "shm", name)
    with open(path, "wb") as f:
        f.truncate(4096)
    os.chown(path, uid, uid)
    os.chmod(path, 0o600)
    return path


def _dead_socket(root: StandInRoot) -> str:
    """A socket file nothing listens on (bound, then closed): stale by every rule."""
    path = os.path.join(root.root, "tmp", str(uuid.uuid4()))
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    return path


# --- the parsers ---------------------------------------------------------------------------------

# /proc/<pid>/maps as the kernel prints it (fs/proc/task_mmu.c show_map_vma: `%08lx-%08lx %c%c%c%c
# %08llx %02x:%02x %lu `, the path padded to column 73; proc(5)), from a process that maps a
# file of /dev/shm through a bind mount of another mount namespace, a library, a deleted file
# and anonymous memory.
MAPS = """\
55d1c0a00000-55d1c0a01000 r--p 00000000 fe:00 2146681                    /usr/bin/python3.11
7f3a40000000-7f3a40001000 rw-s 00000000 00:1a 31                         /tmp/pytest-of-root/x/elsewhere/psm_held
7f3a40200000-7f3a40201000 rw-s 00000000 00:1a 32                         /dev/shm/psm_gone (deleted)
7f3a40400000-7f3a40421000 rw-p 00000000 00:00 0                          [heap]
7f3a40600000-7f3a40601000 rw-s 00000000 103:02 4096                       /mnt/a path/with  spaces
garbage line
7f3a40800000-7f3a40801000 rw-s 00000000 zz:1a 33                         /dev/shm/bad_dev
"""


def test_maps_lines_give_device_and_inode_whatever_the_path():
    from xpuctl.parse.procfs import Mapping, parse_maps

    assert parse_maps(MAPS) == [
        Mapping("55d1c0a00000-55d1c0a01000", 0xFE, 0, 2146681, "/usr/bin/python3.11"),
        Mapping("7f3a40000000-7f3a40001000", 0, 0x1A, 31,
                "/tmp/pytest-of-root/x/elsewhere/psm_held"),
        Mapping("7f3a40200000-7f3a40201000", 0, 0x1A, 32, "/dev/shm/psm_gone (deleted)"),
        Mapping("7f3a40600000-7f3a40601000", 0x103, 2, 4096, "/mnt/a path/with  spaces"),
    ]


def test_mountinfo_gives_each_mounts_device_and_mounted_path():
    from xpuctl.parse.procfs import Mount, parse_mountinfo

    # proc(5)'s example line, a tmpfs, and a file bind mount whose path has a space (\\040)
    text = ("36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
            "25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw\n"
            "812 790 0:23 /psm\\040x /data/y rw,relatime - tmpfs tmpfs rw\n"
            "bad line\n")
    assert parse_mountinfo(text) == [Mount(98, 0, "/mnt1"), Mount(0, 23, "/"),
                                     Mount(0, 23, "/psm x")]


def test_status_gives_the_credentials_a_process_acts_as():
    from xpuctl.parse.procfs import Creds, parse_status_creds

    # /proc/<pid>/status of a root daemon and of a user's process (fs/proc/array.c)
    root = ("Name:\tsshd\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t0\t0\t0\t0\n"
            "Gid:\t0\t0\t0\t0\nGroups:\t \nCapEff:\t000001ffffffffff\n")
    user = ("Uid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\n"
            "Groups:\t4 24 1000 \nCapEff:\t0000000000000000\n")
    assert parse_status_creds(root) == Creds((0, 0, 0, 0), (0, 0, 0, 0), (), 0x1FFFFFFFFFF)
    assert parse_status_creds(user) == Creds((1000,) * 4, (1000,) * 4, (4, 24, 1000), 0)
    assert parse_status_creds("Name:\tx\n") is None
    assert parse_status_creds("Uid:\tx\nGid:\t0\n") is None


def test_who_could_hold_a_file_it_could_not_inspect():
    from xpuctl.core.model import FileInfo
    from xpuctl.host.liveness import could_open
    from xpuctl.parse.procfs import Creds

    mine = FileInfo(stat.S_IFREG | 0o600, 1000, 0, 0.0, 1, 1)
    shared = FileInfo(stat.S_IFREG | 0o644, 1000, 0, 0.0, 2, 1)
    root = Creds((0,) * 4, (0,) * 4, (), 0x1FFFFFFFFFF)
    other = Creds((1001,) * 4, (1001,) * 4, (), 0)
    owner = Creds((1000,) * 4, (1000,) * 4, (), 0)
    assert could_open(root, mine) and could_open(owner, mine) and could_open(None, mine)
    assert not could_open(other, mine) and could_open(other, shared)


# --- sockets -------------------------------------------------------------------------------------


@root_only
@needs_unshare
@pytest.mark.parametrize("how", ["other-netns", "double", "relative"])
def test_a_live_listener_keeps_its_socket_file(standin_root, proc_token, tmp_path, how):
    """The listener is bound to the file's inode; /proc/net/unix of xpuctl's network namespace
    shows no row for it (another namespace), or a text that is not the file's path
    (`R/tmp//<uuid>`, `<uuid>`). Found by sock_diag's UNIX_DIAG_VFS (device, inode), or by a
    connect() through the file (net/unix/af_unix.c finds a path's listener by its inode)."""
    r = standin_root
    live = os.path.join(r.root, "tmp", str(uuid.uuid4()))
    argv = [PY, "-c", LISTENER, live, "plain" if how == "other-netns" else how]
    if how == "other-netns":
        argv = ["unshare", "--net", *argv]
    _start(proc_token, argv)
    assert wait_for(lambda: os.path.exists(live), 10)
    dead = _dead_socket(r)
    assert _doctor_artifacts(r.root)["/tmp/" + os.path.basename(live)]["stale"] is False

    data = _reset(r.root, str(tmp_path / "state"), proc_token)

    gone = "/tmp/" + os.path.basename(dead)
    assert gone in data["removed"] and not os.path.lexists(dead)
    assert "/tmp/" + os.path.basename(live) not in data["removed"]
    assert stat.S_ISSOCK(os.lstat(live).st_mode) and _answers(live)


# --- files held through another mount namespace --------------------------------------------------


@root_only
@needs_unshare
@pytest.mark.parametrize("keep", ["open", "close"], ids=["open-and-mapped", "mapped-only"])
def test_a_file_held_through_a_bind_mount_in_another_mount_namespace_is_kept(
        standin_root, proc_token, tmp_path, keep):
    """The holder sees R/dev/shm at another path, in its own mount namespace: its fd link and
    its maps line name that path (proc's d_path of its mount), the device and inode are the
    file's. A stat of /proc/<pid>/fd/<n> and the maps line's `major:minor inode` (the
    kernel's show_map_vma) find it; with the fd closed only the mapping does."""
    r = standin_root
    held = _shm_file(r, "psm_held_elsewhere")
    free = _shm_file(r, "psm_free")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = _start(proc_token, ["unshare", "--mount", "--propagation", "private", PY, "-c", HOLDER,
                            os.path.join(r.root, "dev", "shm"), str(elsewhere),
                            "psm_held_elsewhere", keep])
    # what main went by: the holder's own view names neither R/dev/shm nor this file's path
    with open(f"/proc/{p.pid}/maps") as f:
        maps = f.read()
    assert f"{elsewhere}/psm_held_elsewhere" in maps and held not in maps
    arts = _doctor_artifacts(r.root)
    assert arts["/dev/shm/psm_held_elsewhere"]["stale"] is False
    assert p.pid in arts["/dev/shm/psm_held_elsewhere"]["open_by"]

    data = _reset(r.root, str(tmp_path / "state"), proc_token)

    assert data["removed"] == ["/dev/shm/psm_free"] and not os.path.lexists(free)
    assert os.path.exists(held)


@root_only
@needs_unshare
def test_a_file_bind_mounted_under_another_name_and_held_open_is_kept(
        standin_root, proc_token, tmp_path):
    """The file itself is bind-mounted on another name in the holder's mount namespace, and
    only held open (no mapping): its fd link names the mount point. The pass keeps fds by the
    candidates' names; a candidate that is the root of a mount (its mountinfo line: the
    file's major:minor, the root ending in its name) makes the fds be read again in full."""
    r = standin_root
    held = _shm_file(r, "psm_file_mounted")
    other = tmp_path / "other-name"
    other.touch()
    p = _start(proc_token, ["unshare", "--mount", "--propagation", "private", PY, "-c", HOLDER,
                            held, str(other), "-", "fd"])
    assert os.readlink(f"/proc/{p.pid}/fd/3") == str(other)
    arts = _doctor_artifacts(r.root)
    assert arts["/dev/shm/psm_file_mounted"]["stale"] is False
    assert arts["/dev/shm/psm_file_mounted"]["open_by"] == [p.pid]

    data = _reset(r.root, str(tmp_path / "state"), proc_token)

    assert data.get("removed", []) == [] and os.path.exists(held)


# --- a non-root reset and the processes it cannot inspect ----------------------------------------

NOBODY = 65534


@root_only
def test_a_non_root_reset_keeps_its_file_held_by_a_process_it_cannot_inspect(proc_token):
    """nobody's file, open and mapped by a root process: nobody cannot read that process's
    fds or maps (ptrace access mode checks in fs/proc), so the file is kept and the plan says
    why. A file of nobody's that nothing holds is still removed: a write lease (granted only
    while no other open file description of the inode exists, fs/locks.c) proves it."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv (util-linux)")
    with StandInRoot(n_devices=1) as r:
        os.chmod(r.root, 0o755)
        state = os.path.join(r.root, "state")
        os.mkdir(state, 0o700)
        os.chown(state, NOBODY, NOBODY)
        held = _shm_file(r, "psm_nobody_held", NOBODY)
        free = _shm_file(r, "psm_nobody_free", NOBODY)
        shm = os.path.join(r.root, "dev", "shm")
        _start(proc_token, [PY, "-c", HOLDER, shm, shm, "psm_nobody_held", "open"])

        data = _reset(r.root, state, proc_token, user=str(NOBODY))

        assert data["removed"] == ["/dev/shm/psm_nobody_free"] and not os.path.lexists(free)
        assert os.path.exists(held)
        why = {s["path"]: s["why"] for s in data["plan"]["skipped"]}
        assert "could not be inspected" in why["/dev/shm/psm_nobody_held"]
        assert any("could not be inspected" in n for n in data["plan"]["notes"])


# --- a write lease: is the inode open anywhere? ---------------------------------------------------


def test_a_write_lease_tells_whether_anything_holds_the_file(standin_root, proc_token):
    """fs/locks.c grants F_WRLCK only while no other open file description of the inode
    exists (check_conflicting_open: i_writecount and i_readcount), a mapping's included:
    the answer needs no look into any process."""
    from xpuctl.host.liveness import lease_probe
    from xpuctl.host.seam import Host

    r = standin_root
    host = Host(r.root, read_timeout=None)
    shm = os.path.join(r.root, "dev", "shm")
    for name in ("psm_free", "psm_fd", "psm_mapped"):
        _shm_file(r, name)
    assert lease_probe(host, "/dev/shm/psm_free", host.lstat("/dev/shm/psm_free")) is False
    _start(proc_token, [PY, "-c", HOLDER, shm, shm, "psm_fd", "fd"])
    _start(proc_token, [PY, "-c", HOLDER, shm, shm, "psm_mapped", "close"])
    for name in ("psm_fd", "psm_mapped"):
        assert lease_probe(host, f"/dev/shm/{name}", host.lstat(f"/dev/shm/{name}")) is True
    # the file changed since it was looked at: no answer
    before = host.lstat("/dev/shm/psm_free")
    _shm_file(r, "psm_new")  # made while the old one exists: another inode
    os.replace(os.path.join(shm, "psm_new"), os.path.join(shm, "psm_free"))
    assert lease_probe(host, "/dev/shm/psm_free", before) is None
    assert lease_probe(host, "/dev/shm/psm_free", host.lstat("/dev/shm/psm_free")) is False


def test_a_holder_the_scan_did_not_see_still_keeps_the_file(standin_root, proc_token):
    """The holder is left out of the scan (as a process in a hidden /proc, or one handed
    the file over a unix socket beyond what its credentials allow, would be): no fd and no
    mapping of it is found, and the write lease asked before calling the file stale is
    refused, so it is kept."""
    from xpuctl.host.scan import take_scan
    from xpuctl.host.seam import Host

    r = standin_root
    _shm_file(r, "psm_unseen_holder")
    _shm_file(r, "psm_nobody_holds")
    shm = os.path.join(r.root, "dev", "shm")
    p = _start(proc_token, [PY, "-c", HOLDER, shm, shm, "psm_unseen_holder", "close"])
    scan = take_scan(Host(r.root), port=None, want_env=False, exclude_pids=frozenset({p.pid}))
    arts = {a.path: a for a in scan.artifacts}
    assert arts["/dev/shm/psm_nobody_holds"].stale is True
    kept = arts["/dev/shm/psm_unseen_holder"]
    assert kept.stale is False and kept.open_by == ()
    assert "write lease was refused" in kept.reason


# --- cleanup asks each file again by its inode, right before its unlink --------------------------


@root_only
def test_cleanup_keeps_a_file_opened_after_the_scan(standin_root, proc_token):
    """The scan found the file stale; a process opens and maps it before the unlink. The
    write lease cleanup asks for right before the unlink is refused (fs/locks.c: another open
    file description of the inode exists), so the file is kept."""
    from xpuctl.actions import cleanup
    from xpuctl.host.scan import take_scan
    from xpuctl.host.seam import Host

    r = standin_root
    late = _shm_file(r, "psm_opened_late")
    free = _shm_file(r, "psm_never_opened")
    host = Host(r.root)
    scan = take_scan(host, port=None, want_env=False)
    assert {a.path for a in cleanup.removable(scan)} >= {"/dev/shm/psm_opened_late",
                                                         "/dev/shm/psm_never_opened"}
    shm = os.path.join(r.root, "dev", "shm")
    _start(proc_token, [PY, "-c", HOLDER, shm, shm, "psm_opened_late", "close"])

    done = {x.path: x for x in cleanup.remove(host, cleanup.removable(scan), scan)}

    assert done["/dev/shm/psm_never_opened"].removed and not os.path.lexists(free)
    assert not done["/dev/shm/psm_opened_late"].removed and os.path.exists(late)
    assert "write lease was refused" in done["/dev/shm/psm_opened_late"].reason


@root_only
@needs_unshare
def test_cleanup_keeps_a_socket_a_connect_reaches(standin_root, proc_token):
    """A scan that took a live socket file for stale (as main's text did, for a listener in
    another network namespace): right before the unlink a connect() through the file is
    accepted, so it is kept."""
    from xpuctl.actions import cleanup
    from xpuctl.host.scan import take_scan
    from xpuctl.host.seam import Host

    r = standin_root
    live = os.path.join(r.root, "tmp", str(uuid.uuid4()))
    _start(proc_token, ["unshare", "--net", PY, "-c", LISTENER, live, "plain"])
    host = Host(r.root)
    scan = take_scan(host, port=None, want_env=False)
    blind = scan._replace(artifacts=tuple(a._replace(stale=True) for a in scan.artifacts))

    done = cleanup.remove(host, cleanup.removable(blind), blind)

    assert [(x.path, x.removed) for x in done] == [("/tmp/" + os.path.basename(live), False)]
    assert "connect() to it was not refused" in done[0].reason
    assert _answers(live)


# --- the pass keeps fds by number only when some file may be judged by them ----------------------


def test_a_file_that_appears_after_the_pass_is_still_matched_by_identity(standin_root, proc_token):
    """No candidate file when the pass began: it kept no fds by number (a pass over every
    process's files costs, host/processes.py). The file that appears meanwhile, held through
    another path, is still found by the fds read again when it is judged."""
    from xpuctl.host.liveness import Holdings
    from xpuctl.host.processes import scan_processes
    from xpuctl.host.seam import Host

    r = standin_root
    host = Host(r.root)
    fds = host.call(scan_processes)
    assert fds.paths_for is None and fds.paths == []
    shm = os.path.join(r.root, "dev", "shm")
    via = os.path.join(r.root, "tmp", "shm-link")
    os.symlink(shm, via)  # the holder opens it by another path
    late = _shm_file(r, "psm_after_the_pass")
    p = _start(proc_token, [PY, "-c", HOLDER, via, via, "psm_after_the_pass", "open"])
    fds = host.call(scan_processes)  # this pass, with a candidate, keeps them
    assert fds.paths_for == ("psm_after_the_pass",)
    info = host.lstat("/dev/shm/psm_after_the_pass")
    kept = Holdings(host, fds, {"/dev/shm/psm_after_the_pass": info})
    assert kept.open_by("/dev/shm/psm_after_the_pass") == (p.pid,)
    # the same judged on a pass that began before the file was there
    fds_before = host.call(scan_processes, frozenset(), True)
    fds_before.paths, fds_before.paths_for = [], None
    again = Holdings(host, fds_before, {"/dev/shm/psm_after_the_pass": info})
    assert again.open_by("/dev/shm/psm_after_the_pass") == (p.pid,)
    assert os.path.exists(late)
