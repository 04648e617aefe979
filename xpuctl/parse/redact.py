"""What a snapshot keeps of the files doctor read, and the secrets nothing shows: bytes or
text in, the same out, no I/O.

Each reducer keeps exactly what doctor uses of a file and drops the rest, so an archive
carries nothing doctor does not need: environ keeps only the variables doctor and a support
engineer look at, maps only the lines naming /dev/shm or /tmp, /proc/stat only `btime`,
/proc/net/unix only the sockets bound under /dev/shm or /tmp.

Secrets keep their names and lose their values (`REDACTED`), wherever an environment or a
command line leaves the host (archives, JSON, tables):

- an environment variable whose name contains KEY, TOKEN, SECRET, PASSWORD, PASSWD,
  CREDENTIAL or AUTH (any case): `HF_TOKEN=<redacted>` (`secret_name`);
- in a command line, the value of an option named like one (`--api-key X`, `--api-key=X`,
  `--hf-token`, `--password`, `--client_secret`: a word of the option's name ending in
  key, token, secret, password, passwd, credential(s) or auth, so `--tokenizer` and
  `--max-num-batched-tokens` keep theirs), and `NAME=VALUE` words with a secret NAME
  (`serve -e HF_TOKEN=...`) (`argv`);
- in free text (log lines, a run's last lines), `NAME=X`, `NAME: X`, `--NAME X` with NAME
  ending like a secret option's word, `Bearer X`, Python's `'api_key': 'X'` of vLLM's
  argument dump, and every secret value found in the environments and command lines of the
  same capture (`scrub`; a value under MIN_SCRUBBED characters is not searched for).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from xpuctl.parse.net import format_unix, parse_unix_paths

#: environ variables a snapshot keeps (prefixes, and one exact name); every other value is
#: dropped, since environ can hold secrets.
ENV_PREFIXES = ("XPUCTL_", "ZE_", "ONEAPI_", "SYCL_", "CCL_", "VLLM_")
ENV_NAMES = ("SPT_NOENV",)
#: Directories whose files doctor judges (see rules.py).
ARTIFACT_DIRS = ("/dev/shm/", "/tmp/")


#: What a secret's value is replaced with.
REDACTED = "<redacted>"
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
#: an option's name is secret when one of its words ends like this
_OPTION_ENDS = ("key", "token", "secret", "password", "passwd", "credential", "credentials",
                "auth")
_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: a value shorter than this is not searched for in free text (it would hit ordinary words)
MIN_SCRUBBED = 4


def secret_name(name: str) -> bool:
    """An environment variable whose value is a secret (by its name)."""
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def secret_option(option: str) -> bool:
    """`--api-key`, `--hf_token`, `-password`: an option whose value is a secret."""
    words = re.split(r"[-_.]+", option.lstrip("-").lower())
    return any(w.endswith(_OPTION_ENDS) for w in words if w)


def keeps_var(key: str) -> bool:
    return key.startswith(ENV_PREFIXES) or key in ENV_NAMES


def environ(data: bytes) -> bytes:
    """/proc/<pid>/environ with only the kept variables, in their order (duplicates too:
    the parser keeps the first); a secret keeps its name only (whatever its prefix)."""
    kept = []
    for item in data.split(b"\0"):
        key, sep, _ = item.partition(b"=")
        name = key.decode("utf-8", "surrogateescape")
        if sep and name and secret_name(name):
            kept.append(key + b"=" + REDACTED.encode() + b"\0")
        elif sep and keeps_var(name):
            kept.append(item + b"\0")
    return b"".join(kept)


def env_dict(env: dict[str, str]) -> dict[str, str]:
    """A process environment (the caller's) reduced the same way."""
    return {k: REDACTED if secret_name(k) else v for k, v in env.items()
            if secret_name(k) or keeps_var(k)}


def argv(args: Sequence[str]) -> list[str]:
    """A command line with the values of secret options and `NAME=VALUE` words replaced
    (argv[0], the program, is kept as it is)."""
    out = list(args[:1])
    hide_next = False
    for arg in args[1:]:
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        name, eq, _ = arg.partition("=")
        if arg.startswith("-") and len(name) > 1 and secret_option(name):
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
        elif eq and _ENV_WORD.match(name) and secret_name(name):
            out.append(f"{name}={REDACTED}")
        else:
            out.append(arg)
    return out


def cmdline(data: bytes) -> bytes:
    """/proc/<pid>/cmdline bytes with `argv`'s redaction (NUL-separated as the kernel gives
    them, a trailing NUL kept)."""
    if not data:
        return data
    words = data.decode("utf-8", "surrogateescape").split("\0")
    end = words.pop() if len(words) > 1 and words[-1] == "" else None
    out = "\0".join(argv(words)) + ("\0" if end is not None else "")
    return out.encode("utf-8", "surrogateescape")


def secret_values(args: Iterable[str] = (), env: dict[str, str] | None = None) -> set[str]:
    """The secrets `argv` and `env_dict` would hide, as text to look for elsewhere."""
    found: set[str] = set()
    words = list(args)
    for word, shown in zip(words, argv(words), strict=True):
        if word != shown:
            found.add(word.partition("=")[2] if shown.endswith("=" + REDACTED) else word)
    for name, value in (env or {}).items():
        if secret_name(name):
            found.add(value)
    return {v for v in found if len(v) >= MIN_SCRUBBED and v != REDACTED}


_ENDS = "|".join(_OPTION_ENDS)
_TEXT_SHAPES = (  # (pattern, replacement), in this order
    (re.compile(r"(?i)(\bBearer)(\s+)(?!<redacted>)([A-Za-z0-9._~+/=-]+)"),
     rf"\g<1>\g<2>{REDACTED}"),
    # NAME=VALUE, NAME: VALUE, NAME ending like a secret option (an env dump, a config line;
    # not every name containing a word: `max_num_batched_tokens=8192` stays)
    (re.compile(rf"(?i)\b([A-Za-z0-9_]*(?:{_ENDS}))(\s*[=:]\s*)"
                r"(?!<redacted>|Bearer\s)([^\s,;'\"}\]]+)"), rf"\g<1>\g<2>{REDACTED}"),
    # --api-key VALUE / --api-key=VALUE
    (re.compile(rf"(?i)(--?[A-Za-z0-9_-]*(?:{_ENDS}))(=|\s+)"
                r"(?!<redacted>)(?!--)(\S+)"), rf"\g<1>\g<2>{REDACTED}"),
    # 'api_key': 'VALUE' / "hf_token": ["VALUE"] (vLLM logs its non-default arguments)
    (re.compile(rf"(?i)(['\"][A-Za-z0-9_-]*(?:{_ENDS})['\"])(\s*:\s*\[?\s*)"
                r"(?!['\"]<redacted>)['\"][^'\"\n]*['\"]"), rf"\g<1>\g<2>'{REDACTED}'"),
)


def scrub(text: str, values: Iterable[str] = ()) -> str:
    """Free text with every secret this module knows the shape of, and each of `values`
    (from `secret_values`), replaced by REDACTED."""
    for value in sorted(set(values), key=len, reverse=True):
        if len(value) >= MIN_SCRUBBED:
            text = text.replace(value, REDACTED)
    for shape, replacement in _TEXT_SHAPES:
        text = shape.sub(replacement, text)
    return text


#: Libraries whose mapping doctor reads as a proof (a oneCCL KVS listener's process maps
#: oneCCL's library: core/oneccl.py), kept in a snapshot's maps so that `doctor --from` names
#: what the live doctor named. A library's path says nothing secret.
PROOF_LIBRARIES = ("libccl",)


def _proof_library(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(name == f"{stem}.so" or name.startswith(f"{stem}.so.") for stem in PROOF_LIBRARIES)


def maps(data: bytes, to_host: Callable[[str], str]) -> bytes:
    """The /proc/<pid>/maps lines naming a file under /dev/shm or /tmp (as `to_host` maps the
    kernel's path), with that path written as the host path, and the first line mapping each
    library doctor reads as a proof (PROOF_LIBRARIES)."""
    out = []
    seen: set[str] = set()
    for line in data.decode("utf-8", "surrogateescape").splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(" (deleted)"):
            continue
        path = to_host(parts[5])
        if path.startswith(ARTIFACT_DIRS):
            out.append(line[: len(line) - len(parts[5])] + path + "\n")
        elif _proof_library(parts[5]) and parts[5] not in seen:
            seen.add(parts[5])
            out.append(line + "\n")
    return "".join(out).encode("utf-8", "surrogateescape")


def proc_stat(data: bytes) -> bytes:
    """/proc/stat: the `btime` line only (boot time, for process start times)."""
    return b"".join(line + b"\n" for line in data.splitlines() if line.startswith(b"btime"))


def net_unix(text: str, to_host: Callable[[str], str]) -> str:
    """/proc/net/unix: the sockets bound under /dev/shm or /tmp, with host paths."""
    paths = {to_host(p): inode for p, inode in parse_unix_paths(text).items()}
    return format_unix({p: i for p, i in paths.items() if p.startswith(ARTIFACT_DIRS)})
