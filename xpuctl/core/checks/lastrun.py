"""The last run's oneCCL/vLLM hang and crash signatures, and what to try before relaunching."""

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


# Output order of the ids; every registered check has a place here (a test holds them equal).
