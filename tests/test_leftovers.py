"""The session-wide check of /dev/shm and /tmp (tests/support/leftovers.py, issue 38 §5):
a file of a known stale kind (xpuctl's own rules) that appeared during the session and that
nothing holds is a leftover; one a process of ours was seen holding (by inode) is this
session's whatever else runs on the machine; a held file, a file of no known kind, and a file
that was there before are never leftovers. A directory of a kind the suite's helpers leave
(multiprocessing's pymp-*, a Ray session) is one when no socket is bound inside it."""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid

import leftovers


def _psm() -> str:
    return f"/dev/shm/psm_{uuid.uuid4().hex[:12]}"


def test_a_file_seen_held_by_us_and_left_is_this_sessions(tmp_path):
    before, since = leftovers.snapshot(), time.time()
    old = _psm()
    left, held, other = _psm(), _psm(), f"/dev/shm/not-a-known-kind-{uuid.uuid4().hex}"
    fd = None
    try:
        with open(old, "w") as fh:  # there before the snapshot below: never a leftover
            fh.write("x")
        before = leftovers.snapshot()
        for p in (left, held, other):
            with open(p, "w") as fh:
                fh.write("x")
        leftovers.note_ours([left])  # a process of ours held it (the fixtures do this)
        fd = os.open(held, os.O_RDONLY)  # a live process holds it: in use, not left
        report = leftovers.compare(before, since)
        assert left in report.ours, report
        assert not {held, other, old} & set(report.ours + report.unattributed), report
        assert report.failed
        assert any(left in line for line in report.lines())
    finally:
        if fd is not None:
            os.close(fd)
        for p in (old, left, held, other):
            if os.path.lexists(p):
                os.unlink(p)


def test_a_new_inode_at_an_old_path_is_new(tmp_path):
    path = _psm()
    try:
        with open(path, "w") as fh:
            fh.write("x")
        before, since = leftovers.snapshot(), time.time() - 2
        os.unlink(path)
        with open(path, "w") as fh:
            fh.write("y")
        leftovers.note_ours([path])
        assert path in leftovers.compare(before, since).ours
    finally:
        if os.path.lexists(path):
            os.unlink(path)


def test_a_directory_the_helpers_leave_is_a_leftover_unless_in_use():
    """A killed multiprocessing user leaves /tmp/pymp-*: what Ray's dashboard left at every
    run before the Ray tier gave its clusters a TMPDIR of their own."""
    before, since = leftovers.snapshot(), time.time()
    left = f"/tmp/pymp-xpuctltest{uuid.uuid4().hex[:8]}"
    used = f"/tmp/pymp-xpuctltest{uuid.uuid4().hex[:8]}"
    sock = socket.socket(socket.AF_UNIX)
    try:
        os.mkdir(left)
        os.mkdir(used)
        sock.bind(f"{used}/listener-x")  # a live forkserver's listener: in use
        report = leftovers.compare(before, since)
        found = set(report.ours + report.unattributed)
        assert left in found and used not in found, report
    finally:
        sock.close()
        for d in (left, used):
            shutil.rmtree(d, ignore_errors=True)
