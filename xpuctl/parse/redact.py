"""What a snapshot keeps of the files doctor read, and the secrets nothing shows: bytes or
text in, the same out, no I/O.

Each reducer keeps exactly what doctor uses of a file and drops the rest, so an archive
carries nothing doctor does not need: environ keeps only the variables doctor and a support
engineer look at, maps only the lines naming /dev/shm or /tmp, /proc/stat only `btime`,
/proc/net/unix only the sockets bound under /dev/shm or /tmp.

Secrets keep their names and lose their values (`<redacted>`), wherever an environment, a
command line or a log leaves the host (archives, JSON, tables, lines, records). Names are
matched as words (split at `-`, `_`, `.`), never as substrings: a secret word is `key`,
`keys`, `apikey`, `token`, `auth`, `authorization`, or a word ending in `password`, `passwd`,
`secret`, `credential(s)` (so `monkey` and `max_num_batched_tokens` are no secrets):

- an environment variable with a secret word anywhere in its name: `HF_TOKEN`,
  `AWS_SECRET_ACCESS_KEY`, `PGPASSWORD` (`secret_name`);
- in a command line (`argv`), every value of an option whose name *ends* with a secret word
  (`--api-key K1 K2`: vLLM takes several; `--api-key=K`, `--hf-token`, `--password`), so
  `--return-tokens-as-token-ids MODEL` and `--ssl-keyfile F` keep theirs; `NAME=VALUE` words
  with a secret NAME (`serve -e HF_TOKEN=...`); and inside any word, the shapes below
  (`--hf-overrides '{"hf_token": "x"}'`, a URL with `user:password@`);
- in free text (`scrub`) and inside words: JSON and Python-repr dicts and keyword arguments
  whose key ends with a secret word (`{"hf_token": "x"}`, vLLM's `non-default args:
  {'api_key': ['K1', 'K2']}`, `api_key='K'`, `HF_TOKEN=x`), `--NAME VALUE...` options,
  `Authorization:` headers and `Bearer X`, URL user info (`https://user:pw@host`), and every
  secret value found in the environments and command lines of the same capture (a value under
  MIN_SCRUBBED characters is not searched for).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from xpuctl.parse.net import format_unix, parse_unix_paths

#: environ variables a snapshot keeps (prefixes, and one exact name); every other value is
#: dropped, since environ can hold secrets.
ENV_PREFIXES = ("XPUCTL_", "ZE_", "ONEAPI_", "SYCL_", "CCL_", "VLLM_")
ENV_NAMES = ("SPT_NOENV",)
#: Directories whose files doctor judges (see rules.py).
ARTIFACT_DIRS = ("/dev/shm/", "/tmp/")


#: What a secret's value is replaced with.
REDACTED = "<redacted>"
_WHOLE_WORDS = frozenset({"key", "keys", "apikey", "apikeys", "token", "auth",
                          "authorization"})
_WORD_ENDS = ("password", "passwd", "secret", "secrets", "credential", "credentials")
_WORDS = re.compile(r"[-_.]+")
_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: a value shorter than this is not searched for in free text (it would hit ordinary words)
MIN_SCRUBBED = 4


def _secret_word(word: str) -> bool:
    word = word.lower()
    return word in _WHOLE_WORDS or word.endswith(_WORD_ENDS)


def _words(name: str) -> list[str]:
    return [w for w in _WORDS.split(name.strip("-_.")) if w]


def secret_name(name: str) -> bool:
    """An environment variable whose value is a secret: a secret word in its name."""
    return any(_secret_word(w) for w in _words(name))


def secret_key(name: str) -> bool:
    """An option or a key whose value is a secret: its name's last word is a secret word
    (`--api-key`, `hf_token`, `Authorization`; not `--return-tokens-as-token-ids`)."""
    words = _words(name)
    return bool(words) and _secret_word(words[-1])


def secret_option(option: str) -> bool:
    """`--api-key`, `--hf_token`, `-password`: an option whose values are secrets."""
    return secret_key(option)


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


_KEPT_STARTS = tuple(p.encode() for p in ENV_PREFIXES) + tuple(n.encode() + b"=" for n in ENV_NAMES)


def kept_environ(data: bytes) -> dict[str, str]:
    """The kept variables of /proc/<pid>/environ as a dict (the first of a name wins, as
    procfs.parse_environ), a secret's value replaced: all a scan keeps of another process's
    environment. The other variables are never decoded (a vLLM host's run to kilobytes)."""
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        if item.startswith(_KEPT_STARTS):
            key, sep, value = item.partition(b"=")
            name = key.decode("utf-8", "surrogateescape")
            if sep and name not in out:
                out[name] = REDACTED if secret_name(name) else value.decode("utf-8", "surrogateescape")
    return out


def env_dict(env: dict[str, str]) -> dict[str, str]:
    """A process environment (the caller's) reduced the same way."""
    return {k: REDACTED if secret_name(k) else v for k, v in env.items()
            if secret_name(k) or keeps_var(k)}


def argv(args: Sequence[str]) -> list[str]:
    """A command line with every value of a secret option, the value of a secret
    `NAME=VALUE` word, and the secret shapes inside any other word replaced (argv[0], the
    program, is kept as it is). A secret option's values are the words up to the next option
    (vLLM's `--api-key` takes several)."""
    out = list(args[:1])
    hiding = False
    for arg in args[1:]:
        if hiding and not arg.startswith("-"):
            out.append(REDACTED)
            continue
        hiding = False
        name, eq, _ = arg.partition("=")
        if arg.startswith("-") and len(name) > 1 and secret_option(name):
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hiding = True
        elif eq and _ENV_WORD.match(name) and secret_name(name):
            out.append(f"{name}={REDACTED}")
        else:
            out.append(_scrub_shapes(arg))
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
        if shown == REDACTED:
            found.add(word)
        elif shown.endswith("=" + REDACTED) and "=" in word and REDACTED not in word:
            found.add(word.partition("=")[2])
        elif shown != word:
            found |= _shape_values(word)
    for name, value in (env or {}).items():
        if secret_name(name):
            found.add(value)
    return {v for v in found if len(v) >= MIN_SCRUBBED and v != REDACTED}


# -- the shapes of secrets in text ----------------------------------------------------------

_QUOTED = r"'(?:[^'\\\n]|\\.)*'|" + r'"(?:[^"\\\n]|\\.)*"'
_BARE = r"""(?:(?i:bearer|basic|token)\s+)?[^\s,;'"}\])]+"""
_ITEM = rf"(?:{_QUOTED}|[^\s,\]]+)"
#: `key: value`, `key=value`, `'key': ['v1', 'v2']`, `"key": "v"`, `key='v'`. Every name is
#: matched from its first character only and never given back (`*+`): a 2 MiB command line of
#: one word is read once, not once per character (it was quadratic: minutes for `ps`).
_SHAPES = {
    "keyed": (rf"""(?<![A-Za-z0-9_.-])(?P<q>['"]?)(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*+)(?P=q)"""
              rf"""(?P<sep>\s*[:=]\s*)"""
              rf"(?P<value>\[\s*(?:{_ITEM}(?:\s*,\s*{_ITEM})*)?\s*\]|{_QUOTED}|{_BARE})"),
    #: `--api-key K1 K2` (every word up to the next option or a `NAME=`/`NAME:` word), `--api-key=K`
    "option": (r"(?P<name>(?<![\w-])--?[A-Za-z0-9][A-Za-z0-9_.-]*+)"
               r"(?P<sep>=|\s+)(?P<value>(?!-)\S+(?:[ \t]+(?!-)[^\s=:]+(?!\S))*)"),
    "bearer": r"(?i)(?P<name>\bBearer)(?P<sep>\s+)(?P<value>[A-Za-z0-9._~+/=-]+)",
    #: scheme://userinfo@host: the user info goes whole (a token can be its user part)
    "userinfo": (r"(?P<name>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*+://)(?P<sep>)"
                 r"(?P<value>[^\s/@'\"<>]+)(?=@)"),
    "items": _QUOTED + r"|[^\s,\[\]]+",
}
_SCHEMES = frozenset({"bearer", "basic", "token"})


@functools.cache
def _shape(name: str) -> re.Pattern[str]:
    """A shape's regex, compiled on first use: compiling them all took every command's
    start-up 4 ms, and most runs never need one (`_may_hold_a_shape`)."""
    return re.compile(_SHAPES[name])


def _hidden(value: str) -> str:
    """What a secret value becomes: a list keeps its brackets, a quoted one its quotes."""
    if value.startswith("["):
        return f"['{REDACTED}']"
    if value[:1] in "'\"" and len(value) > 1:
        return f"{value[0]}{REDACTED}{value[0]}"
    return REDACTED


#: how deep dicts inside strings are looked into (`'hf_overrides': '{"hf_token": ...}'` is
#: one); a hostile `x='y=\'z=...` goes no deeper, and a bare value is never re-read
_NEST = 4


def _nested(value: str, depth: int) -> bool:
    """Is `value` a quoted string or a list that may hold a dict of its own?"""
    return len(value) > 2 and value[0] in "'\"[" and depth < _NEST


def _keyed(m: re.Match[str], depth: int = 0) -> str:
    value = m.group("value")
    head = m.group(0)[: m.start("value") - m.start()]
    if not secret_key(m.group("name")):  # a dict inside a string (`'hf_overrides': '{...}'`)
        if _nested(value, depth):
            return head + _shape("keyed").sub(lambda inner: _keyed(inner, depth + 1), value)
        return m.group(0)
    if REDACTED in value:
        return m.group(0)
    return head + _hidden(value)


def _always(m: re.Match[str]) -> str:
    """Bearer and URL user info: a secret whatever its name."""
    if REDACTED in m.group("value"):
        return m.group(0)
    return f"{m.group('name')}{m.group('sep')}{REDACTED}"


def _option(m: re.Match[str]) -> str:
    """`--NAME VALUE...` in text: hidden when NAME ends with a secret word."""
    if REDACTED in m.group("value") or not secret_option(m.group("name")):
        return m.group(0)
    return f"{m.group('name')}{m.group('sep')}{REDACTED}"


_Sub = Callable[[re.Match[str]], str]


def _may_hold_a_shape(text: str) -> bool:
    """False only when no shape can match: each needs a `=` or a `:` (a keyed value, an
    option's `=VALUE`, a URL's `://`), the word Bearer, or white space after a `-` (an
    option and its value in free text). Most words of a command line have none of them,
    and doctor reads the command line of every holder: the regexes are skipped for those."""
    if "=" in text or ":" in text or "earer" in text.lower():
        return True
    return "-" in text and any(c.isspace() for c in text)


def _scrub_shapes(text: str) -> str:
    if not _may_hold_a_shape(text):
        return text
    shapes: tuple[tuple[str, _Sub], ...] = (
        ("bearer", _always), ("userinfo", _always), ("keyed", _keyed), ("option", _option))
    for shape, replace in shapes:
        text = _shape(shape).sub(replace, text)
    return text


def _keyed_values(text: str, depth: int = 0) -> set[str]:
    found: set[str] = set()
    for m in _shape("keyed").finditer(text):
        value = m.group("value")
        if not secret_key(m.group("name")):
            found |= _keyed_values(value, depth + 1) if _nested(value, depth) else set()
            continue
        for item in _shape("items").findall(value):
            if item.lower() not in _SCHEMES:  # `Bearer X`: X is the secret
                found.add(item[1:-1] if item[:1] in "'\"" else item)
    return found


def _shape_values(text: str) -> set[str]:
    """The secret values the shapes find in `text` (each list item and quoted string
    without its quotes)."""
    found = _keyed_values(text)
    for m in _shape("userinfo").finditer(text):
        found.add(m.group("value"))
    for m in _shape("bearer").finditer(text):
        found.add(m.group("value"))
    return {v for v in found if v and v != REDACTED}


def scrub(text: str, values: Iterable[str] = ()) -> str:
    """Free text with every secret this module knows the shape of, and each of `values`
    (from `secret_values`), replaced by REDACTED."""
    for value in sorted(set(values), key=len, reverse=True):
        if len(value) >= MIN_SCRUBBED:
            text = text.replace(value, REDACTED)
    return _scrub_shapes(text)


def run_record(data: dict[str, Any]) -> dict[str, Any]:
    """A run record's fields as they may be written (state/runs.py): its command line
    through `argv`, its reason, last lines and health reason scrubbed of every secret shape
    and of the command line's secret values (vLLM logs its arguments: `non-default args:
    {'api_key': [...]}`)."""
    out = dict(data)
    command = [str(w) for w in data.get("command") or []]
    found = secret_values(command)
    out["command"] = argv(command)
    if isinstance(data.get("reason"), str):
        out["reason"] = scrub(data["reason"], found)
    out["last_lines"] = [scrub(str(line), found) for line in data.get("last_lines") or []]
    health = data.get("health")
    if isinstance(health, dict) and isinstance(health.get("reason"), str):
        out["health"] = {**health, "reason": scrub(health["reason"], found)}
    return out


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
