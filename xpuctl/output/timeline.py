"""A timeline line: seconds since the start, a phase, what happened.

The one format of the shutdown ladder's events (`shutdown`, `reset`, serve stopping its own
run) and of serve's start-up phases; host text in the detail is escaped here."""

from __future__ import annotations

from xpuctl.output.safetext import safe


def event_line(t: float, phase: str, detail: str) -> str:
    """`   1.25s  sigterm             SIGTERM to api-server 42 (r1)`"""
    return f"{t:7.2f}s  {phase:<18} {safe(detail)}"


def phase_line(t: float, label: str) -> str:
    """A start-up phase as it begins: `  12.3s loading model` (tenths: phases last seconds)."""
    return f"{t:6.1f}s {label}"
