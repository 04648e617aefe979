"""`xpuctl logs NAME`: the run's log through its record, -n, terminal escaping, --follow.

The runs here are made by hand (a record in a state directory) so each case is exact; the
"supervisor" of a followed run is a real sleeping process this test starts (and reaps). The
end-to-end case with the fake vLLM is in test_serve.py.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import proctools
import pytest

from xpuctl.runlog import start_of_last_lines
from xpuctl.state import runs

XPUCTL = [sys.executable, "-m", "xpuctl"]


def make_run(state: Path, name: str, content: bytes, supervisor: int | None = None,
             state_name: str = "stopped") -> runs.RunRecord:
    sdir = runs.ensure_state_dir(str(state))
    log = os.path.join(sdir, "logs", f"{name}.log")
    with open(log, "wb") as fh:
        fh.write(content)
    rec = runs.RunRecord(name=name, run_id="0123456789abcdef", pid=None, start_ticks=None,
                         session=None, command=["vllm", "serve", "m"], devices=[], port=8000,
                         bind="127.0.0.1", shutdown_timeout=30, drain_timeout=10.0,
                         teardown_timeout=20.0, log_path=log, state=state_name,
                         supervisor_pid=supervisor)
    runs.write_record(sdir, rec)
    return rec


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C as at an operator's terminal (a background suite ignores it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def xpuctl(state: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "XPUCTL_STATE_DIR": str(state)}
    return subprocess.run([*XPUCTL, *args], capture_output=True, env=env, timeout=60, **kw)


LOG = b"".join(b"line %d\n" % i for i in range(1, 11))


def test_known_run_prints_its_log_bytes_unchanged_into_a_pipe(tmp_path):
    raw = LOG + b"colour \x1b[31mred\x1b[0m and a stray byte \xff\n"
    make_run(tmp_path / "s", "vllm-8000", raw)
    out = xpuctl(tmp_path / "s", "logs", "vllm-8000")
    assert out.returncode == 0, out.stderr
    assert out.stdout == raw  # a script gets the file it would get with cat
    assert out.stderr == b""


def test_unknown_run_exits_3_and_names_the_known_ones(tmp_path):
    make_run(tmp_path / "s", "vllm-8000", LOG)
    out = xpuctl(tmp_path / "s", "logs", "vllm-9000")
    assert out.returncode == 3
    assert out.stdout == b""
    err = out.stderr.decode()
    assert err.count("\n") == 1 and "no run named 'vllm-9000'" in err and "known runs: vllm-8000" in err
    # no state directory at all: still "not found", and nothing is created
    out = xpuctl(tmp_path / "none", "logs", "vllm-8000")
    assert out.returncode == 3 and not (tmp_path / "none").exists()


@pytest.mark.parametrize("n, want", [(0, b""), (1, b"line 10\n"), (3, b"line 8\nline 9\nline 10\n"),
                                     (10, LOG), (50, LOG)])
def test_lines_prints_the_last_n(tmp_path, n, want):
    make_run(tmp_path / "s", "r", LOG)
    out = xpuctl(tmp_path / "s", "logs", "r", "-n", str(n))
    assert out.returncode == 0 and out.stdout == want
    out = xpuctl(tmp_path / "s", "logs", "r", "--lines", str(n))
    assert out.stdout == want


def test_last_lines_across_blocks_and_without_a_final_newline(tmp_path):
    p = tmp_path / "big"
    body = b"".join(b"%06d %s\n" % (i, b"x" * (i % 97)) for i in range(20000))  # >1 MiB
    p.write_bytes(body + b"partial")
    lines = (body + b"partial").split(b"\n")
    with open(p, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        for n in (1, 2, 5000, 19999, 20001, 30000):
            off = start_of_last_lines(fh, n, size)
            fh.seek(off)
            assert fh.read().split(b"\n") == lines[-n:], n


def _run_on_a_terminal(cmd: list[str], env: dict[str, str]) -> tuple[int, bytes]:
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.PIPE, env=env)
        os.close(slave)
        chunks = []
        while True:
            r, _, _ = select.select([master], [], [], 30)
            if not r:
                break
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the other side closed
                break
            if not data:
                break
            chunks.append(data)
        return proc.wait(30), b"".join(chunks)
    finally:
        os.close(master)


def test_on_a_terminal_every_line_is_escaped(tmp_path):
    make_run(tmp_path / "s", "r", b"plain\n\x1b]0;owned\x07title \x1b[2J\xff\nlast no newline")
    env = {**os.environ, "XPUCTL_STATE_DIR": str(tmp_path / "s")}
    rc, out = _run_on_a_terminal([*XPUCTL, "logs", "r"], env)
    assert rc == 0
    text = out.decode().replace("\r\n", "\n")
    assert "\x1b" not in text and "\x07" not in text
    assert text == "plain\n\\x1b]0;owned\\x07title \\x1b[2J\\xff\nlast no newline\n"


@pytest.mark.slow
def test_follow_prints_new_lines_survives_truncation_and_rotation_and_ends_with_the_run(tmp_path, proc_token):
    sup = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                           env=proctools.token_env(proc_token))
    try:
        rec = make_run(tmp_path / "s", "r", b"old 1\nold 2\n", supervisor=sup.pid, state_name="ready")
        log = Path(rec.log_path)
        env = {**os.environ, "XPUCTL_STATE_DIR": str(tmp_path / "s")}
        out_path = tmp_path / "out"
        with open(out_path, "wb") as out:
            follower = subprocess.Popen([*XPUCTL, "logs", "r", "-f", "-n", "1"], stdout=out,
                                        stderr=subprocess.PIPE, env=env)
        try:
            def shows(text: bytes) -> bool:
                return text in out_path.read_bytes()

            assert proctools.wait_for(lambda: shows(b"old 2\n"), 30), out_path.read_bytes()
            with open(log, "ab") as fh:
                fh.write(b"new 1\n")
            assert proctools.wait_for(lambda: shows(b"new 1\n"), 30)
            with open(log, "r+b") as fh:  # truncated (copytruncate rotation)
                fh.truncate(0)
            time.sleep(0.5)  # let the follower see the smaller file before it grows again
            with open(log, "ab") as fh:
                fh.write(b"after truncate\n")
            assert proctools.wait_for(lambda: shows(b"after truncate\n"), 30)
            os.rename(log, str(log) + ".1")  # rotated: renamed, a new file in its place
            with open(str(log) + ".1", "ab") as fh:
                fh.write(b"late in the old file\n")
            log.write_bytes(b"in the new file\n")
            assert proctools.wait_for(lambda: shows(b"in the new file\n"), 30), out_path.read_bytes()
            assert follower.poll() is None  # the run is alive: still following
            with open(log, "ab") as fh:
                fh.write(b"last words\n")
            sup.kill()
            sup.wait(10)
            assert follower.wait(30) == 0
            got = out_path.read_bytes()
            assert got == (b"old 2\nnew 1\nafter truncate\nlate in the old file\n"
                           b"in the new file\nlast words\n"), got
            err = follower.stderr.read().decode()
            assert "was truncated" in err and "was replaced" in err, err
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait(10)
            follower.stderr.close()
    finally:
        if sup.poll() is None:
            sup.kill()
        sup.wait(10)


def test_follow_of_a_finished_run_prints_and_returns(tmp_path):
    make_run(tmp_path / "s", "r", LOG, supervisor=None, state_name="stopped")
    out = xpuctl(tmp_path / "s", "logs", "r", "--follow")
    assert out.returncode == 0 and out.stdout == LOG


def test_follow_with_a_recycled_supervisor_pid_does_not_wait(tmp_path):
    """The record's supervisor pid now names a process that started after vLLM: not ours."""
    rec = make_run(tmp_path / "s", "r", LOG, supervisor=os.getpid(), state_name="ready")
    rec.start_ticks = 0  # "vLLM" started at boot, before this test process: pid reused
    runs.write_record(str(tmp_path / "s"), rec)
    out = xpuctl(tmp_path / "s", "logs", "r", "-f")
    assert out.returncode == 0 and out.stdout == LOG


@pytest.mark.slow
def test_follow_interrupted_exits_130(tmp_path, proc_token):
    sup = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                           env=proctools.token_env(proc_token))
    try:
        make_run(tmp_path / "s", "r", LOG, supervisor=sup.pid, state_name="ready")
        env = {**os.environ, "XPUCTL_STATE_DIR": str(tmp_path / "s")}
        out_path = tmp_path / "out"
        with open(out_path, "wb") as out:
            # a test run started in the background by a non-interactive shell inherits SIGINT
            # ignored, and Python keeps it ignored: give the follower the default, as a terminal would
            follower = subprocess.Popen([*XPUCTL, "logs", "r", "-f"], stdout=out,
                                        stderr=subprocess.PIPE, env=env,
                                        preexec_fn=_default_sigint)  # noqa: PLW1509 (no threads)
        try:
            assert proctools.wait_for(lambda: out_path.read_bytes() == LOG, 30)
            follower.send_signal(signal.SIGINT)
            assert follower.wait(30) == 130
            assert follower.stderr.read() == b"xpuctl: interrupted\n"
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait(10)
            follower.stderr.close()
    finally:
        sup.kill()
        sup.wait(10)


# vLLM 0.32 logs its own arguments at start (vllm/entrypoints/utils.py, log_non_default_args:
# "non-default args: {...}"), the API keys among them; a client's Authorization header can
# reach an access log. `xpuctl logs` is an output of xpuctl: secrets of these shapes never
# leave through it (issue 36 item 9), in a pipe or on a terminal; every other byte is kept.
SECRET_LOG = (
    b"(APIServer pid=4242) INFO 12-06 04:00:00 [utils.py:253] non-default args: "
    b"{'model': 'tiny', 'api_key': ['sk-first-secret', 'sk-second-secret']}\n"
    b"INFO:     127.0.0.1:5555 - Authorization: Bearer sk-header-secret\n"
    b"a line without secrets, a stray byte \xff\n"
    b"hf_overrides={\"hf_token\": \"hf_jsonsecret\"} and no newline at the end"
)


def test_logs_redact_secret_shapes_in_a_pipe_and_keep_every_other_byte(tmp_path):
    make_run(tmp_path / "s", "vllm-8000", SECRET_LOG)
    out = xpuctl(tmp_path / "s", "logs", "vllm-8000")
    assert out.returncode == 0, out.stderr
    for secret in (b"sk-first-secret", b"sk-second-secret", b"sk-header-secret",
                   b"hf_jsonsecret"):
        assert secret not in out.stdout, out.stdout
    assert b"'model': 'tiny'" in out.stdout
    assert b"a line without secrets, a stray byte \xff\n" in out.stdout
    assert out.stdout.endswith(b"and no newline at the end")  # nothing added
    assert out.stdout.count(b"\n") == SECRET_LOG.count(b"\n")


def test_logs_redact_secret_shapes_on_a_terminal(tmp_path):
    make_run(tmp_path / "s", "vllm-8000", SECRET_LOG)
    env = {**os.environ, "XPUCTL_STATE_DIR": str(tmp_path / "s")}
    rc, out = _run_on_a_terminal([*XPUCTL, "logs", "vllm-8000"], env)
    assert rc == 0
    shown = out.decode()
    assert "'model': 'tiny'" in shown
    for secret in ("sk-first-secret", "sk-second-secret", "sk-header-secret", "hf_jsonsecret"):
        assert secret not in shown, shown
