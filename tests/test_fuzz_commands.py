"""Whole commands on fake hosts whose files were mutated (hypothesis).

Each example mutates one to three files of a fake host (random bytes, truncation, bit flips,
NULs, a 100 kB line, an empty file), runs one read-only command in-process, and restores the
files. The only allowed outcomes are exit 0, 1 or 2 with valid UTF-8 on both streams, no
control byte but newline, no traceback (exit 70 is an internal error), and parseable JSON
for --json. Per-parser fuzzing lives with the parsers; this runs the whole pipeline.

Bounded and repeatable: a fixed number of examples, derandomized, no example database.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import fakehost as fh
import hostile
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from xpuctl.cli import app

runner = CliRunner()

COMMANDS = [
    ("doctor",),
    ("doctor", "--json"),
    ("doctor", "--format", "prometheus"),
    ("doctor", "--device", "0"),
    ("ps", "-a"),
    ("ps", "-a", "--json"),
    ("devices",),
    ("devices", "--json"),
    ("reset", "--dry-run"),
    ("reset", "--dry-run", "--json"),
    ("shutdown", "--all", "--dry-run"),
]


def _files(root: Path) -> list[Path]:
    """Regular files (not links) of the tree, in a fixed order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath, name)
            if not p.is_symlink() and p.is_file():
                out.append(p)
    return out


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = _files(root)
        # the files that matter most get more weight: sysfs strings and the pid files
        self.saved = {p: (p.read_bytes(), os.stat(p)) for p in self.files}

    def restore(self, paths) -> None:
        for p in paths:
            data, st_ = self.saved[p]
            p.write_bytes(data)
            os.utime(p, ns=(st_.st_atime_ns, st_.st_mtime_ns))


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    return [Tree(hostile.hostile_host(base / "hostile").root), Tree(fh.i915_host(base / "i915").root)]


def mutate(data: bytes, how: str, rnd: random.Random) -> bytes:
    if how == "random":
        return rnd.randbytes(rnd.randint(1, 300))
    if how == "truncate":
        return data[: rnd.randint(0, max(0, len(data) - 1))]
    if how == "bitflip":
        b = bytearray(data or b"\0")
        for _ in range(rnd.randint(1, 8)):
            i = rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
        return bytes(b)
    if how == "nuls":
        b = bytearray(data)
        for _ in range(rnd.randint(1, 6)):
            b.insert(rnd.randint(0, len(b)), 0)
        return bytes(b)
    if how == "huge":
        at = rnd.randint(0, len(data))
        return data[:at] + bytes([rnd.choice(b"a9:/ \x1b\xff")]) * 100_000 + b"\n" + data[at:]
    if how == "empty":
        return b""
    raise ValueError(how)


MUTATIONS = ["random", "truncate", "bitflip", "nuls", "huge", "empty"]


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    which=st.integers(0, 1),
    command=st.sampled_from(COMMANDS),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(MUTATIONS),
                             st.integers(0, 2**32 - 1)), min_size=1, max_size=3),
)
def test_mutated_host_never_breaks_a_command(trees, which, command, edits):
    tree = trees[which]
    touched = []
    try:
        for index, how, seed in edits:
            p = tree.files[index % len(tree.files)]
            rnd = random.Random(seed)
            p.write_bytes(mutate(p.read_bytes(), how, rnd))
            touched.append(p)
        result = runner.invoke(app, ["--root", str(tree.root), *command])
    finally:
        tree.restore(touched)
    what = f"{command} after {[(str(p.relative_to(tree.root)), e[1]) for p, e in zip(touched, edits, strict=True)]}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{what}: uncaught {result.exception!r}") from result.exception
    out = hostile.assert_terminal_safe(result.stdout_bytes, f"{what} stdout")
    err = hostile.assert_terminal_safe(result.stderr_bytes, f"{what} stderr")
    assert "Traceback" not in out + err, what
    assert result.exit_code in (0, 1, 2), f"{what}: exit {result.exit_code}\n{err}"
    if "--json" in command:
        json.loads(out)
