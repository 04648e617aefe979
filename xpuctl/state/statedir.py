"""Where run records, logs, locks, the audit log and the idle baseline live: one resolver.

`resolve_state_dir(host, given, environ)`:
- an explicit directory wins: `--state-dir`, else `XPUCTL_STATE_DIR` in the environment;
- else the default of this machine: `/run/xpuctl` for root, else `$XDG_RUNTIME_DIR/xpuctl`,
  else `/tmp/xpuctl-<uid>`, but only when the host's processes are this machine's
  (`host.proc_is_live`: no --root, or a root whose proc is the real /proc);
- else (under --root on a fake tree or an unpacked archive) None: the runs of this machine
  say nothing about that tree, so nothing of them is read or written.

The directory is created and checked (0700, owned by us) by `runs.ensure_state_dir`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from xpuctl.host.seam import Host

ENV_VAR = "XPUCTL_STATE_DIR"


def default_state_dir(environ: Mapping[str, str] | None = None) -> str:
    """This machine's state directory when none is given (XPUCTL_STATE_DIR counts as given)."""
    env = os.environ if environ is None else environ
    if env.get(ENV_VAR):
        return env[ENV_VAR]
    if os.geteuid() == 0:
        return "/run/xpuctl"
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "xpuctl")
    return f"/tmp/xpuctl-{os.geteuid()}"


def resolve_state_dir(host: Host, given: str | None, environ: Mapping[str, str]) -> str | None:
    """The state directory for a command on `host` (see the module's docstring)."""
    if given:
        return given
    if environ.get(ENV_VAR):
        return environ[ENV_VAR]
    return default_state_dir(environ) if host.proc_is_live else None
