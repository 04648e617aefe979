"""Tables and blocks for people, drawn with rich: devices, processes, runs, findings, doctor.

rich is imported only inside these functions (it costs ~60 ms, and scripts asking for JSON
never need it). Every cell of host text goes through `safetext.safe` (`_cell`), and the
console that prints them (`safetext.console`) escapes whatever reaches it again. No line
ends in padding: the findings are laid out here, not in a rich grid that pads every row to
the widest one.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from xpuctl.core.model import Finding, Report, Scan, Version
from xpuctl.core.runrecords import RunRow
from xpuctl.core.units import human_age, human_bytes
from xpuctl.output.safetext import safe
from xpuctl.parse.procfs import ARGV_SHOWN_BYTES

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.table import Table
    from rich.text import Text

#: a command as Process.command gives it (capped), escaped (at worst \xNN a byte), its mark
COMMAND_SHOWN = 4 * ARGV_SHOWN_BYTES + 64
_SEV_STYLE = {"fail": "bold red", "warn": "yellow", "info": "cyan"}
_STATUS_STYLE = {"clean": "bold green", "busy": "bold cyan", "dirty": "bold red",
                 "unknown": "bold yellow"}



def _used_cell(scan: Scan, bdf: str) -> str:
    """fdinfo's used memory (shared counted once), with what is resident and shared beside it
    when the driver prints them and they differ from it."""
    used = scan.memory_used(bdf)
    if used is None:
        return "-"
    extra = []
    resident = scan.memory_resident(bdf)
    if resident is not None and resident != used:
        extra.append(f"{human_bytes(resident)} resident")
    shared = scan.memory_shared(bdf)
    if shared:
        extra.append(f"{human_bytes(shared)} shared")
    if "sysfs-clients" in (scan.memory_source(bdf) or ""):
        extra.append("from the i915 clients sysfs")
    return human_bytes(used) + (f" ({', '.join(extra)})" if extra else "")

def _cell(value: object) -> Text:
    """A table cell holding host text: escaped (safetext.safe), never read as markup."""
    from rich.text import Text

    return Text(safe(value))


def _dev_label(scan: Scan, bdf: str) -> str:
    """The Level Zero index when there is one (short), else the BDF."""
    d = scan.device(bdf)
    if d is None or d.index is None:
        return bdf
    return str(d.index)


def _holders_cell(scan: Scan, holders: tuple[int, ...]) -> Text:
    """The holders' pids, those in a container followed by its pod and name:
    `3010, 3020 (serving/llama-0/vllm), 4000`."""
    groups: dict[str | None, list[int]] = {}
    for pid in holders:
        p = scan.process(pid)
        groups.setdefault(p.container.short if p is not None and p.container else None, []).append(pid)
    parts = [", ".join(map(str, pids)) + (f" ({where})" if where else "") for where, pids in groups.items()]
    return _cell(", ".join(parts) or "-")


def devices_table(scan: Scan) -> _Fitted:
    """The devices, one row each, fitted to the console's width when printed (_Fitted)."""
    from rich.table import Table
    from rich.text import Text

    t = Table(expand=False)
    deep_cols = ("device used", "unattributed", "state") if scan.deep else ()
    healths = {d.bdf: _card_health(scan, d.bdf, d.health) for d in scan.devices}
    health_col = ("health",) if any(healths.values()) else ()  # only when a card tells
    right = ("#", "memory used", "total", "device used", "unattributed")
    names = ("#", "BDF", "node", "driver", "id", "memory used", "total", "holders", *deep_cols,
             *health_col)
    for col in names:
        t.add_column(_one_line(col), justify="right" if col in right else "left", no_wrap=True,
                     overflow="ellipsis")
    rows = []
    for d in scan.devices:
        holders = scan.holders(d.bdf)
        view = scan.deep.device(d.bdf) if scan.deep else None
        extra = () if not scan.deep else (
            "-" if view is None or view.memory_used_bytes is None
            else f"{human_bytes(view.memory_used_bytes)} ({view.source})",
            "-" if view is None or view.unattributed_bytes is None else human_bytes(view.unattributed_bytes),
            "-" if view is None else (Text(view.state, style="bold red") if view.state != "ok" else "ok"),
        )
        rows.append([_one_line(c) for c in (
            "-" if d.index is None else str(d.index),
            _cell(d.bdf),
            _cell((d.render_node or d.card_node or "-").rsplit("/", 1)[-1]),
            _cell(d.driver or "?"),
            _cell(f"{d.vendor_id or '?'}:{d.device_id or '?'}"),  # ? : not read (a device in reset)
            _used_cell(scan, d.bdf),
            human_bytes(d.memory_total_bytes) if d.memory_total_bytes else "-",
            _holders_cell(scan, holders),
            *extra,
            *((_card_health_cell(healths[d.bdf]),) if health_col else ()),
        )])
    for row in rows:
        t.add_row(*row)
    natural = [max([len(n), *(r[i].cell_len for r in rows)]) for i, n in enumerate(names)]
    return _Fitted(t, names, natural)


def _card_health(scan: Scan, bdf: str, sysfs: str | None) -> str | None:
    """The card's own verdict: xe's gpu_health and Sysman's (--deep), the worse one named."""
    from xpuctl.parse.health import RANK

    view = scan.deep.device(bdf) if scan.deep else None
    told = [(h, src) for h, src in ((sysfs, ""), (view.health if view else None, " (sysman)"))
            if h is not None]
    if not told:
        return None
    level, src = max(told, key=lambda t: RANK.get(t[0], -1))
    return level + src


def _card_health_cell(said: str | None) -> Text | str:
    from rich.text import Text

    if said is None:
        return "-"
    return said if said.startswith(("ok", "unknown")) else Text(said, style="bold red")


#: The order in which a narrow terminal shortens the devices table's columns, first to last
#: (each cell then cut with "…"). "#" and the BDF, which name a device, are never shortened.
SHRINK_ORDER = ("id", "node", "driver", "holders", "health", "state", "unattributed",
                "device used", "total", "memory used")
#: a shortened column keeps this many columns ("ren…") while others can give way
SHRINK_FLOOR = 4


class _Fitted:
    """A table whose columns are narrowed in SHRINK_ORDER to fit the console's width, when it
    is printed (rich alone would narrow every column, "#" and the BDF too)."""

    def __init__(self, table: Table, names: tuple[str, ...], natural: list[int]) -> None:
        self.table = table
        self.names = names
        self.natural = natural

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = list(self.natural)
        # a cell's padding (one column each side) and one border between and around columns
        excess = sum(widths) + 3 * len(widths) + 1 - options.max_width
        _shrink(widths, self.names, [(name, floor) for floor in (SHRINK_FLOOR, 1)
                                     for name in SHRINK_ORDER], excess)
        for column, width, natural in zip(self.table.columns, widths, self.natural, strict=True):
            column.width = width if width < natural else None
        yield self.table


def _one_line(cell: object) -> Text:
    """A cell kept on one line and cut with "…" when its column is narrower (a Text cell
    keeps its style; a str is plain text, never markup)."""
    from rich.text import Text

    text = cell.copy() if isinstance(cell, Text) else Text(str(cell))
    text.no_wrap = True
    text.overflow = "ellipsis"
    return text


def probes_line(scan: Scan) -> Text | None:
    """One line naming each deep probe and whether it answered (a rich Text, no markup)."""
    if scan.deep is None:
        return None
    from rich.text import Text

    line = Text("deep probes: ")
    for n, r in enumerate(scan.deep.probes):
        if n:
            line.append(", ")
        line.append(f"{r.name} ")
        if r.available:
            line.append("ok", style="green")
            line.append(f" {r.seconds or 0:.2f}s")
        elif r.timed_out:
            line.append("timed out", style="yellow")
        else:
            line.append("unavailable", style="dim")
    why = [f"{r.name}: {safe(r.reason or '?')}" for r in scan.deep.probes if not r.available]
    if why:
        line.append("  (" + "; ".join(why) + ")")
    return line


def versions_line(versions: Iterable[Version]) -> str:
    """`versions: kernel 6.8.0-45-generic, xe 6.8.0-45-generic, ..., ray ? (not installed …)`."""
    parts = [f"{v.name} {safe(v.version, 64)}" if v.version else f"{v.name} ? ({safe(v.why, 120)})"
             for v in versions]
    return "versions: " + ", ".join(parts)


def processes_table(scan: Scan, title: str = "Processes", width: int = 120) -> Text:
    """A ps-style listing (rich's Table squeezes short columns when a command is long)."""
    from rich.text import Text

    # a POD/CONTAINER column only when a listed process runs in a container
    boxed = any(p.container is not None for p in scan.processes)
    heads = ["PID", "PPID", "S", "ROLE", "DEV", "MEMORY", "RUN",
             *(["POD/CONTAINER"] if boxed else []), "COMMAND"]
    rows = []
    for p in scan.processes:
        rows.append(
            [
                str(p.pid),
                str(p.ppid),
                safe(p.state + (f"({p.wchan})" if p.wchan else ""), 64),
                safe((p.role or "-") + (f" {p.rank}" if p.rank else "") + (" ORPHAN" if p.orphan else "")
                     + (f" being stopped by {p.stopping_by}" if p.stopping_by else "")
                     + ((f" under {p.embedded_in.pid} (no answer)" if p.embedded_in.blocked
                         else f" embedded in {p.embedded_in.pid}") if p.embedded_in else ""), 64),
                safe(",".join(_dev_label(scan, b) for b in p.devices) or "-", 64),
                human_bytes(p.memory_bytes) if p.memory_bytes is not None else "-",
                safe((p.run_id or "-")[:8]),
                *([safe(p.container.short if p.container else "-", 64)] if boxed else []),
                safe(p.command, COMMAND_SHOWN),
            ]
        )
    orphan = [False] + [p.orphan for p in scan.processes]
    last = len(heads) - 1  # the command, cut to the room left
    widths = [max([len(heads[i])] + [len(r[i]) for r in rows]) for i in range(last)]
    _narrow(heads, rows, widths, width)
    role_at = sum(w + 2 for w in widths[:3])
    out = Text()
    out.append(title, style="bold")
    for i, r in enumerate([heads, *rows]):
        cells = [c.rjust(w) if j < 2 else c.ljust(w) for j, (c, w) in enumerate(zip(r[:last], widths, strict=True))]
        head = "  ".join(cells) + "  "
        room = max(12, width - len(head))
        cmd = r[last] if len(r[last]) <= room else r[last][: room - 1] + "…"
        line = Text((head + cmd).rstrip())
        if i == 0:
            line.stylize("bold")
        elif orphan[i]:
            at = role_at + r[3].rfind(" ORPHAN") + 1
            line.stylize("bold red", at, at + len("ORPHAN"))
        out.append("\n")
        out.append_text(line)
    return out


#: What a narrow terminal shortens in a process listing, first to last, and how far (each
#: cell then cut with "…"): PID, PPID, DEV and MEMORY are never shortened, and the command
#: keeps COMMAND_ROOM columns when the others can give them.
PS_SHRINK = (("S", 6), ("POD/CONTAINER", 8), ("RUN", 3), ("ROLE", 12))
COMMAND_ROOM = 12


def _narrow(heads: list[str], rows: list[list[str]], widths: list[int], width: int) -> None:
    """Shorten the columns of PS_SHRINK (in place) until the listing fits `width`."""
    before = list(widths)
    _shrink(widths, heads, PS_SHRINK, sum(w + 2 for w in widths) + COMMAND_ROOM - width)
    for i, (was, now) in enumerate(zip(before, widths, strict=True)):
        if now < was:
            keep = " ORPHAN" if heads[i] == "ROLE" else ""  # a role keeps its mark
            heads[i] = _cut(heads[i], now)
            for r in rows:
                r[i] = _cut(r[i], now, keep=keep)


def _shrink(widths: list[int], names: Sequence[str], plan: Iterable[tuple[str, int]],
            excess: int) -> None:
    """Narrow the columns named in `plan` (name, the width it keeps), in its order, each by
    as much of `excess` as it can give, until nothing is in excess (`widths` in place; a
    name not among `names` is skipped). The one rule of both tables for a narrow terminal."""
    for name, floor in plan:
        if excess <= 0:
            return
        if name in names:
            i = names.index(name)
            cut = min(excess, max(0, widths[i] - floor))
            widths[i] -= cut
            excess -= cut


def _cut(text: str, width: int, keep: str = "") -> str:
    """`text` in `width` columns, cut with "…"; a `keep` mark in it (a role's ORPHAN) stays."""
    if len(text) <= width:
        return text
    if keep and keep in text:
        head, tail = text.split(keep, 1)
        mark = keep + tail if len(keep + tail) < width - 1 else keep
        if len(mark) < width - 1:
            return head[: width - len(mark) - 1] + "…" + mark
    return text[: max(0, width - 1)] + "…"


def _health_cell(r: RunRow, now: float) -> str:
    """What the watch says of a run, as `xpuctl health` judges it ("-": nothing recorded)."""
    if r.health is None:
        return "-"
    from xpuctl.core.watch import judge

    return judge(r.state, r.health, now).status
def ports_table(scan: Scan) -> Text:
    """The listeners doctor tied to something: the serving port, vLLM's, oneCCL's KVS."""
    from rich.text import Text

    heads = ["PORT", "ADDRESS", "PID", "WHAT"]
    rows = []
    for p in scan.ports:
        if p.pid is None:
            continue
        what = "oneCCL KVS" if p.kind == "oneccl-kvs" else ""
        if p.role:
            what = f"{what} of {p.role}" if what else p.role
        what = (what or "-") + (" ORPHAN" if p.orphan else "")
        rows.append([str(p.port), safe(p.address or "-", 64), str(p.pid), safe(what, 64)])
    widths = [max([len(heads[i])] + [len(r[i]) for r in rows]) for i in range(len(heads))]
    out = Text()
    for i, row in enumerate([heads, *rows]):
        if i:
            out.append("\n")
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        out.append(line, style="bold" if i == 0 else None)
    return out


def runs_table(rows: Sequence[RunRow]) -> Text:
    """xpuctl's runs (from their records): name, state, age, pid, port, devices, health."""
    import time

    from rich.text import Text

    now = time.time()
    heads = ["NAME", "STATE", "AGE", "PID", "PORT", "DEVICES", "HEALTH"]
    cells = [[safe(r.name), r.state, human_age(r.age_seconds), str(r.pid or "-"), str(r.port or "-"),
              ",".join(r.devices) or "-", _health_cell(r, now)] for r in rows]
    widths = [max([len(heads[i])] + [len(c[i]) for c in cells]) for i in range(len(heads))]
    out = Text("Runs", style="bold")
    for i, row in enumerate([heads, *cells]):
        out.append("\n")
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        out.append(line, style="bold" if i == 0 else None)
    return out


def print_devices(console: Console, scan: Scan) -> None:
    """The devices table, or a plain sentence where it would be empty."""
    if not any(d.is_intel for d in scan.devices):
        console.print("no Intel GPU found", highlight=False)
    if scan.devices:
        _heading(console, "Devices")
        console.print(devices_table(scan))


def _heading(console: Console, title: str) -> None:
    """A table's title on its own line (rich pads a table title to the table's width)."""
    from rich.text import Text

    console.print(Text(title, style="bold"))


def findings_table(findings: Sequence[Finding]) -> _Findings:
    """Severity, check id, then the message; a long message wraps under itself (a hanging
    indent), and the remedy follows on its own line in the same column. Host text is
    escaped (safe) and printed as plain text, never as rich markup. Laid out at the width
    of the console that prints it, with no padding at the ends of lines."""
    return _Findings(tuple(findings))


class _Findings:
    def __init__(self, findings: tuple[Finding, ...]) -> None:
        self.findings = findings

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.text import Text

        check_w = max((len(f.check) for f in self.findings), default=0)
        indent = 2 + 4 + 1 + check_w + 1  # "  FAIL " + check + " "
        room = max(20, options.max_width - indent)
        for f in self.findings:
            line = Text("  " + f.severity.upper().ljust(4), style=_SEV_STYLE[f.severity], end="\n")
            line.append(" ")
            line.append(f.check.ljust(check_w), style="dim")
            line.append(" ")
            _hanging(line, safe(f.message), room, indent)
            if f.remedy:
                line.append("\n" + " " * indent)
                line.append("fix: ", style="dim")
                _hanging(line, safe(f.remedy), room - 5, indent + 5, style="bold")
            line.no_wrap = True
            yield line


def _hanging(out: Text, text: str, room: int, indent: int, style: str | None = None) -> None:
    """`text` wrapped to `room` columns, every line after the first indented by `indent`."""
    lines = textwrap.wrap(text, room, break_long_words=True, break_on_hyphens=False) or [""]
    out.append(("\n" + " " * indent).join(lines), style=style)


def print_doctor(console: Console, report: Report) -> None:
    from rich.text import Text

    scan = report.scan
    print_devices(console, scan)
    line = probes_line(scan)
    if line:
        console.print(line, highlight=False)
    if scan.deep is not None and scan.deep.versions:
        console.print(Text(versions_line(scan.deep.versions)), highlight=False)
    if scan.shm is not None:
        console.print(Text(f"{scan.shm.path}: {human_bytes(scan.shm.size_bytes)}, "
                           f"{human_bytes(scan.shm.free_bytes)} free"), highlight=False)
    if scan.processes:
        console.print(processes_table(scan, width=console.width), no_wrap=True, crop=True)
    if any(p.pid is not None for p in scan.ports):
        _heading(console, "Ports")
        console.print(ports_table(scan), no_wrap=True, crop=True)
    stale = [a for a in scan.artifacts if a.stale]
    if stale:
        from rich.table import Table

        t = Table()
        for col in ("path", "kind", "owner", "size", "age"):
            t.add_column(col)
        for a in stale:
            t.add_row(
                _cell(a.path),
                _cell(a.kind),
                str(a.owner_uid),
                human_bytes(a.size_bytes),
                human_age(a.age_seconds),
            )
        _heading(console, "Stale files")
        console.print(t)
    if report.findings:
        console.print(Text("Findings", style="bold"))
        console.print(findings_table(report.findings))
    status = report.status
    bare = " (no Intel GPU found)" if any(f.check == "no-device" for f in report.findings) else ""
    counts = status_counts(report.findings)
    if counts:  # "clean, 2 warnings": never a bare "clean" above findings that warn
        console.print(Text.assemble((status, _STATUS_STYLE[status]), f", {counts}", bare))
    else:
        console.print(Text.assemble("status: ", (status, _STATUS_STYLE[status]), bare))


def status_counts(findings: tuple[Finding, ...] | list[Finding]) -> str:
    """`3 failing, 2 warnings` (what follows the status word), or "" when nothing fails or
    warns."""
    fails = sum(1 for f in findings if f.severity == "fail")
    warns = sum(1 for f in findings if f.severity == "warn")
    parts = [f"{fails} failing"] if fails else []
    if warns:
        parts.append(f"{warns} warning{'s' if warns != 1 else ''}")
    return ", ".join(parts)
