"""Where run records, logs, locks, the audit log and the idle baseline live: one resolver.

`resolve_state_dir(host, given, environ)`:
- an explicit directory wins: `--state-dir`, else `XPUCTL_STATE_DIR` in the environment;
- else the default of this machine: `/run/xpuctl` for root, else `$XDG_RUNTIME_DIR/xpuctl`,
  else `/tmp/xpuctl-<uid>`, but only when the host's processes are this machine's
  (`host.proc_is_live`: no --root, or a root whose proc is the real /proc);
- else (under --root on a fake tree or an unpacked archive) None: the runs of this machine
  say nothing about that tree, so nothing of them is read or written.

The directory is created and checked (0700, owned by us) by `runs.ensure_state_dir`.
`check_writable` is serve's last look before it starts a run: a state directory that cannot
take a record and its log (read-only, full) refuses the start (exit 2, one line), before
vLLM runs, rather than leave a run nobody can find or stop by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from xpuctl.errors import UsageError
from xpuctl.host.seam import Host

ENV_VAR = "XPUCTL_STATE_DIR"
ROOT_STATE_DIR = "/run/xpuctl"  # root's own, when none is given


def default_state_dir(environ: Mapping[str, str] | None = None) -> str:
    """This machine's state directory when none is given (XPUCTL_STATE_DIR counts as given)."""
    env = os.environ if environ is None else environ
    if env.get(ENV_VAR):
        return env[ENV_VAR]
    if os.geteuid() == 0:
        return ROOT_STATE_DIR
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


#: What serve must be able to write before it starts a run, in `runs/` and in `logs/`: a
#: record (a few KiB) and the temporary copy that replaces it, with room to spare.
PROBE_BYTES = 16 * 1024


def check_writable(state_dir: str) -> None:
    """UsageError (exit 2) unless `runs/` and `logs/` of `state_dir` each take PROBE_BYTES
    (written, fsynced and removed again): a read-only or full filesystem is found here."""
    import tempfile  # here: every command imports this module, only serve writes

    for sub in ("runs", "logs"):
        try:
            fd, tmp = tempfile.mkstemp(prefix=".xpuctl-room.", dir=os.path.join(state_dir, sub))
        except OSError as exc:
            raise _unwritable(state_dir, exc) from None
        try:
            view = memoryview(bytes(PROBE_BYTES))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            raise _unwritable(state_dir, exc) from None
        finally:
            os.close(fd)
            os.unlink(tmp)


def _unwritable(state_dir: str, exc: OSError) -> UsageError:
    from xpuctl.output.safetext import safe

    return UsageError(f"state directory {safe(state_dir)} cannot be written "
                      f"({exc.strerror or exc}): serve starts no run it cannot record")
