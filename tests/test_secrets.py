"""Secrets never leave the host (issue 29 §5).

On main a snapshot copied `VLLM_API_KEY`, `HF_TOKEN` and every `--api-key` from process
environments and command lines into the archive, its manifest, the run records and the log
tails; `ps --json` and `doctor --json` printed them too. Now names stay and values are
`<redacted>` everywhere a command line or an environment is shown or archived
(parse/redact.py).

The log line shapes scrubbed are vLLM's own: `non-default args: {..., 'api_key': [...]}`
(vllm/entrypoints/utils.py `log_non_default_args`, which the fake vLLM copies) and an
`Authorization: Bearer` header.
"""

from __future__ import annotations

import io
import json
import tarfile
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from proctools import start_fake_vllm
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.parse import redact
from xpuctl.state import runs

runner = CliRunner()
# distinctive values: none of them can appear in an archive by chance
ARG_KEY, ARG_TOKEN = "s3cret-arg-key-7781", "hf_arg_token_5521"
ENV_KEY, ENV_TOKEN, ENV_PASSWORD = "s3cret-env-key-9913", "hf_env_token_2207", "pw-env-3141"
CALLER_TOKEN = "caller-token-4471"
SECRETS = (ARG_KEY, ARG_TOKEN, ENV_KEY, ENV_TOKEN, ENV_PASSWORD, CALLER_TOKEN)
NAMES = ("VLLM_API_KEY", "HF_TOKEN", "MY_PASSWORD", "--api-key", "--hf-token")
SECRET_ARGS = ["--api-key", ARG_KEY, f"--hf-token={ARG_TOKEN}"]
SECRET_ENV = {"VLLM_API_KEY": ENV_KEY, "HF_TOKEN": ENV_TOKEN, "MY_PASSWORD": ENV_PASSWORD}


def _all_bytes(archive: str) -> bytes:
    """Every member of the archive, decompressed, with its name."""
    out = io.BytesIO()
    with tarfile.open(archive) as tf:
        for m in tf:
            out.write(m.name.encode() + b"\n")
            if m.isfile():
                out.write(tf.extractfile(m).read())
    return out.getvalue()


@pytest.fixture
def secret_server(standin_root, proc_token, tmp_path):
    """A (fake) vLLM with secrets in its argv and environment, and a run record for it
    whose log is the server's own (which logs its non-default args, api_key included)."""
    fv = start_fake_vllm(proc_token, standin_root.root, workdir=tmp_path, args=SECRET_ARGS,
                         env=SECRET_ENV)
    assert fv.wait_ready(60), fv.log()
    assert ARG_KEY in fv.log()  # vLLM's "non-default args" line carries it
    with open(fv.log_path, "a") as f:
        f.write(f"debug: request Authorization: Bearer {ARG_KEY}x\n")
    state = tmp_path / "state"
    sdir = runs.ensure_state_dir(str(state))
    runs.write_record(sdir, runs.RunRecord(
        name="secret", run_id="r-secret", pid=fv.proc.pid, start_ticks=None, session=None,
        command=["vllm", "serve", "fake-model", "--port", str(fv.port), *SECRET_ARGS,
                 "--hf-token", ENV_TOKEN],
        devices=["0"], port=fv.port, bind="127.0.0.1", shutdown_timeout=30, drain_timeout=30.0,
        teardown_timeout=20.0, log_path=str(fv.log_path), state="ready", started_at=time.time(),
        last_lines=[f"INFO non-default args: {{'api_key': ['{ARG_KEY}']}}"],
        notes=[f"started with HF_TOKEN={ENV_TOKEN}"]))
    return standin_root, fv, state


@pytest.mark.slow
def test_snapshot_keeps_the_names_and_none_of_the_values(secret_server, tmp_path):
    root, fv, state = secret_server
    archive = str(tmp_path / "snap.tar.gz")
    result = runner.invoke(app, ["--root", root.root, "snapshot", "-o", archive, "--state-dir",
                                 str(state)],
                           env={"HF_TOKEN": CALLER_TOKEN, "VLLM_API_KEY": CALLER_TOKEN})
    assert result.exit_code == 0, result.output
    blob = _all_bytes(archive)
    for value in SECRETS:
        assert value.encode() not in blob, value
    for name in NAMES:
        assert name.encode() in blob, name
    assert blob.count(b"<redacted>") >= 8
    with tarfile.open(archive) as tf:
        files = {m.name.split("/", 1)[1]: tf.extractfile(m).read() for m in tf if m.isfile()}
    env = files[f"root/proc/{fv.proc.pid}/environ"]
    assert b"HF_TOKEN=<redacted>\0" in env and b"MY_PASSWORD=<redacted>\0" in env
    assert json.loads(files["manifest.json"])["caller_env"]["HF_TOKEN"] == "<redacted>"
    record = json.loads(files["state/runs/secret.json"])
    assert record["command"][5:8] == ["--api-key", "<redacted>", "--hf-token=<redacted>"]
    assert "'api_key': '<redacted>'" in files["state/logs/secret.log"].decode()
    # read back: the same processes, roles and port, values still hidden
    back = runner.invoke(app, ["ps", "--json", "--from", archive])
    assert back.exit_code == 0, back.output
    top = next(p for p in json.loads(back.stdout)["processes"] if p["pid"] == fv.proc.pid)
    assert top["role"] == "api-server" and "<redacted>" in top["argv"]


@pytest.mark.slow
def test_ps_and_doctor_show_no_secret(secret_server):
    root, fv, _ = secret_server
    outputs = []
    for args in (["ps", "--json", "--all"], ["ps", "--all"], ["doctor", "--json"], ["doctor"]):
        result = runner.invoke(app, ["--root", root.root, *args], env={"COLUMNS": "400"})
        assert result.exit_code in (0, 1), result.output
        outputs.append(result.stdout)
    for value in SECRETS:
        assert not any(value in out for out in outputs), value
    ps = json.loads(outputs[0])
    top = next(p for p in ps["processes"] if p["pid"] == fv.proc.pid)
    assert top["argv"][-3:] == ["--api-key", "<redacted>", "--hf-token=<redacted>"]
    assert "--api-key <redacted>" in top["cmdline"]
    assert str(fv.port) in top["argv"]  # the rest is as it was


# --- the rules, on their own ---------------------------------------------------------------


def test_argv_redaction_rules():
    argv = ["vllm", "serve", "m", "--api-key", "a1", "--api-key=a2", "--hf_token", "a3",
            "--password", "a4", "--client-secret=a5", "-e", "HF_TOKEN=a6", "--tokenizer", "t",
            "--max-num-batched-tokens", "8192", "--no-auth", "--port", "8000", "--apikey", "a7"]
    assert redact.argv(argv) == [
        "vllm", "serve", "m", "--api-key", "<redacted>", "--api-key=<redacted>", "--hf_token",
        "<redacted>", "--password", "<redacted>", "--client-secret=<redacted>", "-e",
        "HF_TOKEN=<redacted>", "--tokenizer", "t", "--max-num-batched-tokens", "8192",
        "--no-auth", "--port", "8000", "--apikey", "<redacted>"]
    assert redact.secret_values(argv) == {"a1", "a2", "a3", "a4", "a5", "a6", "a7"} - {
        v for v in ("a1", "a2", "a3", "a4", "a5", "a6", "a7") if len(v) < redact.MIN_SCRUBBED}
    assert redact.cmdline(b"vllm\0--api-key\0k\0") == b"vllm\0--api-key\0<redacted>\0"


def test_environment_names_stay_and_values_go():
    for name in ("VLLM_API_KEY", "HF_TOKEN", "MY_PASSWORD", "db_passwd", "AWS_SECRET_ACCESS_KEY",
                 "GOOGLE_APPLICATION_CREDENTIALS", "AUTH_HEADER", "NPM_TOKEN"):
        assert redact.secret_name(name), name
        assert redact.env_dict({name: "v", "PATH": "/bin"}) == {name: "<redacted>"}
    assert not redact.secret_name("ZE_AFFINITY_MASK")


def test_free_text_shapes():
    line = ("INFO utils.py:233 non-default args: {'model_tag': 'm', 'api_key': ['k-one'], "
            "'hf_token': 'k-two', 'max_num_batched_tokens': 8192} HF_TOKEN=k-three "
            "Authorization: Bearer k-four --api-key k-five token_count=12")
    out = redact.scrub(line, {"other-value"})
    for value in ("k-one", "k-two", "k-three", "k-four", "k-five"):
        assert value not in out, out
    assert "'max_num_batched_tokens': 8192" in out and "token_count=12" in out
    assert redact.scrub("the other-value here", {"other-value"}) == "the <redacted> here"
    assert redact.scrub(out) == out  # idempotent


@given(st.lists(st.text(max_size=12), max_size=12))
def test_argv_redaction_keeps_the_shape(argv):
    out = redact.argv(argv)
    assert len(out) == len(argv)
    assert redact.argv(out) == out
    for word, shown in zip(argv, out, strict=True):
        assert shown == word or "<redacted>" in shown


@given(st.text(max_size=200))
def test_scrub_never_grows_a_secret(text):
    once = redact.scrub(text, {"abcd"})
    assert "abcd" not in once
    assert redact.scrub(once, {"abcd"}) == once
    assert once.count("\n") == text.count("\n")  # one line stays one line


def test_hostile_nesting_and_long_words_are_read_once():
    """A command line is host text any user controls: `x=x=x=...` once recursed a level per
    pair (RecursionError, exit 70 for ps and doctor) and a long word was read once per
    character (`ps --json` of 2 MiB command lines ran past the reader's timeout:
    tests/test_bounded_output.py). Both end, and a secret after them is still found."""
    from xpuctl.parse import redact

    for hostile in ("x=" * 50_000, "x='" * 30_000, "a" * 300_000, "a.b" * 100_000,
                    "'k': '" * 20_000):
        text = hostile + " api_key='sk-after-the-noise'"
        assert "sk-after-the-noise" not in redact.scrub(text)
        shown = redact.argv(["vllm", hostile, "--api-key", "sk-after-the-noise"])
        assert "sk-after-the-noise" not in shown


def test_a_scan_keeps_only_the_kept_variables_of_another_process(tmp_path):
    """/proc/<pid>/environ is NAME=VALUE words separated by NULs (proc(5)); the first of a
    name counts, as procfs.parse_environ. Of another process's environment a scan keeps the
    variables it reads (XPUCTL_RUN_ID, ZE_AFFINITY_MASK, CCL_KVS_PORT among the kept
    prefixes), a secret among them as its name only, and nothing else, never decoded."""
    import fakehost as fh

    from xpuctl.host.scan import take_scan
    from xpuctl.host.seam import Host

    h = fh.healthy_host(tmp_path / "h")
    h.add_process(6100, 1, ["/usr/bin/python3", "train.py"], start_ticks=h.ticks(3700),
                  environ={"HOME": "/root", "HF_TOKEN": "hf-secret-value", "ZE_AFFINITY_MASK": "1",
                           "VLLM_API_KEY": "sk-secret-value", "CCL_KVS_PORT": "29500",
                           "PATH": "/bin"},
                  fds={9: "/dev/dri/renderD129"}, fdinfo={9: fh.xe_fdinfo(57, fh.BDF1, [fh.GiB])})
    (p,) = [p for p in take_scan(Host(h.root, read_timeout=None)).processes if p.pid == 6100]
    assert p.env == {"ZE_AFFINITY_MASK": "1", "VLLM_API_KEY": "<redacted>", "CCL_KVS_PORT": "29500"}
    assert redact.kept_environ(b"ZE_X=1\0HOME=/\0ZE_X=2\0broken\0SPT_NOENV=1\0SPT_NOENVX=1\0") == {
        "ZE_X": "1", "SPT_NOENV": "1"}


def test_the_length_of_a_command_line_is_the_redacted_ones(tmp_path):
    """`cmdline_bytes` (what `ps` says was cut) counts the command line as shown: each
    secret as `<redacted>`. setproctitle pads its title with NULs (procfs.parse_cmdline):
    the padding after a secret option is no word, and no value of it."""
    import fakehost as fh

    from xpuctl.host.procfiles import read_argv
    from xpuctl.host.seam import Host

    h = fh.FakeHost(tmp_path / "h")
    h.add_process(6200, 1, [], cmdline_bytes=b"vllm\0serve\0--api-key\0k1\0\0\0\0\0", comm="vllm")
    h.add_process(6201, 1, [], cmdline_bytes=b"vllm\0serve\0m\0", comm="vllm")
    host = Host(h.root, read_timeout=None)
    argv, nbytes = read_argv(host, 6200)
    assert argv == ["vllm", "serve", "--api-key", "<redacted>"]
    assert nbytes == len(b"vllm\0serve\0--api-key\0<redacted>\0\0\0\0\0")
    assert read_argv(host, 6201) == (["vllm", "serve", "m"], len(b"vllm\0serve\0m\0"))
