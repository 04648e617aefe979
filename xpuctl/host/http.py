"""Tiny HTTP requests to a vLLM server: /health, /v1/models, /metrics (stdlib http.client),
reached the way it listens (`Endpoint`: TCP or a unix socket, HTTP or HTTPS, a bearer token)."""

from __future__ import annotations

import http.client
import socket
import ssl
from dataclasses import dataclass, field
from typing import NamedTuple

from xpuctl.parse import metrics
from xpuctl.parse.vllmargs import ServerReach


def local_host(bind: str | None) -> str:
    """Where to reach a server bound to `bind` from this host."""
    if not bind or bind in ("0.0.0.0", "::", "[::]", "*"):
        return "127.0.0.1"
    return bind.strip("[]")


@dataclass(frozen=True)
class Endpoint:
    """How to reach one vLLM server: TCP or a unix socket, HTTP or HTTPS, and the bearer
    token for its `/v1` paths. The token is a secret: left out of `repr` and of `url`."""

    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None
    tls: bool = False
    ca: str | None = None  # verify the server's certificate against it; None: no verification
    cert: str | None = None  # a client certificate of serve's own (mutual TLS)
    key: str | None = None  # its private key
    token: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The server's address for people (no token)."""
        if self.uds:
            return f"{'https' if self.tls else 'http'}+unix://{self.uds}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


def endpoint(bind: str | None, port: int) -> Endpoint:
    """Plain HTTP on `port` of the address a server bound to `bind` is reached at."""
    return Endpoint(local_host(bind), port)


def reach_endpoint(reach: ServerReach, cert: str | None = None,
                   key: str | None = None) -> Endpoint:
    """The endpoint of a server its own options describe (parse/vllmargs.server_reach): its
    unix socket or address and port (8000, vLLM's default), TLS when it serves it, verified
    against its `--ssl-ca-certs` when given, the first API key (vLLM takes any of them) as the bearer token; `cert`
    and `key`: serve's own client certificate for mutual TLS."""
    return Endpoint(local_host(reach.host), reach.port or 8000, uds=reach.uds, tls=reach.tls,
                    ca=reach.ssl_ca_certs if reach.tls else None, cert=cert, key=key,
                    token=reach.keys[0] if reach.keys else None)


class Reply(NamedTuple):
    """One request's outcome: the status and body, or why nothing answered."""

    status: int | None
    body: str
    error: str | None  # "connection refused", "timed out after 1s", ...
    refused_tls: bool = False  # the TLS handshake was refused (mutual TLS: no or a bad cert)
    unverified: bool = False  # the server's certificate did not verify against the CA

    @property
    def denied(self) -> bool:
        """The server answered but would not take who we are: no proof it is unwell."""
        return self.refused_tls or self.status in (401, 403)


_CONTEXTS: dict[tuple[str | None, str | None, str | None], ssl.SSLContext] = {}


def _context(ep: Endpoint) -> ssl.SSLContext:
    """One TLS context per (CA, client certificate, key). With a CA the chain is verified
    (not the name: serve reaches its own server by a local address); without one, nothing
    is: a self-signed server is still the server serve started."""
    slot = (ep.ca, ep.cert, ep.key)
    ctx = _CONTEXTS.get(slot)
    if ctx is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        if ep.ca:
            ctx.load_verify_locations(cafile=ep.ca)
        else:
            ctx.verify_mode = ssl.CERT_NONE
        if ep.cert:
            ctx.load_cert_chain(ep.cert, ep.key)
        _CONTEXTS[slot] = ctx
    return ctx


class _Connection(http.client.HTTPConnection):
    """http.client over TCP or a unix socket (AF_UNIX, the stdlib's socket), TLS or not."""

    def __init__(self, ep: Endpoint, timeout: float) -> None:
        super().__init__("localhost" if ep.uds else ep.host, ep.port, timeout=timeout)
        self.ep = ep

    def connect(self) -> None:
        if self.ep.uds:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.ep.uds)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.host, self.port), self.timeout)
        if self.ep.tls:
            try:
                sock = _context(self.ep).wrap_socket(sock)
            except BaseException:
                sock.close()
                raise
        self.sock = sock


def request(ep: Endpoint, path: str, timeout: float = 1.0, limit: int = 1 << 20,
            auth: bool = False) -> Reply:
    """GET `path` (vLLM answers its routes without its `--root-path`, which is the prefix of a
    proxy in front of it); the body is read up to `limit` bytes;
    `auth`: with the bearer token (only `/v1` needs it). Never raises."""
    headers = {"Connection": "close"}
    if auth and ep.token:
        headers["Authorization"] = f"Bearer {ep.token}"
    conn = _Connection(ep, timeout)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return Reply(resp.status, resp.read(limit).decode("utf-8", "replace"), None)
    except ssl.SSLCertVerificationError as exc:
        return Reply(None, "", f"certificate not verified: {exc.verify_message}",
                     unverified=True)
    except ssl.SSLError as exc:
        return Reply(None, "", f"TLS refused: {exc.reason or type(exc).__name__}",
                     refused_tls=True)
    except TimeoutError:
        return Reply(None, "", f"timed out after {timeout:g}s")
    except ConnectionRefusedError:
        return Reply(None, "", "connection refused")
    except OSError as exc:
        return Reply(None, "", exc.strerror or type(exc).__name__)
    except http.client.HTTPException as exc:
        return Reply(None, "", f"bad answer: {type(exc).__name__}")
    finally:
        conn.close()


def get(ep: Endpoint, path: str, timeout: float = 1.0) -> tuple[int, str] | None:
    """(status, body) or None when nothing answers."""
    reply = request(ep, path, timeout)
    return None if reply.status is None else (reply.status, reply.body)


def in_flight(ep: Endpoint, timeout: float = 0.5) -> int | None:
    got = get(ep, "/metrics", timeout)
    if got is None or got[0] != 200:
        return None
    return metrics.in_flight(got[1])
