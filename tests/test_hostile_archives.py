"""`--from ARCHIVE` reads an archive as hostile (issue 29 §4).

Each archive here is built in the test with tarfile, in the shapes that wrote outside the
temporary directory or past the size cap on main: a symlink then a file through it, a chain
of two links, hard links (to /etc/passwd, and 5000 to one member), the PATH_MAX chain of
CVE-2025-4517 (the shape of CPython's own test_tarfile `test_realpath_limit_attack`), `..`,
absolute names, a FIFO, a char device, too many members, long names, a name given twice and a
decompression bomb. Each is refused with exit 2 and one line naming the member and why; a
sentinel directory and the parent of the temporary directory stay as they were, and the
temporary directory is gone. The cases run with tarfile's extraction filter and without it
(as on Debian 12's Python 3.11.2, which has none): the unpacker must not depend on it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xpuctl.archive import members
from xpuctl.archive import unpack as unpack_mod
from xpuctl.archive.replay import open_snapshot
from xpuctl.archive.unpack import unpack
from xpuctl.cli import app

runner = CliRunner()
FLAG = b"original flag\n"


def _info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0,
          link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    info.linkname = link
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return _info(name, size=len(data)), data


def _tar(path: Path, entries, mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT) as tf:
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


class Jail:
    """tempfile's directory (where `--from` unpacks) and a sentinel directory beside it, each
    holding a flag file; `intact()` says nothing was written, changed or left in either."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path / "t"
        self.sentinel = tmp_path / "sentinel"
        for d in (self.tmp, self.sentinel):
            d.mkdir()
            (d / "flag").write_bytes(FLAG)
        self.passwd = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()

    def intact(self) -> None:
        for d in (self.tmp, self.sentinel):
            assert sorted(os.listdir(d)) == ["flag"], (d, os.listdir(d))
            assert (d / "flag").read_bytes() == FLAG, d
        assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == self.passwd


@pytest.fixture(params=["with-filter", "no-filter"])
def jail(request, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t"))
    if request.param == "no-filter" and hasattr(tarfile, "data_filter"):
        monkeypatch.delattr(tarfile, "data_filter")  # Python < 3.11.4 (Debian 12: 3.11.2)
    return Jail(tmp_path)


def _refused(archive: Path, member: str | None, why: str, command: str = "doctor") -> str:
    result = runner.invoke(app, [command, "--from", str(archive)])
    err = result.stderr
    assert result.exit_code == 2, (result.exit_code, result.output, repr(result.exception))
    assert err.count("\n") == 1 and err.startswith("xpuctl: error: refusing unsafe snapshot"), err
    if member is not None:
        assert f"member '{member}'" in err, err
    assert why in err, err
    return err


def _manifest() -> list[tuple[tarfile.TarInfo, bytes]]:
    return [_file("snap/manifest.json", b"{}")]


# --- links ---------------------------------------------------------------------------------


def test_symlink_then_a_file_through_it(jail):
    archive = _tar(jail.tmp.parent / "a.tar.gz", [
        (_info("snap/esc", tarfile.SYMTYPE, link=str(jail.sentinel)), None),
        _file("snap/esc/pwned", b"written through the link\n"),
        *_manifest(),
    ])
    _refused(archive, "snap/esc", "symbolic link")
    jail.intact()


def test_two_links_that_climb_out_together(jail):
    """Each link alone stays inside the tree as text (`snap/x/../..` is `.`); together
    `snap/l1` is the sentinel directory. Python < 3.11.4 has no filter to catch it."""
    rel = os.path.relpath(jail.sentinel, jail.tmp)
    archive = _tar(jail.tmp.parent / "a.tar.gz", [
        (_info("snap/x", tarfile.DIRTYPE), None),
        (_info("snap/l2", tarfile.SYMTYPE, link="x/../.."), None),
        (_info("snap/l1", tarfile.SYMTYPE, link=f"l2/../{rel}"), None),
        _file("snap/l1/pwned", b"written through two links\n"),
        *_manifest(),
    ])
    _refused(archive, "snap/l2", "symbolic link")
    jail.intact()


def test_hard_link_to_etc_passwd(jail):
    archive = _tar(jail.tmp.parent / "a.tar.gz", [
        *_manifest(), (_info("snap/root/h", tarfile.LNKTYPE, link="/etc/passwd"), None)])
    _refused(archive, "snap/root/h", "hard link")
    jail.intact()


def test_hard_link_inside_the_tree_is_refused_too(jail):
    archive = _tar(jail.tmp.parent / "a.tar.gz", [
        *_manifest(), (_info("snap/h", tarfile.LNKTYPE, link="snap/manifest.json"), None)])
    _refused(archive, "snap/h", "hard link")
    jail.intact()


def test_path_max_chain_of_links(jail):
    """CVE-2025-4517: links whose expansion passes PATH_MAX, so realpath stops expanding and
    a filter built on it sees the tree; the kernel follows the short names out of it. Here
    `snap/escape` is the parent of the temporary directory: the flag there would be
    overwritten through a hard link, and a new file made beside it."""
    steps = "abcdefghijklmnop"
    # the destination as the unpacker makes it: <tmp>/xpuctl-from-XXXXXXXX/snap
    dest_len = len(str(jail.tmp)) + len("/xpuctl-from-12345678/snap/")
    component = "d" * ((os.pathconf(str(jail.tmp), "PC_PATH_MAX") - dest_len) // (len(steps) + 1))
    entries: list = []
    path, step_path = "snap", "snap"
    for step in steps:
        entries.append((_info(f"{path}/{component}", tarfile.DIRTYPE), None))
        entries.append((_info(f"{path}/{step}", tarfile.SYMTYPE, link=component), None))
        path = f"{path}/{component}"
        step_path = f"{step_path}/{step}"
    linkpath = f"{step_path}/{'l' * 254}"
    entries.append((_info(linkpath, tarfile.SYMTYPE, link="/".join([".."] * len(steps))), None))
    rel = linkpath.split("/", 1)[1]
    entries.append((_info("snap/escape", tarfile.SYMTYPE, link=f"{rel}/../.."), None))
    entries.append((_info("snap/flaglink", tarfile.LNKTYPE, link="snap/escape/flag"), None))
    entries.append(_file("snap/flaglink", b"overwritten\n"))
    entries.append(_file("snap/escape/newfile", b"new\n"))
    archive = _tar(jail.tmp.parent / "a.tar.gz", entries + _manifest())
    _refused(archive, None, "")
    jail.intact()


def test_five_thousand_hard_links_to_one_member_write_nothing(tmp_path, monkeypatch):
    """65 KB of archive that main expanded past its 1 GiB cap (a hard link's header says 0
    bytes). Refused from the headers, before a byte is written: the destination stays
    empty (unpack itself, so nothing removes what it might have written)."""
    monkeypatch.setattr(members, "MAX_TOTAL_BYTES", 4 << 20)  # 5000 x 1 MiB would pass it
    entries = [*_manifest(), _file("snap/big", bytes(1 << 20))]
    entries += [(_info(f"snap/l{i}", tarfile.LNKTYPE, link="snap/big"), None) for i in range(5000)]
    archive = _tar(tmp_path / "links.tar.gz", entries)
    assert archive.stat().st_size < 200_000
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(unpack_mod.UnsafeArchive, match="member 'snap/l0': hard link"):
        unpack(str(archive), str(dest))
    assert os.listdir(dest) == []


# --- names and kinds -----------------------------------------------------------------------


NAMES = {  # id: (member name, what the line says)
    "dotdot-top": ("../x", "'..' in the path"),
    "dotdot-inside": ("snap/root/../../x", "'..' in the path"),
    "dot": ("snap/./x", "'.' or empty component"),
    "absolute": (None, "absolute path"),  # the sentinel's own path
    "control": ("snap/a\x1b]0;pwned\x07", "control character in the path"),
    "long-component": ("snap/" + "n" * 256, "name component over 255 bytes (256)"),
    "long-path": ("snap/" + "/".join(["p" * 200] * 6), "path over 1024 bytes"),
}


@pytest.mark.parametrize("case", sorted(NAMES))
def test_bad_names_are_refused(jail, case):
    name, why = NAMES[case]
    name = name or str(jail.sentinel / "abs")
    archive = _tar(jail.tmp.parent / "a.tar.gz", [*_manifest(), _file(name, b"x")])
    err = _refused(archive, None, why)
    assert "member '" in err and "\x1b" not in err and "\x07" not in err
    jail.intact()


KINDS = {
    "fifo": (tarfile.FIFOTYPE, "FIFO"),
    "char-device": (tarfile.CHRTYPE, "device file"),
    "block-device": (tarfile.BLKTYPE, "device file"),
    "sparse": (tarfile.GNUTYPE_SPARSE, "special file"),
    "unknown": (b"Z", "special file"),
}


@pytest.mark.parametrize("case", sorted(KINDS))
def test_special_files_are_refused(jail, case):
    kind, why = KINDS[case]
    info = _info("snap/root/dev/dri/renderD128", kind)
    info.devmajor, info.devminor = 226, 128
    archive = _tar(jail.tmp.parent / "a.tar.gz", [*_manifest(), (info, None)],
                   mode="w:gz")
    _refused(archive, "snap/root/dev/dri/renderD128", why)
    jail.intact()


def test_a_duplicate_member_would_overwrite_and_is_refused(jail):
    archive = _tar(jail.tmp.parent / "a.tar.gz", [*_manifest(), _file("snap/manifest.json", b"[]")])
    _refused(archive, "snap/manifest.json", "duplicate member")
    jail.intact()


def test_a_file_where_a_directory_is_needed_is_refused(jail):
    archive = _tar(jail.tmp.parent / "a.tar.gz",
                   [*_manifest(), _file("snap/root", b"x"), _file("snap/root/proc/stat", b"x")])
    _refused(archive, "snap/root/proc/stat", "which is a file")
    jail.intact()


# --- sizes and counts ----------------------------------------------------------------------


def test_member_count_over_the_cap_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(members, "MAX_MEMBERS", 50)
    archive = _tar(tmp_path / "many.tar.gz", [_file(f"snap/f{i}", b"x") for i in range(51)])
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(unpack_mod.UnsafeArchive, match="member 'snap/f50': more than 50 members"):
        unpack(str(archive), str(dest))
    assert os.listdir(dest) == []


def test_total_over_the_cap_is_refused_from_the_headers(tmp_path, monkeypatch):
    monkeypatch.setattr(members, "MAX_TOTAL_BYTES", 1 << 20)
    archive = _tar(tmp_path / "big.tar.gz",
                   [_file(f"snap/f{i}", bytes(400 << 10)) for i in range(3)])
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(unpack_mod.UnsafeArchive, match="member 'snap/f2': more than 1 MiB in all"):
        unpack(str(archive), str(dest))
    assert os.listdir(dest) == []


def _pax(records: bytes) -> bytes:
    """A pax extended header block (type x) holding `records`, padded to 512 bytes."""
    head = _info("././@PaxHeader", tarfile.XHDTYPE, size=len(records)).tobuf(tarfile.USTAR_FORMAT)
    return head + records + bytes(-len(records) % 512)


def _record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n"
    n = len(body)
    while len(str(n + len(str(n)))) != len(str(n)):
        n += 1
    n += len(str(n))
    return f"{n}{body}".encode()


def test_decompressed_stream_is_capped(tmp_path, monkeypatch):
    """Extended headers are read before the member they describe: a chain of them is read
    (and decompressed) without a member to judge. The stream's cap stops it."""
    monkeypatch.setattr(members, "MAX_TOTAL_BYTES", 64 << 10)
    monkeypatch.setattr(members, "MAX_MEMBERS", 2)
    raw = b"".join(_pax(_record("comment", "c" * (40 << 10))) for _ in range(4))
    raw += _info("snap/f", size=1).tobuf(tarfile.USTAR_FORMAT) + b"x" + bytes(511) + bytes(1024)
    archive = tmp_path / "bomb.tar.gz"
    archive.write_bytes(gzip.compress(raw))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(unpack_mod.UnsafeArchive, match="once decompressed over"):
        unpack(str(archive), str(dest))
    assert os.listdir(dest) == []


def test_an_extended_header_too_large_to_hold_is_refused(tmp_path):
    raw = _pax(_record("comment", "c" * ((members.MAX_HEADER_BYTES) + 10)))
    archive = tmp_path / "pax.tar.gz"
    archive.write_bytes(gzip.compress(raw + bytes(1024)))
    result = runner.invoke(app, ["doctor", "--from", str(archive)])
    assert result.exit_code == 2 and "extended header of" in result.stderr, result.output


def test_a_chain_of_extended_headers_is_a_damaged_archive_not_a_crash(tmp_path):
    raw = b"".join(_pax(_record("comment", "c")) for _ in range(3000)) + bytes(1024)
    archive = tmp_path / "chain.tar.gz"
    archive.write_bytes(gzip.compress(raw))
    result = runner.invoke(app, ["doctor", "--from", str(archive)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output


def test_archive_file_over_the_cap_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(members, "MAX_TOTAL_BYTES", 16 << 10)
    monkeypatch.setattr(members, "MAX_MEMBERS", 1)
    archive = tmp_path / "huge.tar"
    archive.write_bytes(os.urandom(unpack_mod.stream_cap() + 1))
    result = runner.invoke(app, ["doctor", "--from", str(archive)])
    assert result.exit_code == 2 and "over" in result.stderr, result.output


# --- the commands and the source -----------------------------------------------------------


@pytest.mark.parametrize("command", ["doctor", "ps", "devices"])
def test_every_from_command_refuses(jail, command):
    archive = _tar(jail.tmp.parent / "a.tar.gz",
                   [*_manifest(), (_info("snap/l", tarfile.SYMTYPE, link="/"), None)])
    _refused(archive, "snap/l", "symbolic link", command)
    jail.intact()


@pytest.mark.parametrize("command", ["doctor", "ps", "devices"])
def test_empty_from_is_a_usage_error(command):
    result = runner.invoke(app, [command, "--from", ""])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "--from" in result.stderr, result.stderr


def test_from_a_fifo_does_not_block(tmp_path):
    fifo = tmp_path / "snap.fifo"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "xpuctl", "doctor", "--from", str(fifo)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a regular file" in proc.stderr, proc.stderr


def test_a_good_archive_unpacks_owner_only_and_reads_back(tmp_path):
    """Directories named and implied, the archive's modes dropped."""
    archive = _tar(tmp_path / "ok.tar.gz", [
        (_info("snap/root", tarfile.DIRTYPE), None),
        _file("snap/root/proc/1/stat", b"1 (x) S 0 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0\n"),
        (_info("snap/root/proc", tarfile.DIRTYPE), None),
        *_manifest(),
    ])
    dest = tmp_path / "dest"
    dest.mkdir()
    top = unpack(str(archive), str(dest))
    assert top == str(dest / "snap")
    stat_file = dest / "snap/root/proc/1/stat"
    assert stat_file.read_bytes().startswith(b"1 (x)")
    assert stat_file.stat().st_mode & 0o777 == 0o600
    assert (dest / "snap/root/proc").stat().st_mode & 0o777 == 0o700
    with pytest.raises(Exception, match="manifest"), open_snapshot(str(archive)):
        pass
