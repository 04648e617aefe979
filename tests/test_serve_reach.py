"""serve reaches vLLM the way it is configured (issue 36 items 1, 4, 6, 7, 8), end to end
against the fake vLLM taught each option:

- `--api-key K1 K2` and `VLLM_API_KEY`: vLLM 0.32's `entrypoints/serve/middleware/authenticate.py` guards
  `/v1`, `/v2` and `/inference` (401 without `Authorization: Bearer <key>`), `/health` and
  `/metrics` stay open. The run becomes ready and stays untouched; no key in serve's lines,
  the record or the audit log;
- HTTPS (`--ssl-keyfile`/`--ssl-certfile`, vLLM's `entrypoints/launchers/cli_args.py`) with a
  CA serve verifies against, and with a self-signed certificate; mutual TLS
  (`--ssl-cert-reqs 2`) without a client certificate of serve's own (readiness from vLLM's
  "Application startup complete." line, said once) and with `--probe-cert`/`--probe-key`;
- `--uds PATH`: HTTP on a unix socket, no port;
- vLLM exiting 4 by itself: serve exits 1, vLLM's status in the record and its last line;
  the record says `stopping`/`exited` while the ladder still runs;
- two and three quick SIGINTs while vLLM starts, once ready, during the stop and its kill
  pass: the ladder completes, the exit is from the table (never 70);
- the run's devices from `ZE_AFFINITY_MASK` of vLLM's environment.

Each configuration has its control: the same configuration with a real engine death
(`die-inside`: EngineCore's fatal error, /health 503) is still caught and stopped (exit 7).
Short watch intervals; deadlines generous.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import ssl
import time
from pathlib import Path

import pytest
from certs import Certs, make_certs
from proctools import wait_for
from serverig import BDF0, BDF1, Foreground, Rig, audit_lines, running, wait_ready

pytestmark = pytest.mark.slow

WATCH = ["--health-interval", "0.5", "--unhealthy-after", "2", "--stall-after", "5"]
KEYS = ("k1-xpuctl-secret-one", "k2-xpuctl-secret-two")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def checks_after(rig: Rig, name: str, n: int) -> None:
    """Wait until the watch recorded `n` more checks (an outcome, not a time)."""
    def checked() -> float:
        return float((rig.record(name).get("health") or {}).get("checked_at") or 0)

    first = checked()
    assert wait_for(lambda: checked() >= first + n * 0.5, 60, 0.1), rig.record(name)


def stop(fg: Foreground, sig: int = signal.SIGINT) -> int:
    fg.proc.send_signal(sig)
    return fg.proc.wait(120)


def healthy_and_untouched(rig: Rig, fg: Foreground) -> None:
    wait_ready(rig, fg)
    checks_after(rig, fg.name, 6)
    rec = rig.record(fg.name)
    assert rec["state"] == "ready" and rec["health"]["state"] == "healthy", rec
    assert fg.proc.poll() is None, str(fg)
    got = rig.xpuctl("health", fg.name, "--state-dir", rig.state)
    assert got.rc == 0, str(got)


def caught(rig: Rig, fg: Foreground) -> None:
    """The control: a real engine death under the same configuration is caught (exit 7)."""
    wait_ready(rig, fg)
    (rig.tmp / "fault-now").touch()
    assert fg.proc.wait(120) == 7, str(fg)
    rec = rig.record(fg.name)
    assert rec["state"] == "failed" and rec["reason"].startswith("unhealthy:"), rec


def die_inside(rig: Rig, **extra: str) -> dict[str, str]:
    return {"FAKE_VLLM_FAULTS": "die-inside", "FAKE_VLLM_FAULT_FILE": str(rig.tmp / "fault-now"),
            **extra}


def no_secret(rig: Rig, fg: Foreground, secrets: tuple[str, ...]) -> None:
    """serve's own lines, the record and the audit log never hold a key (vLLM's own lines,
    which serve echoes, are the redaction's business)."""
    mine = "\n".join(line for line in fg.err().splitlines() if line.startswith("xpuctl:"))
    texts = [mine, json.dumps(rig.record(fg.name)), json.dumps(audit_lines(rig))]
    for secret in secrets:
        for text in texts:
            assert secret not in text, text


def get(port: int, path: str, key: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        return conn.getresponse().status
    finally:
        conn.close()


# -- the API key -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["flag", "env"])
def test_api_key_ready_and_untouched(rig, how):
    args = ("--api-key", *KEYS) if how == "flag" else ()
    env = {"VLLM_API_KEY": KEYS[0]} if how == "env" else {}
    fg = rig.serve_bg(*args, opts=WATCH, env=env)
    try:
        healthy_and_untouched(rig, fg)
        # the fake guards /v1 as vLLM does: the probe needed the key
        assert get(fg.port, "/v1/models") == 401
        assert get(fg.port, "/v1/models", KEYS[-1] if how == "flag" else KEYS[0]) == 200
        assert get(fg.port, "/health") == 200 and get(fg.port, "/metrics") == 200
    finally:
        code = stop(fg)
    assert code == 0, str(fg)
    no_secret(rig, fg, KEYS)
    assert rig.record(fg.name)["state"] == "stopped"
    rig.assert_clean()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_api_key_control_engine_death_caught(rig, how):
    args = ("--api-key", *KEYS) if how == "flag" else ()
    env = die_inside(rig, **({"VLLM_API_KEY": KEYS[0]} if how == "env" else {}))
    fg = rig.serve_bg(*args, opts=WATCH, env=env)
    caught(rig, fg)
    no_secret(rig, fg, KEYS)
    rig.assert_clean()


def test_a_key_after_an_equals_sign_and_a_bad_probe_cert(rig):
    """`--api-key=K` is read too; a --probe-cert serve cannot load is a usage error (2)
    before anything starts."""
    fg = rig.serve_bg(f"--api-key={KEYS[0]}", opts=WATCH)
    try:
        wait_ready(rig, fg)
        assert get(fg.port, "/v1/models") == 401
    finally:
        assert stop(fg) == 0, str(fg)
    no_secret(rig, fg, KEYS[:1])
    bad = rig.tmp / "not-a-cert.pem"
    bad.write_text("nothing\n")
    got = rig.serve(opts=["--probe-cert", str(bad)], detach=False)
    assert got.rc == 2 and "--probe-cert" in got.err, str(got)


# -- HTTPS and mutual TLS -------------------------------------------------------------------


def tls_args(pair, ca: str | None = None, reqs: int | None = None) -> list[str]:
    args = ["--ssl-keyfile", pair.key, "--ssl-certfile", pair.cert]
    if ca:
        args += ["--ssl-ca-certs", ca]
    if reqs is not None:
        args += ["--ssl-cert-reqs", str(reqs)]
    return args


@pytest.mark.parametrize("kind", ["ca", "self-signed", "wrong-ca"])
def test_https_ready_and_untouched(rig, certs, kind):
    """Verified against --ssl-ca-certs when it vouches for the server; a self-signed
    certificate (no CA given), or one the CA given does not vouch for, is no reason to stop a
    server: the second is said once."""
    pair = certs.self_signed if kind != "ca" else certs.server
    fg = rig.serve_bg(*tls_args(pair, None if kind == "self-signed" else certs.ca),
                      opts=WATCH)
    try:
        healthy_and_untouched(rig, fg)
        assert f"ready on https://127.0.0.1:{fg.port}" in fg.err(), str(fg)
    finally:
        assert stop(fg) == 0, str(fg)
    said = fg.err().count("does not verify against --ssl-ca-certs")
    assert said == (1 if kind == "wrong-ca" else 0), str(fg)
    rig.assert_clean()


def test_https_control_engine_death_caught(rig, certs):
    fg = rig.serve_bg(*tls_args(certs.server, certs.ca), opts=WATCH, env=die_inside(rig))
    caught(rig, fg)
    assert "/health answered" in rig.record(fg.name)["reason"], rig.record(fg.name)  # reached
    rig.assert_clean()


def mtls_status(port: int, certs: Certs, client: bool) -> int | str:
    ctx = ssl.create_default_context(cafile=certs.ca)
    ctx.check_hostname = False
    if client:
        ctx.load_cert_chain(certs.client.cert, certs.client.key)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return int(s.recv(64).split()[1])
    except (ssl.SSLError, OSError) as exc:
        return type(exc).__name__


def test_mutual_tls_without_a_client_cert_judges_from_what_it_sees(rig, certs):
    """No client certificate of serve's own: said once, ready from vLLM's startup line and
    its processes, never stopped for it."""
    fg = rig.serve_bg(*tls_args(certs.server, certs.ca, 2), opts=WATCH)
    try:
        healthy_and_untouched(rig, fg)
        assert mtls_status(fg.port, certs, client=True) == 200
        assert mtls_status(fg.port, certs, client=False) != 200  # the server asks for one
    finally:
        assert stop(fg) == 0, str(fg)
    assert fg.err().count("serve has none (--probe-cert, --probe-key)") == 1, str(fg)
    rig.assert_clean()


def test_mutual_tls_with_the_probe_cert_probes(rig, certs):
    fg = rig.serve_bg(*tls_args(certs.server, certs.ca, 2), opts=[
        *WATCH, "--probe-cert", certs.client.cert, "--probe-key", certs.client.key])
    try:
        healthy_and_untouched(rig, fg)
        log = rig.run_log(fg.name)
        assert "GET /health" in log and "GET /v1/models" in log, log  # it knocked, and got in
    finally:
        assert stop(fg) == 0, str(fg)
    assert "serve has none" not in fg.err() and "cannot prove who it is" not in fg.err()
    rig.assert_clean()


def test_mutual_tls_with_a_probe_cert_the_server_refuses_is_never_stopped(rig, certs):
    """serve's certificate is one the server's CA does not vouch for: the server refuses the
    handshake (an alert, or a closed connection); said once, ready from vLLM's startup line,
    and the refusals never count against the run."""
    fg = rig.serve_bg(*tls_args(certs.server, certs.ca, 2), opts=[
        *WATCH, "--probe-cert", certs.self_signed.cert, "--probe-key", certs.self_signed.key])
    try:
        healthy_and_untouched(rig, fg)
    finally:
        assert stop(fg) == 0, str(fg)
    assert fg.err().count("cannot prove who it is") == 1, str(fg)
    rig.assert_clean()


@pytest.mark.parametrize("probe_cert", [False, True])
def test_mutual_tls_control_engine_death_caught(rig, certs, probe_cert):
    mine = ["--probe-cert", certs.client.cert, "--probe-key", certs.client.key]
    fg = rig.serve_bg(*tls_args(certs.server, certs.ca, 2),
                      opts=[*WATCH, *(mine if probe_cert else [])], env=die_inside(rig))
    caught(rig, fg)
    rig.assert_clean()


# -- a unix socket --------------------------------------------------------------------------


def uds_get(path: str, url: str) -> int:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return int(s.recv(64).split()[1])
    finally:
        s.close()


def test_unix_socket_ready_untouched_and_drained(rig):
    sock = str(Path(rig.root.root, "tmp", "vllm.sock"))
    fg = rig.serve_bg("--uds", sock, opts=WATCH)
    try:
        healthy_and_untouched(rig, fg)
        assert uds_get(sock, "/health") == 200
        assert f"http+unix://{sock}" in fg.err(), str(fg)
        # the shutdown's drain watch reaches it the same way
        got = rig.shutdown(fg.name, "--state-dir", rig.state)
        assert got.rc == 0, str(got)
    finally:
        code = fg.proc.wait(120)
    assert code == 0, str(fg)
    rig.assert_clean()


def test_a_unix_socket_run_has_no_port(rig):
    """With --uds vLLM binds no TCP port, and a --port beside it is ignored (vLLM's
    entrypoints/openai/api_server.py: a unix socket when args.uds, else host:port). The run
    records none: its shutdown waited its release timeout for the port another server holds
    and called a clean stop "leftovers", and serve said it was ready on that port."""
    sock = str(Path(rig.root.root, "tmp", "vllm.sock"))
    with socket.socket() as other:  # another server, on the --port given beside --uds
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        fg = rig.serve_bg("--uds", sock, port=port, opts=[*WATCH, "--detach"])
        try:
            assert fg.proc.wait(120) == 0, str(fg)
            assert wait_for(lambda: rig.record(fg.name)["state"] == "ready", 120, 0.1), str(fg)
            assert rig.record(fg.name)["port"] is None
            assert "on its unix socket" in fg.err() and f"port {port}" not in fg.err(), str(fg)
            ps = json.loads(rig.xpuctl("ps", "--json", "--state-dir", rig.state).out)
            assert [r["port"] for r in ps["runs"] if r["name"] == fg.name] == [None], ps
            got = rig.shutdown(fg.name, "--json", "--release-timeout", "60")
            assert got.rc == 0, str(got)
            assert json.loads(got.out)["verdict"] == "clean", str(got)
        finally:
            rig.shutdown(fg.name)
    rig.assert_clean()


def test_the_default_name_of_a_unix_socket_run():
    from xpuctl.parse.vllmargs import ServerReach
    from xpuctl.serve.launch import LaunchPlan
    from xpuctl.serve.start import _default_name
    from xpuctl.state.runs import NAME_RE

    def plan(port: int | None, uds: str | None) -> LaunchPlan:
        return LaunchPlan([], {}, [], port, None, [], None, None, ServerReach(uds=uds))

    assert _default_name(plan(8001, None)) == "vllm-8001"
    a, b = _default_name(plan(None, "/run/a.sock")), _default_name(plan(None, "/run/b.sock"))
    assert a != b and a.startswith("vllm-uds-") and NAME_RE.fullmatch(a)
    assert _default_name(plan(None, "/run/a.sock")) == a  # the same socket, the same name


def test_unix_socket_control_engine_death_caught(rig):
    sock = str(Path(rig.root.root, "tmp", "vllm.sock"))
    fg = rig.serve_bg("--uds", sock, opts=WATCH, env=die_inside(rig))
    caught(rig, fg)
    rig.assert_clean()


# -- vLLM's own exit status; the record at the moment vLLM exits ----------------------------


def test_vllm_exit_status_4_is_serves_1_and_the_record_says_it_at_once(rig):
    """vLLM exits 4 by itself (it would read as serve's "not ready"): serve exits 1, vLLM's 4
    is in the record and serve's last line. Its EngineCore is left behind (it watches nobody)
    with workers that ignore SIGTERM: the ladder runs for seconds after the API server is
    gone, and the record already says stopping and exited while EngineCore still runs;
    `xpuctl health` says 1, never "stuck"; `ps --json` has vLLM's 4."""
    env = {"FAKE_VLLM_FAULTS": "exit-status,worker-ignores-sigterm",
           "FAKE_VLLM_FAULT_FILE": str(rig.tmp / "fault-now"), "FAKE_VLLM_EXIT_STATUS": "4",
           "FAKE_VLLM_EXIT_LEAVES_ENGINE": "1"}
    fg = rig.serve_bg(opts=WATCH, env=env, kill_after=20, teardown=10)
    wait_ready(rig, fg)
    api = rig.record(fg.name)["pid"]
    engine = rig.tree(api)[0]
    (rig.tmp / "fault-now").touch()
    assert wait_for(lambda: not running(api), 60, 0.05), str(fg)
    assert wait_for(lambda: rig.record(fg.name)["state"] != "ready", 60, 0.05)
    rec = rig.record(fg.name)
    assert running(engine), str(fg)  # the ladder has not ended: EngineCore still runs
    assert rec["state"] == "stopping" and rec["health"]["state"] == "exited", rec
    assert rec["exit_code"] == 4 and "code 4" in rec["health"]["reason"], rec
    got = rig.xpuctl("health", fg.name, "--state-dir", rig.state)
    assert got.rc == 1 and "stuck" not in got.out + got.err, str(got)
    ps = json.loads(rig.xpuctl("ps", "--json", "--state-dir", rig.state).out)
    runs = [r for r in ps["runs"] if r["name"] == fg.name]
    assert runs and runs[0]["vllm_exit_code"] == 4, ps
    assert fg.proc.wait(120) == 1, str(fg)
    rec = rig.record(fg.name)
    assert rec["state"] == "failed" and rec["exit_code"] == 4, rec
    last = [line for line in fg.err().splitlines() if line.startswith("xpuctl:")][-1]
    assert "serve exits 1" in last and "exit status 4" in last, last
    rig.assert_clean()


# -- signals at any moment ------------------------------------------------------------------


def quick_signals(fg: Foreground, n: int) -> int:
    for _ in range(n):
        fg.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    return fg.proc.wait(120)


def stopping(rig: Rig, fg: Foreground) -> bool:
    try:
        return rig.record(fg.name)["state"] == "stopping"
    except (OSError, ValueError):
        return False


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("phase", ["starting", "ready", "stopping", "kill-pass"])
def test_quick_sigints_at_every_phase_end_in_the_table(rig, phase, n):
    faults = {"starting": "", "ready": "", "stopping": "ignore-sigterm",
              "kill-pass": "ignore-sigterm"}[phase]
    env = {"FAKE_VLLM_FAULTS": faults} if faults else {}
    if phase == "starting":
        env["FAKE_VLLM_STARTUP_S"] = "30"
    fg = rig.serve_bg(opts=WATCH, env=env, kill_after=30)
    if phase == "starting":
        assert wait_for(lambda: rig.record(fg.name).get("pid"), 60, 0.05), str(fg)
    else:
        wait_ready(rig, fg)
    if phase in ("stopping", "kill-pass"):
        fg.proc.send_signal(signal.SIGINT)  # the stop begins; vLLM ignores its SIGTERM
        assert wait_for(lambda: stopping(rig, fg), 60, 0.05), str(fg)
    if phase == "kill-pass":
        fg.proc.send_signal(signal.SIGINT)
        assert wait_for(lambda: "killing the tree now" in fg.err(), 60, 0.05), str(fg)
    code = quick_signals(fg, n)
    assert code in (0, 1), str(fg)  # a stop asked for: 0 released, 1 leftovers; never 70
    assert "Traceback" not in fg.err() and "internal error" not in fg.err(), str(fg)
    rec = rig.record(fg.name)
    assert rec["state"] in ("stopped", "failed") and rec["stopped_at"], rec
    assert "verdict" in fg.err() or "stopped:" in fg.err(), str(fg)
    rig.assert_clean()


# -- the devices vLLM sees ------------------------------------------------------------------


def test_devices_from_the_affinity_mask_of_vllms_environment(rig):
    """ZE_AFFINITY_MASK=1 in the caller's environment: the run's devices are card 1 only, and
    a second run pinned to card 0 is not refused; the control: a run without a mask claims
    every card and is refused while they run (exit 5)."""
    one = rig.serve_bg(opts=WATCH, env={"ZE_AFFINITY_MASK": "1"}, tp=1)
    zero = None
    try:
        wait_ready(rig, one)
        assert rig.record(one.name)["devices"] == [BDF1], rig.record(one.name)
        zero = rig.serve_bg(opts=[*WATCH, "--env", "ZE_AFFINITY_MASK=0"], tp=1)
        wait_ready(rig, zero)
        assert rig.record(zero.name)["devices"] == [BDF0], rig.record(zero.name)
        every = rig.serve(opts=WATCH, detach=False, tp=1)
        assert every.rc == 5, str(every)
    finally:
        assert stop(one) == 0, str(one)
        if zero is not None:
            assert stop(zero) == 0, str(zero)
    rig.assert_clean()
