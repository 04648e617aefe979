"""A command line shown by ps, doctor or JSON is capped (issue 29 §10).

On main, `ps --json` printed 37 MiB (and grew to 129 MiB RSS) for 20 processes with 2 MiB
command lines: each was read up to 1 MiB and printed twice (argv and cmdline). Now at most
64 KiB of a command line is read and kept (the rest is counted, not kept), 4 KiB is shown,
and the JSON says how many bytes were cut (`argv_truncated`); tables end the command with
`…[+N bytes]` (docs/output.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from proctools import token_env, wait_for

from xpuctl.parse.procfs import ARGV_SHOWN_BYTES, shown_argv, shown_command

HOLD = "import sys, time; f = open(sys.argv[1]); print('ok', flush=True); time.sleep(600)"
N = 20
LONG = 2 << 20  # bytes of argv per process
WORD = 120_000  # under the kernel's 128 KiB per argument (MAX_ARG_STRLEN)


# Builds the long argv in the process that then becomes the holder (the test's own process
# stays small), with room for it: execve allows a quarter of the stack limit.
LAUNCH = """
import os, resource, sys
size, letter, node = int(sys.argv[1]), sys.argv[2], sys.argv[3]
soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
want = 64 << 20 if hard == resource.RLIM_INFINITY else min(64 << 20, hard)
resource.setrlimit(resource.RLIMIT_STACK, (want, hard))
words, left = [], size
while left > 0:
    words.append(letter * min(WORD, left))
    left -= len(words[-1]) + 1
os.execv(sys.executable, [sys.executable, "-c", HOLD, node, *words])
""".replace("WORD", str(WORD)).replace("HOLD", repr(HOLD))


def _length(node: str, size: int) -> int:
    """The /proc/<pid>/cmdline length of a holder LAUNCH makes."""
    words, left = [], size
    while left > 0:
        words.append(min(WORD, left))
        left -= words[-1] + 1
    head = [sys.executable, "-c", HOLD, node]
    return sum(len(w.encode()) + 1 for w in head) + sum(n + 1 for n in words)


def _start(root, token: str, size: int) -> tuple[list[subprocess.Popen], list[int]]:
    """N processes holding device 0, each with about `size` bytes of argv; and each one's
    exact /proc/<pid>/cmdline length."""
    procs = [subprocess.Popen([sys.executable, "-c", LAUNCH, str(size), chr(ord("a") + i % 26),
                               root.node(0)], env=token_env(token), stdout=subprocess.PIPE,
                              start_new_session=True) for i in range(N)]
    for p in procs:
        assert p.stdout.readline() == b"ok\n"
    return procs, [_length(root.node(0), size)] * N


# Runs xpuctl and prints its own peak RSS (VmHWM: of its memory since exec, never of the
# process that started it) at exit; the CLI leaves through os._exit after the exit handlers.
MEASURED = """
import atexit, runpy, sys
def peak():
    with open("/proc/self/status") as f:
        hwm = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    print("VmHWM", hwm, file=sys.stderr)
atexit.register(peak)
sys.argv = ["xpuctl", *sys.argv[1:]]
runpy.run_module("xpuctl", run_name="__main__")
"""


def _run(root) -> tuple[bytes, int, int]:
    """`xpuctl --root R ps --json --all`: (stdout, exit code, its peak RSS in KiB)."""
    p = subprocess.run([sys.executable, "-c", MEASURED, "--root", root.root, "ps", "--json",
                        "--all"], capture_output=True, timeout=120)
    hwm = [line.split()[1] for line in p.stderr.decode().splitlines() if line.startswith("VmHWM")]
    assert hwm, p.stderr
    return p.stdout, p.returncode, int(hwm[-1])


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _mine(out: bytes, procs: list[subprocess.Popen]) -> tuple[dict[int, dict], int]:
    """ps's entries for our processes, and how many others it listed (/proc is the
    machine's: other tests' vLLM stand-ins show up too)."""
    listed = json.loads(out)["processes"]
    pids = {p.pid for p in procs}
    mine = {p["pid"]: p for p in listed if p["pid"] in pids}
    return mine, len(listed) - len(mine)


@pytest.mark.slow
def test_ps_json_of_twenty_two_mib_command_lines_is_bounded(standin_root, proc_token):
    short, _ = _start(standin_root, proc_token, 64)
    try:
        base_out, code, base_rss = _run(standin_root)
        assert code == 0 and len(_mine(base_out, short)[0]) == N
    finally:
        _stop(short)
    assert wait_for(lambda: not _mine(_run(standin_root)[0], short)[0], 30)
    procs, lengths = _start(standin_root, proc_token, LONG)
    try:
        out, code, rss = _run(standin_root)
    finally:
        _stop(procs)
    assert code == 0
    by_pid, others = _mine(out, procs)
    assert len(by_pid) == N
    assert len(out) < (N + others) * 12 * 1024 + 8192, len(out)  # main: 37 MiB
    for proc, length in zip(procs, lengths, strict=True):
        shown = by_pid[proc.pid]
        assert len(json.dumps(shown)) < 12 * 1024
        raw = sum(len(w.encode()) + 1 for w in shown["argv"])
        assert raw == ARGV_SHOWN_BYTES + 1  # the last word cut inside: no NUL of its own
        assert shown["argv_truncated"] == length - ARGV_SHOWN_BYTES
        assert shown["argv"][:2] == [sys.executable, "-c"]
        assert shown["cmdline"] == " ".join(shown["argv"])
    # peak RSS: the same command without the long command lines, with a generous factor
    # (main: 129 MiB)
    assert rss < base_rss * 1.5, (rss, base_rss)


@pytest.mark.slow
def test_tables_and_doctor_show_the_cut(standin_root, proc_token):
    procs, lengths = _start(standin_root, proc_token, 300_000)
    try:
        env = dict(os.environ, COLUMNS="100000")
        table = subprocess.run([sys.executable, "-m", "xpuctl", "--root", standin_root.root,
                                "ps", "--all"], capture_output=True, text=True, env=env,
                               timeout=120)
        doctor = subprocess.run([sys.executable, "-m", "xpuctl", "--root", standin_root.root,
                                 "doctor", "--json"], capture_output=True, text=True, timeout=120)
    finally:
        _stop(procs)
    cut = lengths[0] - ARGV_SHOWN_BYTES
    assert f"…[+{cut} bytes]" in table.stdout, table.stdout[-2000:]
    mine = [line for line in table.stdout.splitlines()
            if line.split()[:1] and line.split()[0] in {str(p.pid) for p in procs}]
    assert len(mine) == N and all(len(line) < 5 * 1024 for line in mine)
    holders = [p for p in json.loads(doctor.stdout)["processes"] if p["pid"] == procs[0].pid]
    assert holders and holders[0]["argv_truncated"] == cut


def test_shown_argv_cuts_at_the_cap_and_counts_the_rest():
    argv = ["python", "x" * 5000, "y"]
    words, cut = shown_argv(argv)
    assert sum(len(w) + 1 for w in words) == ARGV_SHOWN_BYTES + 1  # the last one cut inside
    assert words[0] == "python" and cut == 7 + 5001 + 2 - ARGV_SHOWN_BYTES
    assert shown_argv(argv[:1]) == (("python",), 0)
    assert shown_argv(["python"], total=100) == (("python",), 93)  # read short of the whole
    # never inside a UTF-8 sequence: a 2-byte character straddling the cap is left out
    words, cut = shown_argv(["a", "é" * 10], cap=8)
    assert words == ("a", "ééé") and cut == 2 + 21 - 8
    assert shown_command(["python", "x" * 5000]).endswith(f"…[+{5008 - 4096} bytes]")
