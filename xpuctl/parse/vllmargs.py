"""vLLM's command-line arguments, read and edited (lists of strings in, data out).

serve edits the arguments it passes on (`strip_flag`, `merge_shared`); shutdown and serve read
the port, bind address and shutdown timeout back from a server's argv. Pure: fuzzed with
hypothesis in tests/test_parse_fuzz.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from xpuctl.errors import UsageError

_TIMEOUT_ARG = re.compile(r"^--shutdown[-_]timeout(?:=(\d+))?$")


def strip_flag(args: Sequence[str], flag: str) -> tuple[list[str], str | None, bool]:
    """Remove `flag N`/`flag=N` (also the _ spelling) from args: (rest, value, found)."""
    names = {flag, flag.replace("-", "_").replace("__", "--")}
    rest: list[str] = []
    value = None
    found = False
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, val = arg.partition("=")
        if key in names:
            found = True
            if eq:
                value = val
            elif i + 1 < len(args):
                value = args[i + 1]
                i += 1
            i += 1
            continue
        rest.append(arg)
        i += 1
    return rest, value, found


def merge_shared(args: list[str], flag: str, before: str | None) -> list[str]:
    """vLLM's args with `flag` given before MODEL passed on exactly once.

    Given after MODEL only: kept as it is. Before only: put first after MODEL. Both: one
    value (the caller's spelling after MODEL stays), or a usage error when they differ."""
    if before is None:
        return args
    _, after, found = strip_flag(args, flag)
    if not found:
        return [flag, before, *args]
    same = after == before or (_digits(after or "") and _digits(before) and int(after or 0) == int(before))
    if not same:
        raise UsageError(f"{flag} {before} before MODEL and {flag} {after} after it disagree: give it once")
    return args


def shutdown_timeout_from_argv(argv: Sequence[str]) -> int | None:
    """The first whole-seconds `--shutdown-timeout` (or `--shutdown_timeout`) in argv."""
    for i, arg in enumerate(argv):
        m = _TIMEOUT_ARG.match(arg)
        if not m:
            continue
        value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
        if _digits(value):
            return int(value)
    return None


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "²", which int() refuses."""
    return text.isascii() and text.isdigit()


def port_from_argv(argv: Sequence[str]) -> tuple[int | None, str | None]:
    """(port, bind address) from `--port`/`--host` in argv; the last of each wins."""
    port = bind = None
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if arg == "--port" and _digits(nxt):
            port = int(nxt)
        elif arg.startswith("--port=") and _digits(arg[7:]):
            port = int(arg[7:])
        elif arg == "--host" and nxt:
            bind = nxt
        elif arg.startswith("--host="):
            bind = arg[7:]
    return port, bind


_SIZE_FLAGS = {"--tensor-parallel-size": 0, "--tensor_parallel_size": 0, "-tp": 0,
               "--pipeline-parallel-size": 1, "--pipeline_parallel_size": 1, "-pp": 1}


def parallel_sizes(argv: Sequence[str]) -> tuple[int, int]:
    """(tensor-parallel, pipeline-parallel) sizes from vLLM's argv (`--tensor-parallel-size N`,
    `-tp N`, `=N` forms; the pipeline ones alike); 1 where not given or not whole numbers. The
    last of each wins, as with argparse."""
    sizes = [1, 1]
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        which = _SIZE_FLAGS.get(key)
        if which is None:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if _digits(value) and 0 < int(value) <= 4096:
            sizes[which] = int(value)
    return sizes[0], sizes[1]


# -- how vLLM's API server is reached (vLLM 0.32 entrypoints/launchers/cli_args.py) --------

#: CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED: `--ssl-cert-reqs` is ssl's integer (default 0)
CERT_REQUIRED = 2
_REACH_FLAGS = {"--host": "host", "--port": "port", "--uds": "uds", "--api-key": "keys",
                "--ssl-keyfile": "ssl_keyfile", "--ssl-certfile": "ssl_certfile",
                "--ssl-ca-certs": "ssl_ca_certs", "--ssl-cert-reqs": "ssl_cert_reqs",
                "--root-path": "root_path"}
#: vLLM's own variable for the key, read when `--api-key` is not given (vllm/envs.py)
API_KEY_VAR = "VLLM_API_KEY"


class ServerReach(NamedTuple):
    """How vLLM's API server listens, from its argv and environment. `keys` are secrets:
    held in memory only, never printed or recorded."""

    host: str | None = None
    port: int | None = None
    uds: str | None = None
    keys: tuple[str, ...] = ()
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    root_path: str = ""

    @property
    def tls(self) -> bool:
        """uvicorn serves HTTPS when given a key file and a certificate (vLLM passes both)."""
        return bool(self.ssl_keyfile and self.ssl_certfile)

    @property
    def mutual(self) -> bool:
        return self.tls and self.ssl_cert_reqs >= CERT_REQUIRED


def _flag_name(arg: str) -> str:
    """`--api_key` is `--api-key` (vLLM's parser takes both spellings)."""
    return "--" + arg[2:].replace("_", "-") if arg.startswith("--") else arg


def _reach_values(argv: Sequence[str]) -> dict[str, list[str]]:
    """The last value list of each reach option (argparse: the last one wins); `--api-key`
    takes every value up to the next option (nargs="+")."""
    found: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        key, eq, value = argv[i].partition("=")
        field = _REACH_FLAGS.get(_flag_name(key))
        i += 1
        if field is None:
            continue
        if eq:
            found[field] = [value]
            continue
        values: list[str] = []
        while i < len(argv) and not (argv[i].startswith("-") and len(argv[i]) > 1):
            values.append(argv[i])
            i += 1
            if field != "keys":
                break
        found[field] = values
    return found


def server_reach(argv: Sequence[str], env: dict[str, str] | None = None) -> ServerReach:
    """How to reach the server that `argv` (vLLM's command line) and `env` (its environment)
    start: its address or unix socket, TLS, and the API keys (`--api-key`, else
    `VLLM_API_KEY`)."""
    got = _reach_values(argv)

    def one(field: str) -> str | None:
        values = got.get(field) or []
        return values[0] if values and values[0] else None

    port = one("port")
    reqs = one("ssl_cert_reqs")
    keys = tuple(k for k in got.get("keys", []) if k)
    if not keys and env and env.get(API_KEY_VAR):
        keys = (env[API_KEY_VAR],)
    return ServerReach(host=one("host"), port=int(port) if port and _digits(port) else None,
                       uds=one("uds"), keys=keys, ssl_keyfile=one("ssl_keyfile"),
                       ssl_certfile=one("ssl_certfile"), ssl_ca_certs=one("ssl_ca_certs"),
                       ssl_cert_reqs=int(reqs) if reqs and _digits(reqs) else 0,
                       root_path=(one("root_path") or "").rstrip("/"))
