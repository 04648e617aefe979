"""The one function that makes host text safe to print on a terminal.

xpuctl runs as root and prints text other users control: argv and comm, file names in /tmp
and /dev/shm, sysfs strings, vLLM's log lines. Every such string goes through `safe` before a
human-facing renderer prints it (tables, findings, timelines, the status line, error
messages), as GNU ps and systemd escape argv. JSON keeps the exact text (see render.to_json);
Prometheus label values use the exposition format's own escapes.

Shown as visible escapes: C0 controls (including newline and tab: one field stays one line),
DEL, C1 controls, bytes that were not UTF-8 (kept by the readers as surrogates, \\udc80-\\udcff,
shown as \\xNN), any other lone surrogate, and the bidirectional overrides that can reorder
what a reader sees (U+202A-U+202E, U+2066-U+2069). The result is capped at `limit` characters.
"""

from __future__ import annotations

import re

LIMIT = 4096

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\x1b": "\\x1b"}


def _escape(m: re.Match[str]) -> str:
    ch = m.group()
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def safe(text: object, limit: int = LIMIT) -> str:
    """`text` with every control character, stray byte and bidi override shown as an escape.

    Bytes are decoded as UTF-8 with undecodable bytes kept (and then shown as \\xNN); None
    becomes "". Longer results are cut to `limit` characters, the last one an ellipsis.
    """
    if text is None:
        return ""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "surrogateescape")
    elif not isinstance(text, str):
        text = str(text)
    if _UNSAFE.search(text):
        text = _UNSAFE.sub(_escape, text)
    if len(text) > limit:
        text = text[: max(0, limit - 1)] + "…"
    return text
