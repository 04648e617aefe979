"""node-problem-detector's custom plugin line (`doctor --format npd`): one judged report in,
one line out.

NPD's custom plugin monitor (node-problem-detector/docs/custom_plugin_monitor.md and
config/plugin/*.json) runs a script every `invoke_interval`, keeps at most
`max_output_length` bytes of its stdout (80 in its examples) as the condition's message, and
reads its exit status: 0 OK, 1 NonOK, anything else Unknown. So the line is printable ASCII,
cut to `LIMIT` bytes with its newline, and says the verdict first: what fails (the first
failing finding and how many more), what could not be told, or that nothing fails.
"""

from __future__ import annotations

from xpuctl.core.model import Finding, Report
from xpuctl.output.safetext import neutral, safe

#: NPD's max_output_length in its plugin configs: the line and its newline fit in it
LIMIT = 80
PREFIX = "xpuctl: "


def _fit(text: str) -> str:
    """One line of printable ASCII, `LIMIT` bytes at most with its newline (cut with `...`)."""
    flat = " ".join(neutral(text).split())
    line = (PREFIX + flat).encode("ascii", "backslashreplace").decode("ascii")
    room = LIMIT - 1
    return line if len(line) <= room else line[:room - 3].rstrip() + "..."


def failing(report: Report, strict: bool) -> tuple[Finding, ...]:
    """The findings that fail: `fail`, and `warn` too with --strict."""
    bad = ("fail", "warn") if strict else ("fail",)
    return tuple(f for f in report.findings if f.severity in bad)


def npd_line(report: Report, strict: bool) -> str:
    """The verdict of a report, as NPD shows it (without the newline)."""
    bad = failing(report, strict)
    if bad:
        return _fit(f"{len(bad)} failing; {bad[0].check}: {safe(bad[0].message)}")
    if report.status == "unknown":
        blocked = [f for f in report.findings if f.check == "blocked-reads"]
        why = safe(blocked[0].message) if blocked else "a read did not answer"
        return _fit(f"could not tell: {why}")
    warned = sum(1 for f in report.findings if f.severity == "warn")
    gpus = sum(1 for d in report.scan.devices if d.is_intel)
    tail = f", {warned} warning(s)" if warned else ""
    return _fit(f"ok: {gpus} Intel GPU(s), {report.status}, nothing failing{tail}")


def unknown_line(reason: str) -> str:
    """An error ended the check: NPD's Unknown, with why."""
    return _fit(f"could not tell: {reason}")
