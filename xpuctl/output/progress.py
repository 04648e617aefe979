"""serve's start shown as it happens: the phase tracker and the three ways to show it.

`Tracker` turns vLLM's log lines into phase changes (the table is `parse.vllmlog.PHASES`,
the same one the readiness diagnosis and doctor's `last-run` use). A view shows them:

- `LiveView` (stderr is a terminal, no --quiet): one status line redrawn in place (run
  name, elapsed, phase, last vLLM line cut to the width), replaced by a one-line summary
  when the server is ready. Other output (xpuctl's messages, vLLM's own lines echoed on the
  same terminal) is written above it.
- `PlainView` (not a terminal): one plain line per phase change with seconds since launch,
  no control characters (CI logs, journalctl).
- `QuietView` (--quiet): only xpuctl's messages.

The same views show what a flow waits for (`wait`, a `core.waits.Wait`: the stop ladder's
drain, teardown, escalation and release, the collective check): on a terminal a countdown
line redrawn in place about every quarter second (`draining vllm-8000: 3 requests running,
12 s left`), on its own or after serve's start; elsewhere one plain line per phase, never
one per tick; nothing with --quiet. Lines written meanwhile (`say`, `above`: a stop's
timeline) go above it.

With --detach the supervisor runs in another process: `PipeSink` sends the same calls as
JSON lines through a pipe and `replay` plays them into the parent's view.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import threading
import time
from collections.abc import Callable
from typing import IO, Protocol

from xpuctl.core.waits import Wait
from xpuctl.output.lines import phase_line, wait_line, wait_phase_line
from xpuctl.output.safetext import emit, neutral_lines, safe
from xpuctl.parse.redact import scrub
from xpuctl.parse.vllmlog import READY, STARTING, Phase, phase_of, short_line


class Tracker:
    """Phases from log lines; pure apart from the times it is given."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.phase: Phase = STARTING
        self.since = t0
        self.spent: list[tuple[str, float]] = []  # (label, seconds) of each phase left
        self.last_line = ""

    def feed(self, line: str, now: float) -> Phase | None:
        """Take one vLLM line; the phase it moves the start to, or None."""
        if line.strip():
            self.last_line = line
        p = phase_of(line)
        if p is None or p.rank <= self.phase.rank:
            return None
        self._enter(p, now)
        return p

    def ready(self, now: float) -> None:
        self._enter(READY, now)

    def _enter(self, p: Phase, now: float) -> None:
        self.spent.append((self.phase.label, now - self.since))
        self.phase, self.since = p, now

    def summary(self) -> str:
        return ", ".join(f"{label} {secs:.1f}s" for label, secs in self.spent)


class View(Protocol):
    def say(self, msg: str) -> None: ...
    def phase(self, t: float, label: str) -> None: ...
    def line(self, text: str) -> None: ...
    def ready(self, msg: str) -> None: ...
    def tick(self) -> None: ...
    def echo(self, line: str) -> None: ...
    def finish(self) -> None: ...
    def wait(self, w: Wait | None) -> None: ...
    def above(self, stream: IO[str], text: str) -> None: ...


class _Base:
    def __init__(self, err: IO[str], name: str) -> None:
        self.err = err
        self.name = name
        self.lock = threading.Lock()

    def _write(self, text: str) -> None:
        try:
            self.err.write(text)
            self.err.flush()
        except (OSError, ValueError):
            pass

    def say(self, msg: str) -> None:
        with self.lock:
            self._write(neutral_lines(msg) + "\n")

    def phase(self, t: float, label: str) -> None:
        pass

    def line(self, text: str) -> None:
        pass

    def ready(self, msg: str) -> None:
        self.say(msg)

    def tick(self) -> None:
        pass

    def echo(self, line: str) -> None:
        """A line of vLLM's own output, escaped, to stdout (foreground serve)."""
        _echo(line)

    def finish(self) -> None:
        """The start is over without a `ready` (failed, stopped): no more status."""

    def wait(self, w: Wait | None) -> None:
        """What a flow waits for now (None: nothing any more)."""

    def above(self, stream: IO[str], text: str) -> None:
        """A line of the command's own output (a stop's timeline) on `stream`, escaped."""
        with self.lock:
            try:
                emit(stream, text)
            except (OSError, ValueError):
                pass


def _echo(line: str) -> None:
    import sys

    try:
        emit(sys.stdout, safe(scrub(line)))  # vLLM logs its arguments, secrets included
    except (OSError, ValueError):
        pass


class QuietView(_Base):
    pass


class PlainView(_Base):
    def __init__(self, err: IO[str], name: str) -> None:
        super().__init__(err, name)
        self.last_wait: tuple[str, str] | None = None

    def phase(self, t: float, label: str) -> None:
        self.say(f"xpuctl: {self.name}: {phase_line(t, label)}")

    def wait(self, w: Wait | None) -> None:
        """One line when a phase begins; its ticks and counts are not lines."""
        if w is None or (w.phase, w.subject) == self.last_wait:
            return
        self.last_wait = (w.phase, w.subject)
        self.say(f"xpuctl: {wait_phase_line(w, time.monotonic())}")


class LiveView(_Base):
    """One status line on a terminal, redrawn in place (`\\r` + erase line): serve's start,
    or what a flow waits for with the time left (a thread redraws the countdown)."""

    MIN_REDRAW = 0.1  # seconds between redraws caused by log lines
    TICK = 0.25  # seconds between redraws of a countdown

    def __init__(self, err: IO[str], name: str, t0: float | None = None,
                 same_terminal: bool = False) -> None:
        super().__init__(err, name)
        self.t0 = time.monotonic() if t0 is None else t0
        self.label = STARTING.label
        self.text = ""
        self.shown = False
        self.done = False
        self.last_draw = 0.0
        self.same_terminal = same_terminal  # vLLM's echoed output shares the terminal
        self.waiting: Wait | None = None
        self.ticker: threading.Thread | None = None  # redraws a countdown (from the first wait)
        self.ending = threading.Event()  # the ticker's end (ready, finish)
        self.drawn = ""  # the status line as last drawn

    def _status(self) -> str:
        width = shutil.get_terminal_size((80, 24)).columns
        if self.waiting is not None:
            lead = "xpuctl: "
            return lead + wait_line(self.waiting, time.monotonic(), max(20, width - 1 - len(lead)))
        elapsed = time.monotonic() - self.t0
        head = f"xpuctl: {self.name} {elapsed:5.0f}s {self.label}"
        tail = safe(scrub(short_line(self.text)), 512)
        text = f"{head} | {tail}" if tail else head
        return text[: max(10, width - 1)]

    def _clear(self) -> None:
        if self.shown:
            self._write("\r\x1b[2K")
            self.shown = False

    def _draw(self) -> None:
        if self.done and self.waiting is None:
            return
        text = self._status()
        if self.shown and text == self.drawn:
            return  # the same line: nothing to redraw
        self._write("\r\x1b[2K" + text)
        self.shown = True
        self.drawn = text
        self.last_draw = time.monotonic()

    def say(self, msg: str) -> None:
        with self.lock:
            self._clear()
            self._write(neutral_lines(msg) + "\n")
            self._draw()

    def phase(self, t: float, label: str) -> None:
        with self.lock:
            self.label = label
            self._draw()

    def line(self, text: str) -> None:
        with self.lock:
            self.text = text
            if time.monotonic() - self.last_draw >= self.MIN_REDRAW:
                self._draw()

    def tick(self) -> None:
        with self.lock:
            self._draw()

    def ready(self, msg: str) -> None:
        with self.lock:
            self._clear()
            self.done = True
            self._write(neutral_lines(msg) + "\n")
            ticker = self._end_ticker()
        if ticker is not None:
            ticker.join(1.0)

    def finish(self) -> None:
        with self.lock:
            self._clear()
            self.done = True
            self.waiting = None
            ticker = self._end_ticker()
        if ticker is not None:
            ticker.join(1.0)  # gone before the command ends (cli.leave: the last thread)

    def _end_ticker(self) -> threading.Thread | None:
        """Stop the countdown's thread (under the lock); the caller joins it outside."""
        ticker, self.ticker = self.ticker, None
        self.ending.set()
        return ticker

    def echo(self, line: str) -> None:
        if not self.same_terminal:
            _echo(line)
            return
        with self.lock:
            self._clear()
            _echo(line)
            self._draw()

    def wait(self, w: Wait | None) -> None:
        with self.lock:
            self.waiting = w
            if w is None:
                self._clear()  # serve's start status comes back with its next tick
                return
            self._draw()
            if self.ticker is None:
                self.ending = threading.Event()
                self.ticker = threading.Thread(target=self._count_down, args=(self.ending,),
                                               daemon=True, name="xpuctl-countdown")
                self.ticker.start()

    def _count_down(self, ending: threading.Event) -> None:
        while not ending.wait(self.TICK):
            with self.lock:
                if self.waiting is not None:
                    self._draw()

    def above(self, stream: IO[str], text: str) -> None:
        with self.lock:
            self._clear()
            try:
                emit(stream, text)
            except (OSError, ValueError):
                pass
            self._draw()


def choose(err: IO[str], name: str, quiet: bool, t0: float | None = None) -> View:
    """The view for this stderr: live on a terminal, plain lines elsewhere, quiet on request."""
    if quiet:
        return QuietView(err, name)
    try:
        tty = err.isatty()
    except (OSError, ValueError):
        tty = False
    if not tty:
        return PlainView(err, name)
    same = False
    try:
        a, b = os.fstat(1), os.fstat(err.fileno())
        same = (a.st_dev, a.st_ino, a.st_rdev) == (b.st_dev, b.st_ino, b.st_rdev)
    except (OSError, ValueError, AttributeError):
        pass
    return LiveView(err, name, t0, same_terminal=same)


def countdown(err: IO[str], quiet: bool = False) -> View:
    """A view for a command that only waits (shutdown, doctor --collective): its `wait`s
    shown as a countdown on a terminal, one line per phase elsewhere; no start status."""
    view = choose(err, "", quiet)
    view.finish()
    return view


# -- --detach: the supervisor's calls through a pipe -------------------------------------


class PipeSink:
    """A View that sends every call to the waiting parent as one JSON line; `log` also
    keeps xpuctl's messages in the run log. Once `close`d (the parent has its answer)
    only the log is written."""

    MIN_LINE = 0.2  # seconds between `line` messages (the parent redraws from them)

    def __init__(self, fd: int, log: Callable[[str], None]) -> None:
        self.fd: int | None = fd
        self.log = log
        self.lock = threading.Lock()
        self.last_line = 0.0

    def _send(self, *msg: object) -> None:
        with self.lock:
            if self.fd is None:
                return
            try:
                os.write(self.fd, (json.dumps(msg) + "\n").encode())
            except OSError:
                self._close()

    def _close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

    def say(self, msg: str) -> None:
        self.log(msg)
        self._send("say", msg)

    def phase(self, t: float, label: str) -> None:
        self.log(f"xpuctl: {phase_line(t, label)}")
        self._send("phase", t, label)
        self.last_line = 0.0  # the line that started it goes out at once

    def line(self, text: str) -> None:
        now = time.monotonic()
        if now - self.last_line >= self.MIN_LINE:
            self.last_line = now
            self._send("line", text)

    def ready(self, msg: str) -> None:
        self.log(msg)
        self._send("ready", msg)

    def tick(self) -> None:
        pass

    def echo(self, line: str) -> None:
        pass

    def finish(self) -> None:
        pass

    def wait(self, w: Wait | None) -> None:
        self._send("wait", None if w is None else list(w))

    def above(self, stream: IO[str], text: str) -> None:
        self.say(text)

    def end(self, status: str) -> None:
        """The parent's answer (`ready`, `failed N`, `exit N`); closes the pipe."""
        self._send("end", status)
        with self.lock:
            self._close()


def replay(fd: int, view: View, tick: float = 0.5) -> str:
    """Play a PipeSink's messages into `view` until its `end`; returns the status ("" when
    the pipe closed without one: the supervisor died)."""
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], tick)
        if not ready:
            view.tick()
            continue
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            return ""
        buf += chunk
        while b"\n" in buf:
            raw, buf = buf.split(b"\n", 1)
            try:
                msg = json.loads(raw)
                kind = msg[0]
            except (ValueError, IndexError, TypeError):
                continue
            if kind == "end":
                return str(msg[1])
            if kind == "say":
                view.say(str(msg[1]))
            elif kind == "phase":
                view.phase(float(msg[1]), str(msg[2]))
            elif kind == "line":
                view.line(str(msg[1]))
            elif kind == "ready":
                view.ready(str(msg[1]))
            elif kind == "wait":
                view.wait(_wait_of(msg[1]))


def _wait_of(fields: object) -> Wait | None:
    """A Wait sent through the pipe (a list of its fields), or None."""
    if not isinstance(fields, list) or len(fields) != len(Wait._fields):
        return None
    phase, subject, deadline, processes, requests, step = fields
    try:
        return Wait(str(phase), str(subject), float(deadline),
                    None if processes is None else int(processes),
                    None if requests is None else int(requests),
                    None if step is None else str(step))
    except (TypeError, ValueError):
        return None
