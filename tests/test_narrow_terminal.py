"""The tables and the verdict line on an 80-column terminal, as a newcomer sees them (issue
32 §6), on fake hosts (tests/support/fakehost.py) read through --root.

- The devices table (devices, doctor) keeps `#` and the whole BDF at 80 and at 60 columns:
  the other columns are shortened first, each cell cut with "…" on its one line.
- ps and doctor's process listing keep PID, PPID, DEV and MEMORY whole and leave the command
  some room (a long wait channel in S is what gives way first).
- doctor's last line says "clean, N warnings" when something warns (the JSON status stays
  "clean").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fakehost as fh
import pytest

XPUCTL = [sys.executable, "-m", "xpuctl"]
BDFS = ("0000:03:00.0", "0000:04:00.0")


def run(root, *args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns)}
    env.pop("XPUCTL_ROOT", None)
    return subprocess.run([*XPUCTL, "--root", str(root), *args], env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def orphan(tmp_path_factory):
    root = tmp_path_factory.mktemp("orphan")
    fh.orphan_host(root)  # two devices, orphans, a worker in D state in a long wait channel
    return root


@pytest.mark.parametrize("columns", [80, 60])
@pytest.mark.parametrize("command", ["devices", "doctor"])
def test_the_devices_table_keeps_the_index_and_the_bdf(orphan, command, columns):
    out = run(orphan, command, columns=columns).stdout
    lines = out.splitlines()
    table = lines[lines.index("Devices") + 1:]
    assert table[1].startswith("┃ # ┃ BDF "), out
    for index, bdf in enumerate(BDFS):
        assert any(line.startswith(f"│ {index} │ {bdf} │") for line in table), out
    drawn = [line for line in table if line[:1] in "┏┃┡│└"]
    assert drawn and all(len(line) <= columns for line in drawn), out


def test_the_process_listing_keeps_pid_and_device_and_some_command(orphan):
    for args in (("ps", "--all"), ("doctor",)):
        out = run(orphan, *args).stdout
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("PID  PPID"))
        head = lines[at]
        assert head.split()[:2] == ["PID", "PPID"] and "DEV" in head and head.endswith("COMMAND"), out
        dev = head.index("DEV")
        rows = {int(line.split()[0]): line for line in lines[at + 1:at + 6]}
        assert set(rows) >= {3010, 3020, 3021}, out
        assert rows[3010][dev:].split()[0] == "0,1" and rows[3021][dev:].split()[0] == "1", out
        assert "ORPHAN" in rows[3021] and "VLLM::Worke" in rows[3021], out
        assert all(len(line) <= 80 for line in lines[at:at + 6]), out


def test_doctor_says_clean_with_its_warnings(tmp_path):
    h = fh.clean_host(tmp_path / "root")
    h.add_file("/dev/shm/psm_dead1", uid=1000, size=4 * fh.MiB, mtime=h.at(700), mode=0o600)
    res = run(tmp_path / "root", "doctor")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "clean, 1 warning", res.stdout
    assert "status: clean" not in res.stdout
    data = json.loads(run(tmp_path / "root", "doctor", "--json").stdout)
    assert data["status"] == "clean"  # only the line for people changes
    bare = tmp_path / "bare"
    fh.clean_host(bare)
    assert run(bare, "doctor").stdout.splitlines()[-1] == "status: clean"
