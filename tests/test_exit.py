"""How the installed entry point starts and leaves (cli.main, cli.leave): the collector,
paused while the modules load, runs again for the command; the exit keeps its status, its
exit handlers and its silence on a closed pipe, without the interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys

import fakehost as fh
import proctools

DEADLINE = 60  # a command that hangs fails the test; generous for a slow machine


def _xpuctl(*args: str, token: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xpuctl", *args], capture_output=True, text=True,
                          timeout=DEADLINE, env=proctools.token_env(token), stdin=subprocess.DEVNULL)


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
    assert ran.stdout.splitlines()[-1].split() == ["collector", "True"]


_ADOPTER = r"""
import ctypes, os, subprocess, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit("no subreaper")
subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, timeout=60)
deadline = time.monotonic() + 0.5
while True:  # what xpuctl left: orphans reparented here, reaped or not
    left = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if d.isdigit() and int(fields[1]) == os.getpid():
            left.append(stat.split("(", 1)[1].rsplit(")", 1)[0] + ":" + fields[0])
    if not left or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(" ".join(sorted(left)))
while True:  # reap whatever was left, so nothing outlives this test
    try:
        if os.waitpid(-1, 0)[0] == 0:
            break
    except ChildProcessError:
        break
"""


def test_a_command_reaps_its_reader_before_it_leaves(tmp_path):
    """A process that reaps nothing it inherits (PID 1 of this machine and of many
    containers) kept a zombie `xpuctl-reader` of every doctor run: the reader was told to
    leave at exit, not waited for. An adopter standing in for such a parent (a subreaper)
    finds nothing of xpuctl's left once xpuctl has exited."""
    h = fh.orphan_host(tmp_path / "root")
    ran = subprocess.run([sys.executable, "-c", _ADOPTER, sys.executable, "-m", "xpuctl",
                          "--root", str(h.root), "doctor", "--json"],
                         capture_output=True, text=True, timeout=DEADLINE)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "", f"left behind: {ran.stdout}"
