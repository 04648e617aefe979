"""The last run's oneCCL/vLLM hang and crash signatures, and what to try before relaunching;
the state directory's run records that are stale or could not be read."""

from __future__ import annotations

from xpuctl.core import advice
from xpuctl.core.checks.registry import Ctx, check
from xpuctl.core.model import Finding, LastRun


def last_run_keys(run: LastRun | None) -> list[str]:
    """The advice keys (core.advice.BY_SIGNATURE) of the newest run: none when it went well."""
    if run is None:
        return []
    keys = [s.key for s in run.signatures]
    if any(s.kind == "crash" for s in run.signatures):  # the crash's own advice first
        return keys + (["not-ready"] if run.not_ready else [])
    return (["not-ready"] if run.not_ready else []) + keys


def last_run_findings(run: LastRun | None) -> list[Finding]:
    """The relaunch advice for the state directory's newest run (also used by reset)."""
    keys = last_run_keys(run)
    if run is None or not keys:
        return []
    said = []
    crash = next((s for s in run.signatures if s.kind == "crash"), None)
    if crash is not None:
        # an error ended the start: it crashed (in the phase it reached), it was not stuck
        said.append(f"crashed (in: {run.phase})")
    elif run.not_ready:
        said.append(f"was not ready in time (stuck in: {run.phase})")
    shown = [s for s in run.signatures if not (run.not_ready and s.key == "xccl-stuck")]
    if shown:
        said.append("its log shows " + ", ".join(s.what for s in shown))
    line = next((s.line for s in run.signatures if s.line), "")
    quoted = f": {line[:160]}" if line else ""
    return [
        Finding(
            "last-run",
            "warn",
            f"the last run {run.name} {' and '.join(said)}{quoted} (log {run.log_path})",
            "before the next launch, try (advice only; each has a cost): "
            + "; ".join(advice.lines(keys)),
            paths=(run.log_path,),
        )
    ]


@check("last-run")
def last_run(c: Ctx) -> list[Finding]:
    """The newest run ended in a readiness timeout or its log shows a oneCCL hang or crash
    (with --device, only a run that claimed one of those devices)."""
    run = c.scan.last_run
    if run is not None and c.wanted and run.devices and not c.wanted & set(run.devices):
        return []
    return last_run_findings(run)



_RECORD_REMEDY = {
    "stale": "nothing of the run is left to stop; `xpuctl ps` shows it as stale until a run "
             "of that name replaces the record (or remove {path})",
    "damaged": "xpuctl does not read it: move it aside or remove it ({path}); a run it "
               "named is found by --pid or --port",
    "unreadable": "run xpuctl as the user who owns the state directory (root's runs: as root)",
}


@check("run-records")
def run_records(c: Ctx) -> list[Finding]:
    """A run record whose run is gone (stale), or one that could not be read (state/live)."""
    out = []
    for r in c.scan.records:
        if r.kind == "stale":
            msg = f"run {r.name} is gone, its record is stale: {r.detail}"
        elif r.name is None and r.path.rsplit("/", 1)[-1] in ("locks", "logs"):
            msg = f"{r.path} is {r.detail}: serve refuses this state directory"
        elif r.name is None:
            msg = f"the runs in {r.path} cannot be listed: {r.detail}"
        else:
            what = "damaged" if r.kind == "damaged" else "not readable"
            msg = f"run record {r.path} is {what}: {r.detail}"
        out.append(Finding("run-records", "warn", msg,
                           _RECORD_REMEDY.get(r.kind, "").format(path=r.path), paths=(r.path,)))
    return out
