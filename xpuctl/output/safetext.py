"""The one place that makes host text safe to print on a terminal (and in Prometheus labels).

xpuctl runs as root and prints text other users control: argv and comm, file names in /tmp
and /dev/shm, sysfs strings, vLLM's log lines. GNU ps and systemd escape such text; so do we.

Two layers, both here:

- `safe(text, limit)` escapes one field: the renderers apply it to every host string they put
  in a table cell, a finding or a line, so a field stays one line and tables keep their layout.
- The sinks escape again at the point of printing, so a field that skipped `safe` still cannot
  reach the terminal raw: `emit(stream, text)` for plain lines (escaped line by line), and
  `console()` for rich output: a Console whose every text segment is escaped after layout,
  just before rich adds its own styling. Markup and emoji codes are off, so `[bold]x[/bold]`
  or `:skull:` in host text prints literally; xpuctl styles with `Text` and `style=`, never
  with markup strings. A test (tests/test_untrusted_text.py) fails when code prints any other
  way (print(), its own Console, markup parsing, writes of non-constant text to sys.stdout).

JSON keeps the exact text (render.to_json writes `\\udcxx` escapes for bytes that were not
UTF-8, see the README); Prometheus label values use the exposition format's escapes
(`prom_label`).

Shown as visible escapes: C0 controls and DEL as \\xNN (newline, tab, CR as \\n, \\t, \\r: one
field stays one line), bytes that were not UTF-8 (kept by the readers as surrogates,
\\udc80-\\udcff) as \\xNN with NN >= 80, C1 controls as \\u0080-\\u009f (a character, not a
byte), any other lone surrogate, the Unicode line/paragraph separators and the
bidirectional overrides that can reorder what a reader sees (U+202A-U+202E, U+2066-U+2069).
A backslash is shown as `\\\\`, so escaped text reads back one way only: `\\x1b` in the output is
an ESC, `\\\\x1b` the four characters `\\`, `x`, `1`, `b`. The result is capped at `limit`
characters, never in the middle of an escape.

`safe` is therefore applied once per field, where the field is put into a line. The sinks
(`emit`, `console`, and `neutral` for composed one-line messages) escape control characters
only and leave backslashes alone: what reaches them is xpuctl's own words plus fields that
went through `safe`, and escaping those backslashes again would double every escape. A field
that skipped `safe` still cannot reach a terminal raw; only its backslashes stay ambiguous.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Literal

if TYPE_CHECKING:  # rich is imported on first use (console): JSON and completion never need it
    from rich.console import Console, RenderableType
    from rich.segment import Segment

LIMIT = 4096

# C0 controls are listed apart: the sinks keep newlines, `safe` escapes them too
_REST = "\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_CLASS = "\x00-\x1f" + _REST
_UNSAFE = f"[{_UNSAFE_CLASS}]"
_FIELD = f"[\\\\{_UNSAFE_CLASS}]"  # a field: the backslash too (see the module doc)
_UNSAFE_BUT_NEWLINE = f"[\x00-\x09\x0b-\x1f{_REST}]"
# one escape `safe` writes, or one character: a cut never splits an escape
_SHOWN = r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|.)|."
_PROM = f'[\\\\"{_UNSAFE_CLASS}]'
_COMPILED: dict[str, re.Pattern[str]] = {}


def _re(pattern: str) -> re.Pattern[str]:
    """Compiled on first use: a class spanning the BMP takes ~1 ms to compile, and most
    runs (JSON, completion) never escape anything."""
    compiled = _COMPILED.get(pattern)
    if compiled is None:
        compiled = _COMPILED[pattern] = re.compile(pattern)
    return compiled
_NAMED = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\x1b": "\\x1b"}


def _escape_char(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x80:  # \xNN above 0x7f is a byte that was not UTF-8, never a character
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def _escape(m: re.Match[str]) -> str:
    return _escape_char(m.group())


def _text(text: object) -> str:
    if text is None:
        return ""
    if isinstance(text, (bytes, bytearray)):
        return bytes(text).decode("utf-8", "surrogateescape")
    return text if isinstance(text, str) else str(text)


def _cut(shown: str, limit: int) -> str:
    if len(shown) <= limit:
        return shown
    out, used = [], 0
    for m in _re(_SHOWN).finditer(shown):
        piece = m.group()
        if used + len(piece) > max(0, limit - 1):
            break
        out.append(piece)
        used += len(piece)
    return "".join(out) + "…"


def safe(text: object, limit: int = LIMIT) -> str:
    """`text` with every control character, stray byte and bidi override shown as an escape,
    and every backslash doubled (so the escapes are unambiguous).

    Bytes are decoded as UTF-8 with undecodable bytes kept (and then shown as \\xNN); None
    becomes "". Longer results are cut to `limit` characters, the last one an ellipsis.
    """
    text = _text(text)
    unsafe = _re(_FIELD)
    if unsafe.search(text):
        text = unsafe.sub(_escape, text)
    return _cut(text, limit) if len(text) > limit else text


def neutral(text: object) -> str:
    """Composed text (xpuctl's words and fields that went through `safe`) made one safe line:
    control characters, newlines included, shown as escapes; backslashes kept as they are."""
    text = _text(text)
    unsafe = _re(_UNSAFE)
    return unsafe.sub(_escape, text) if unsafe.search(text) else text


def neutral_lines(text: object) -> str:
    """The sinks' pass (see the module doc): like `neutral`, but newlines stay newlines."""
    text = _text(text)
    unsafe = _re(_UNSAFE_BUT_NEWLINE)
    return unsafe.sub(_escape, text) if unsafe.search(text) else text


def emit(stream: IO[str], text: str) -> None:
    """Write `text` plus a newline to a text stream, every line escaped: the sink for every
    plain (non-rich) human line xpuctl prints. JSON and Prometheus text need none (they are
    printable by construction) and are written directly."""
    stream.write(neutral_lines(text) + "\n")
    stream.flush()


def passthrough(stream: IO[bytes], data: bytes) -> None:
    """Bytes copied unchanged for a script: `xpuctl logs` into a pipe or a file (the log is
    the user's own file; `cat` would copy it as it is). Never to a terminal: there every
    line goes through `emit`."""
    if stream.isatty():
        raise ValueError("passthrough refuses a terminal: use emit")
    stream.write(data)
    stream.flush()


# -- rich ----------------------------------------------------------------------------------

_CONSOLE_CLASS: type[Console] | None = None

ColorSystem = Literal["auto", "standard", "256", "truecolor", "windows"]


def console(stderr: bool = False, *, file: IO[str] | None = None, width: int | None = None,
            soft_wrap: bool = False, force_terminal: bool | None = None,
            color_system: ColorSystem | None = "auto") -> Console:
    """A rich Console for human output that cannot print host text raw (see the module doc).

    Markup and emoji codes are off (also in `status()`, whose spinner would read markup
    anyway): style with `rich.text.Text` or `style=`. Every text
    segment (not rich's own control segments: cursor moves of a status line) passes through
    `neutral_lines` after layout and before rich renders its styles, so only rich's own escape
    sequences reach a terminal.
    """
    global _CONSOLE_CLASS  # noqa: PLW0603 (the rich class, built once on first use: rich is imported lazily)
    if _CONSOLE_CLASS is None:
        _CONSOLE_CLASS = _safe_console_class()
    return _CONSOLE_CLASS(stderr=stderr, file=file, width=width, soft_wrap=soft_wrap,
                          force_terminal=force_terminal, color_system=color_system,
                          markup=False, emoji=False, highlight=False)


def _safe_console_class() -> type[Console]:
    from rich.console import Console
    from rich.segment import Segment
    from rich.status import Status
    from rich.style import StyleType
    from rich.text import Text

    def plain(text: RenderableType) -> RenderableType:
        return Text(text) if isinstance(text, str) else text

    class SafeConsole(Console):
        def status(self, status: RenderableType, *, spinner: str = "dots",
                   spinner_style: StyleType = "status.spinner", speed: float = 1.0,
                   refresh_per_second: float = 12.5) -> Status:
            # rich's Spinner reads a str status as markup whatever the console says
            st = super().status(plain(status), spinner=spinner,
                                spinner_style=spinner_style, speed=speed,
                                refresh_per_second=refresh_per_second)
            update = st.update

            def update_plain(status: RenderableType | None = None, *, spinner: str | None = None,
                             spinner_style: StyleType | None = None,
                             speed: float | None = None) -> None:
                update(None if status is None else plain(status), spinner=spinner,
                       spinner_style=spinner_style, speed=speed)

            # the one method patched: markup off
            st.update = update_plain  # type: ignore[method-assign]
            return st

        def _render_buffer(self, buffer: Iterable[Segment]) -> str:
            buffer = list(buffer)
            unsafe = _re(_UNSAFE_BUT_NEWLINE)
            if unsafe.search("".join(s.text for s in buffer if not s.control)):
                buffer = [
                    seg if seg.control or not unsafe.search(seg.text)
                    else Segment(neutral_lines(seg.text), seg.style, seg.control)
                    for seg in buffer
                ]
            return super()._render_buffer(buffer)

    if not hasattr(Console, "_render_buffer"):  # pragma: no cover - guarded by a test too
        raise RuntimeError("rich.Console._render_buffer is gone: update xpuctl.output.safetext")
    return SafeConsole


# -- Prometheus ----------------------------------------------------------------------------

def _prom_escape(m: re.Match[str]) -> str:
    ch = m.group()
    if ch == "\\":
        return "\\\\"
    if ch == '"':
        return '\\"'
    if ch == "\n":
        return "\\n"
    # no escape for it in the exposition format: the visible escape, its backslash escaped
    return "\\" + _escape_char(ch)


def prom_label(value: object) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped as the text
    exposition format requires (so a parser reads the exact text back); other control
    characters and stray bytes, which the format cannot carry, become visible escapes."""
    return _re(_PROM).sub(_prom_escape, _text(value))
