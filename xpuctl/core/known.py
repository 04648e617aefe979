"""Known issues, one table: versions of the stack that fail in ways a clean host cannot show.

Each row names its upstream report(s), the component and version range it holds for, the
cards it was seen on, the symptom, the mitigation, and the texts that show it in vLLM's log
or the kernel log. `doctor --deep` matches the versions it reads (probes/versions.py: oneCCL,
the GuC firmware, the compute runtime, the kernel) against the ranges (`known-issues`, a
warning with the mitigation); serve's diagnosis of a hung or crashed start names the rows
whose texts its log shows, and those the run's own versions fall in (probes/versions.py
known_rows). docs/known-issues.md is made from this table (`markdown()`;
tests/test_known_issues.py holds the file equal to it). No I/O.

A range is `first` ≤ version (when given), version ≤ `last` (when given) and version <
`fixed` (when given): the releases seen bad, up to the first seen good. Versions compare by
their leading numbers (`2022.1.1`, `70.58.0`; a suffix such as `+xpu` is ignored).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from xpuctl.core.model import Version

_NUMBERS = re.compile(r"^v?(\d{1,9}(?:\.\d{1,9}){0,5})")


class KnownIssue(NamedTuple):
    key: str  # stable: scripts and alerts may key on it
    title: str
    component: str  # the Version name it is matched on: oneccl | guc | level-zero-gpu | kernel
    first: str | None  # first version seen bad (inclusive)
    last: str | None  # last version seen bad (inclusive), when no fixed one is known
    fixed: str | None  # first version seen good (exclusive end)
    cards: str  # where it was seen
    symptom: str
    mitigation: str
    links: tuple[str, ...]  # upstream reports, first the one that names the range
    signs: tuple[str, ...] = ()  # texts of vLLM's log or the kernel log that show it
    # a warning when the version is in range; an open-ended row that holds for every current
    # release (no fixed one known) is said as info: a warning on every healthy host is noise,
    # and --strict would fail them all. Its signs in a log still name it in serve's diagnosis.
    warn: bool = True

    def matches(self, version: str | None) -> bool:
        v = version_key(version)
        if v is None:
            return False
        first, last, fixed = (version_key(x) for x in (self.first, self.last, self.fixed))
        return ((first is None or first <= v) and (last is None or v <= last)
                and (fixed is None or v < fixed))

    def range_text(self) -> str:
        low = f"{self.first}" if self.first else "any"
        if self.fixed:
            return f"{low} up to (not incl.) {self.fixed}"
        if self.last:
            return f"{low} to {self.last}" if self.first != self.last else low
        return f"{low} and later (no fixed release known)"


def version_key(version: str | None) -> tuple[int, ...] | None:
    """The leading numbers of a version, padded to six places; None when it has none."""
    m = _NUMBERS.match(version.strip()) if version else None
    if m is None:
        return None
    nums = [int(x) for x in m.group(1).split(".")]
    return tuple(nums + [0] * (6 - len(nums)))


ONECCL_ALLREDUCE = KnownIssue(
    key="oneccl-2022-allreduce-hang",
    title="oneCCL 2022.x's default allreduce hangs across cards",
    component="oneccl",
    first="2022.0.0",
    last="2022.1.1",
    fixed=None,
    cards="multi-GPU Arc Pro B60 (Battlemage G21, 8086:e211)",
    symptom=("every all_reduce through the SYCL/Level Zero path hangs for good (vLLM's warm-up "
             "all_reduce never returns); the kernel then logs GuC job timeouts and engine "
             "resets, and every rank aborts with UR_RESULT_ERROR_DEVICE_LOST; 2021.17.2 works"),
    mitigation=("set CCL_ALLREDUCE=ring (an end-to-end cost of about 30 % measured in vLLM "
                "#50545), or use oneCCL 2021.17.2"),
    links=("https://github.com/uxlfoundation/oneCCL/issues/215",
           "https://github.com/vllm-project/vllm/issues/50545"),
    signs=("UR_RESULT_ERROR_DEVICE_LOST",),
)
ONECCL_IPC_CACHE = KnownIssue(
    key="oneccl-stale-ipc-handle",
    title="oneCCL reuses a stale cached Level Zero IPC handle",
    component="oneccl",
    first="2021.17.0",
    last=None,
    fixed=None,
    cards="Battlemage (2x Arc Pro B70, 8086:e223), tensor parallel 2",
    symptom=("after a peer frees and reallocates a buffer, a rank copies through the stale "
             "opened handle: a GPU page fault, then an endless wait in "
             "ze_base_entry::is_event_completed (the ranks hang; broken pipes and KVS errors "
             "follow)"),
    mitigation=("set CCL_ZE_CACHE_OPEN_IPC_HANDLES=0 (about 3 % throughput; CCL_ZE_CACHE=0, "
                "the blunt version, about 39 %)"),
    links=("https://github.com/uxlfoundation/oneCCL/issues/212",
           "https://github.com/vllm-project/vllm/issues/41663"),
    signs=("is_event_completed",),
    warn=False,
)
GUC_70_58 = KnownIssue(
    key="guc-70.58-engine-reset",
    title="GuC firmware 70.58 faults under sustained load",
    component="guc",
    first="70.58.0",
    last=None,
    fixed="70.65.0",
    cards=("Arc Pro B60, B70 and B580 (Battlemage), one card or several, with or without "
           "oneCCL"),
    symptom=("under sustained Level Zero load the GuC resets the compute engine: the kernel "
             "logs `Engine reset: engine_class=ccs`, `Timedout job` and `Fault response: "
             "Unsuccessful -ENOENT` (often a bcs reset after), the job is lost and the card "
             "may wedge; 70.65.0 and 70.72.1 do not"),
    mitigation=("install newer GuC firmware (linux-firmware's xe/bmg_guc_70.bin, 70.72.1 or "
                "later), rebuild the initramfs and reboot"),
    links=("https://github.com/vllm-project/vllm/issues/55425",
           "https://github.com/intel/compute-runtime/issues/948"),
    signs=("Fault response: Unsuccessful -ENOENT", "Engine reset: engine_class=ccs"),
)

#: The table, in the order of docs/known-issues.md.
KNOWN: tuple[KnownIssue, ...] = (ONECCL_ALLREDUCE, ONECCL_IPC_CACHE, GUC_70_58)

#: The component names doctor --deep reads, as docs/known-issues.md names them.
COMPONENTS = {"oneccl": "oneCCL", "guc": "GuC firmware", "level-zero-gpu": "compute runtime "
              "(Level Zero GPU driver)", "kernel": "kernel"}


class Match(NamedTuple):
    issue: KnownIssue
    version: str
    source: str | None


def by_version(versions: Iterable[Version]) -> list[Match]:
    """The rows whose range holds a version read, each row once per version."""
    out: list[Match] = []
    for v in versions:
        for issue in KNOWN:
            if issue.component == v.name and issue.matches(v.version):
                m = Match(issue, v.version or "", v.source)
                if m not in out:
                    out.append(m)
    return out


def by_signs(lines: Iterable[str]) -> list[KnownIssue]:
    """The rows whose texts a log shows, in table order."""
    text = "\n".join(lines)
    return [k for k in KNOWN if any(s in text for s in k.signs)]


def named(issue: KnownIssue) -> str:
    """One line for people: the row, its range, the mitigation and its first link."""
    what = COMPONENTS.get(issue.component, issue.component)
    return (f"known issue {issue.key} ({what} {issue.range_text()}): {issue.title}; "
            f"try: {issue.mitigation} ({issue.links[0]})")


_INTRO = """\
Versions of the stack that fail in ways a clean host cannot show. This page is made from the
table in `xpuctl/core/known.py` (`markdown()`; tests/test_known_issues.py holds the two equal
and says how to write it again). `doctor --deep` reads the versions (oneCCL, the GuC firmware from
debugfs or the kernel log, the compute runtime, the kernel: [checks.md](checks.md)) and gives
a `known-issues` warning with the mitigation for each one in a range below (info for a row
that no release is known to fix: it holds for every current one); serve's diagnosis
of a start that hung or crashed names the rows whose signs its log shows, and, for a start
that did not get ready, the rows the run's own versions fall in."""


def markdown() -> str:
    """docs/known-issues.md, whole."""
    out = [
        "# Known issues",
        "",
        *_INTRO.splitlines(),
        "",
        "| key | component | versions | seen on | symptom | mitigation | signs | upstream |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in KNOWN:
        signs = ", ".join(f"`{s}`" for s in k.signs) or "-"
        links = ", ".join(f"[{_short(u)}]({u})" for u in k.links)
        out.append(f"| `{k.key}` | {COMPONENTS.get(k.component, k.component)} | "
                   f"{k.range_text()} | {k.cards} | {k.symptom} | {k.mitigation} | {signs} | "
                   f"{links} |")
    return "\n".join(out) + "\n"


def _short(url: str) -> str:
    """`oneCCL #215` for a GitHub issue's address."""
    parts = url.rstrip("/").split("/")
    return f"{parts[-3]} #{parts[-1]}" if len(parts) >= 5 else url

