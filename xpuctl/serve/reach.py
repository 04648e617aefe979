"""How serve reaches the server it started: the way vLLM's own options and environment
configure it (parse/vllmargs.server_reach: `--host`, `--port`, `--uds`, `--api-key` or
`VLLM_API_KEY`, `--ssl-*`), and what serve does when it cannot prove who it is.

The readiness probe asks `/health` (open, vLLM 0.32 `entrypoints/serve/middleware/authenticate.py` guards
only `/v1`, `/v2` and `/inference`) and `/v1/models` with the key as a bearer token. A server
that refuses the probe (401/403, a refused TLS handshake: mutual TLS without serve's own
client certificate, `--probe-cert`/`--probe-key`) is never taken for a server that is not
ready, nor for one that is unwell: serve says so once, judges readiness from what it can see
(vLLM's "Application startup complete." line, its processes alive) and the watch from vLLM's
lines, its processes and the kernel. A certificate that does not verify against
`--ssl-ca-certs` is said once, and the probes go on without verification (a self-signed
certificate is no reason to stop a server). The key is held in memory only: never printed,
never in the record (its command is redacted) nor the audit log.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from xpuctl.host import http
from xpuctl.parse.redact import REDACTED
from xpuctl.parse.redact import argv as redacted_argv
from xpuctl.parse.vllmargs import ServerReach

#: uvicorn's own line once the app started (uvicorn/lifespan/on.py, "Application startup
#: complete."), as vLLM's API server prints it: uvicorn's format ("(APIServer pid=N) INFO:
#: Application startup complete.") or vLLM's logger's ("INFO 12-06 04:01:59 [on.py:1] ...");
#: matched as the whole line's end, after its logger's level, never inside another message
_STARTUP_DONE = re.compile(
    r"(?:^|\s)INFO(?::\s+|\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[\w.]+:\d+\] )"
    r"Application startup complete\.\s*$")

READY = "ready"
NOT_YET = "not yet"


def startup_complete(line: str) -> bool:
    """vLLM's API server says its app started (before it, no client can write to its log)."""
    return _STARTUP_DONE.search(line) is not None


def recorded_command(argv: list[str], reach: ServerReach) -> list[str]:
    """The command line as a record keeps it: secret options' values redacted, and every
    API key the server takes (`--api-key K1 K2`: each of them) wherever it stands."""
    keys = set(reach.keys)
    out = []
    for arg in redacted_argv(argv):
        name, eq, value = arg.partition("=")
        if arg in keys:
            out.append(REDACTED)
        elif eq and value in keys:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(arg)
    return out


class Prober:
    """The probes of one run's server, and what was said about reaching it (once each)."""

    def __init__(self, reach: ServerReach, cert: str | None, key: str | None,
                 say: Callable[[str], None]) -> None:
        self.reach = reach
        self.endpoint = http.reach_endpoint(reach, cert, key)
        self.say = say
        self.said: set[str] = set()
        #: serve cannot prove who it is (mutual TLS, no client certificate of its own): it
        #: does not knock at all, and judges from vLLM's lines and processes
        self.blind = reach.mutual and cert is None
        if self.blind:
            self._once("blind", "xpuctl: note: vLLM asks for a client certificate (mutual TLS, "
                       "--ssl-cert-reqs 2) and serve has none (--probe-cert, --probe-key): "
                       "readiness is judged from vLLM's \"Application startup complete.\" line "
                       "and its processes, the watch from vLLM's lines, its processes and the "
                       "kernel (not /health or /metrics)")

    @property
    def url(self) -> str:
        return self.endpoint.url

    def _once(self, what: str, msg: str) -> None:
        if what not in self.said:
            self.said.add(what)
            self.say(msg)

    def request(self, path: str, timeout: float, limit: int = 1 << 20,
                auth: bool = False) -> http.Reply:
        """One request; a certificate that does not verify is said once, then the probes go
        on without verification."""
        reply = http.request(self.endpoint, path, timeout, limit, auth)
        if reply.unverified:
            self._once("unverified", f"xpuctl: note: vLLM's certificate does not verify "
                       f"against --ssl-ca-certs ({reply.error}): serve probes without "
                       "verification (its own server, on this host)")
            self.endpoint = dataclasses.replace(self.endpoint, ca=None)
            reply = http.request(self.endpoint, path, timeout, limit, auth)
        if not reply.denied and self._refused_cert(reply):
            reply = reply._replace(refused_tls=True)
        if reply.denied:
            self._denied(path, reply)
        return reply

    def _refused_cert(self, reply: http.Reply) -> bool:
        """Under mutual TLS a server that will not take serve's certificate may just close
        the connection (a reset, an empty answer) instead of a TLS alert: that too is a
        refusal, not a server that is unwell. Refused connections and timeouts still count."""
        if not self.reach.mutual or reply.status is not None or reply.error is None:
            return False
        return reply.error != "connection refused" and not reply.error.startswith("timed out")

    def _denied(self, path: str, reply: http.Reply) -> None:
        why = (f"answered {reply.status}" if reply.status is not None
               else f"refused the TLS handshake ({reply.error})")
        self._once("denied", f"xpuctl: note: vLLM {why} to serve's probe of {path}: serve "
                   "cannot prove who it is there; readiness is judged from vLLM's "
                   "\"Application startup complete.\" line and its processes, and a refused "
                   "probe never counts against the run")

    def ready(self, timeout: float, started: bool) -> str:
        """READY when `/health` and `/v1/models` (with the key) answer 200, or when serve
        cannot authenticate and vLLM said its app started (`started`); else NOT_YET."""
        if self.blind:
            return READY if started else NOT_YET
        health = self.request("/health", timeout, 4096)
        if health.denied:
            return READY if started else NOT_YET
        if health.status != 200:
            return NOT_YET
        models = self.request("/v1/models", timeout, auth=True)
        if models.status == 200 or (models.denied and started):
            return READY
        return NOT_YET

    def health(self, timeout: float, limit: int) -> http.Reply:
        """`/health` for the watch. Blind, or refused: what serve can see says the server is
        up (its exit and its engine's death lines are watched apart), so the check answers
        as a server that lives; a refusal is never a failing check."""
        if self.blind:
            return http.Reply(200, "", None)
        reply = self.request("/health", timeout, limit)
        return http.Reply(200, "", None) if reply.denied else reply

    def metrics(self, timeout: float, limit: int) -> http.Reply | None:
        """`/metrics` for the watch; None when serve cannot see it (blind)."""
        if self.blind:
            return None
        return self.request("/metrics", timeout, limit)


def check_probe_cert(cert: str | None, key: str | None) -> None:
    """`--probe-cert`/`--probe-key` load as a client certificate, or a usage error before
    anything starts (a bad one would only make every probe fail later)."""
    import ssl

    from xpuctl.errors import UsageError
    from xpuctl.output.safetext import safe

    if cert is None:
        if key is not None:
            raise UsageError("--probe-key needs --probe-cert")
        return
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise UsageError(f"--probe-cert {safe(cert)}: not a certificate and key serve can "
                         f"use ({safe(str(exc), 200)})") from None
