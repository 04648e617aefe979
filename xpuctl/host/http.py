"""Tiny HTTP requests to a vLLM server: /health, /v1/models, /metrics (stdlib http.client)."""

from __future__ import annotations

import http.client
from typing import NamedTuple

from xpuctl.parse import metrics


def local_host(bind: str | None) -> str:
    """Where to reach a server bound to `bind` from this host."""
    if not bind or bind in ("0.0.0.0", "::", "[::]", "*"):
        return "127.0.0.1"
    return bind.strip("[]")


class Reply(NamedTuple):
    """One request's outcome: the status and body, or why nothing answered."""

    status: int | None
    body: str
    error: str | None  # "connection refused", "timed out after 1s", ...


def request(host: str, port: int, path: str, timeout: float = 1.0,
            limit: int = 1 << 20) -> Reply:
    """GET `path`; the body is read up to `limit` bytes. Never raises."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        return Reply(resp.status, resp.read(limit).decode("utf-8", "replace"), None)
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


def get(host: str, port: int, path: str, timeout: float = 1.0) -> tuple[int, str] | None:
    """(status, body) or None when nothing answers."""
    reply = request(host, port, path, timeout)
    return None if reply.status is None else (reply.status, reply.body)


def in_flight(host: str, port: int, timeout: float = 0.5) -> int | None:
    got = get(host, port, "/metrics", timeout)
    if got is None or got[0] != 200:
        return None
    return metrics.in_flight(got[1])


def ready(host: str, port: int, timeout: float = 1.0) -> bool:
    """/health answers 200 and /v1/models answers 200."""
    h = get(host, port, "/health", timeout)
    if h is None or h[0] != 200:
        return False
    m = get(host, port, "/v1/models", timeout)
    return m is not None and m[0] == 200
