"""What a failed start says, read as a newcomer reads it (issue 32 §6).

- vLLM's lines once: a foreground serve echoes vLLM's output on stdout as it comes, so the
  diagnosis and the stop's timeline (stderr) do not quote them again; --detach echoes
  nothing, so there they are quoted (the diagnosis's last lines, the timeline's `vllm` steps).
- one command to run next: the phase's hint and the advice name no command; one line
  `xpuctl: next step: ...` does (reset when the stop had to escalate or left something,
  else doctor), scoped to the run's devices.

The start hangs in oneCCL init (the fake vLLM's `hang-startup`: its workers log vLLM 0.32's
`backend=xccl` line and never get further) and misses a 2 s readiness deadline.
"""

from __future__ import annotations

import re

from serverig import BDF0, BDF1

COMMAND = re.compile(r"\bxpuctl (?:reset|doctor|shutdown|serve)\b")


def _hung_start(rig, name: str, detach: bool):
    res = rig.serve(name=name, detach=detach, ready=2, teardown=2, opts=["--preflight", "fast"],
                    env={"FAKE_VLLM_FAULTS": "hang-startup"})
    assert res.rc == 4, str(res)
    return res


def test_a_foreground_failure_shows_vllms_lines_once(rig):
    res = _hung_start(rig, "fg", detach=False)
    both = res.out + res.err
    for line in ("vLLM API server version", "backend=xccl",
                 "[shutdown] EngineCore: trigger received signal=SIGTERM"):
        # backend=xccl: one line per worker (TP 2), each once
        want = 2 if line == "backend=xccl" else 1
        assert both.count(line) == want, (line, str(res))
    assert "[shutdown]" in res.out and "[shutdown]" not in res.err, str(res)
    assert "not ready after 2s" in res.err and "xpuctl:   | " not in res.err, str(res)
    rig.assert_clean()


def test_a_detached_failure_quotes_vllms_lines_once(rig):
    res = _hung_start(rig, "bg", detach=True)
    assert res.out == "", str(res)  # nothing echoed: the diagnosis quotes the log
    assert res.err.count("vLLM API server version") == 1, str(res)
    assert res.err.count("[shutdown] EngineCore: trigger received signal=SIGTERM") == 1, str(res)
    rig.assert_clean()


def test_a_failed_start_names_one_command_to_run_next(rig):
    res = _hung_start(rig, "nx", detach=False)
    named = [line for line in res.err.splitlines() if COMMAND.search(line)]
    assert len(named) == 1, str(res)
    assert re.fullmatch(rf"xpuctl: next step: xpuctl (reset|doctor) --device {BDF0},{BDF1}",
                        named[0]), named
    assert res.err.rstrip().endswith(named[0]), str(res)  # said last, once
    assert "a longer --ready-timeout" in res.err  # the advice stays: settings, not commands
    rig.assert_clean()
