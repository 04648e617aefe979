"""The next `--textfile` write removes xpuctl's own stale temporary files (issue 17 item 5):
its own name pattern only, regular files only (a symlink is never followed nor removed),
owned as docs/safety.md allows, older than the bound; each removal is an audit line."""

from __future__ import annotations

import json
import os
import time

from xpuctl.actions import cleanup
from xpuctl.diagnosis import write_textfile
from xpuctl.state import atomic, textfile

OLD = time.time() - textfile.STALE_TEMP_SECONDS - 60


def _make(path, mtime=OLD, data=b"partial"):
    path.write_bytes(data)
    os.utime(path, (mtime, mtime))
    return path


def test_next_write_removes_only_its_own_stale_temporaries(tmp_path):
    d = tmp_path / "textfile"
    d.mkdir()
    outside = _make(tmp_path / "precious")
    stale = _make(d / ".xpuctl.prom.ab3_9xyz.tmp")
    fresh = _make(d / ".xpuctl.prom.zzzzzzzz.tmp", mtime=time.time())  # a write in progress
    other_target = _make(d / ".other.prom.ab3_9xyz.tmp")  # another textfile's (or tool's)
    odd_names = [_make(d / n) for n in (".xpuctl.prom.short.tmp", ".xpuctl.prom.ab3_9xyz.tmp.x",
                                       "xpuctl.prom.ab3_9xyz.tmp", ".xpuctl.prom.AB3_9XYZ.tmp")]
    link = d / ".xpuctl.prom.linklink.tmp"
    link.symlink_to(outside)
    os.utime(link, (OLD, OLD), follow_symlinks=False)
    (d / ".xpuctl.prom.dirdirdi.tmp").mkdir()
    state = tmp_path / "state"
    inode = stale.stat().st_ino

    write_textfile(str(d / "xpuctl.prom"), "xpuctl_up 1\n", str(state))

    assert (d / "xpuctl.prom").read_text() == "xpuctl_up 1\n"
    assert not stale.exists()
    for kept in (fresh, other_target, *odd_names, outside, d / ".xpuctl.prom.dirdirdi.tmp"):
        assert kept.exists(), kept
    assert link.is_symlink() and outside.read_bytes() == b"partial"
    left = sorted(n for n in os.listdir(d) if n.endswith(".tmp"))
    assert ".xpuctl.prom.ab3_9xyz.tmp" not in left
    lines = [json.loads(x) for x in (state / "audit.jsonl").read_text().splitlines()]
    assert [(e["command"], e["action"], e["target"], e["result"]) for e in lines] == [
        ("doctor", "delete", {"path": str(stale), "inode": inode, "kind": "temp-file"}, "removed")]

    # nothing stale left: the next write removes nothing and writes no audit line
    write_textfile(str(d / "xpuctl.prom"), "xpuctl_up 0\n", str(state))
    assert len((state / "audit.jsonl").read_text().splitlines()) == 1


def test_the_pattern_is_what_atomic_replace_leaves_behind(tmp_path, monkeypatch):
    """A write killed between mkstemp and the rename leaves a name the sweep recognises."""
    target = tmp_path / "xpuctl.prom"

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    made = []
    real_mkstemp = atomic.tempfile.mkstemp

    def spy(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        made.append(os.path.basename(name))
        return fd, name

    monkeypatch.setattr(atomic.tempfile, "mkstemp", spy)
    monkeypatch.setattr(atomic.os, "replace", boom)
    try:
        atomic.replace(str(target), b"x")
    except OSError:
        pass
    assert made and atomic.temp_pattern(str(target)).match(made[0])


def test_files_of_another_owner_are_kept_unless_root(tmp_path):
    _make(tmp_path / ".xpuctl.prom.abcdefgh.tmp")
    pattern = atomic.temp_pattern(str(tmp_path / "xpuctl.prom"))
    me = os.geteuid()
    if me != 0:
        assert cleanup.remove_stale_temps(str(tmp_path), pattern, 60, euid=me + 1) == []
        assert (tmp_path / ".xpuctl.prom.abcdefgh.tmp").exists()
    else:
        os.chown(tmp_path / ".xpuctl.prom.abcdefgh.tmp", 4321, 4321)
        assert cleanup.remove_stale_temps(str(tmp_path), pattern, 60, euid=1000) == []  # not theirs
        assert (tmp_path / ".xpuctl.prom.abcdefgh.tmp").exists()
    removed = cleanup.remove_stale_temps(str(tmp_path), pattern, 60)  # its owner (or root)
    assert [r.removed for r in removed] == [True]
    assert not (tmp_path / ".xpuctl.prom.abcdefgh.tmp").exists()


def test_doctor_textfile_removes_them_and_audits_it(tmp_path):
    """Through the command line, as node_exporter's timer runs it."""
    import fakehost
    from typer.testing import CliRunner

    from xpuctl.cli import app

    host = fakehost.clean_host(tmp_path / "root")
    d = tmp_path / "textfile"
    d.mkdir()
    stale = _make(d / ".xpuctl.prom.k1llm3d_.tmp")
    state = tmp_path / "state"
    res = CliRunner().invoke(app, ["--root", str(host.root), "doctor", "--textfile",
                                   str(d / "xpuctl.prom"), "--state-dir", str(state)])
    assert res.exit_code in (0, 1), res.output
    assert sorted(os.listdir(d)) == ["xpuctl.prom"] and not stale.exists()
    (line,) = [json.loads(x) for x in (state / "audit.jsonl").read_text().splitlines()]
    assert (line["command"], line["target"]["path"], line["result"]) == ("doctor", str(stale), "removed")
