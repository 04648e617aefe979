"""`xpuctl snapshot`: capture what doctor reads into a .tar.gz for support.

The capture runs doctor itself (`doctor.diagnose`) through a `RecordingHost`, so the archive
holds exactly what doctor read, and nothing more: each file's contents as read (environ, maps, /proc/stat
and /proc/net/unix reduced by `parse/redact.py`; secrets in environments, command lines, run
records and log tails redacted there too), and the answers that are not contents in
`index.json`. The TCP LISTEN sockets doctor found (over netlink on a live host) are written
as /proc/net/tcp and tcp6 text, which is what a tree is read with. Added for people: the
lstat of every entry of /dev/shm and /tmp (names and metadata, no contents), the run
records and the last 200 lines of each run's log, and the manifest.

Layout of the archive (one top directory, `xpuctl-snapshot-<host>-<time>/`):

    manifest.json   schema xpuctl.snapshot/1: host, time, kernel, version, uid, what could
                    not be read and why, how the capture read the host, the software
                    stack's versions (probes/versions.py; not recorded files: never replayed)
    index.json      listings, link texts, lstat, resolved paths, fd links, errors
    probes.json     with --deep: the probes' results (xpuctl.probes/1) and the idle baseline
    root/...        file contents at their host paths (proc/<pid>/stat, sys/..., ...)
    state/runs/<name>.json, state/logs/<name>.log
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import tarfile
import time
from typing import Any, NamedTuple

from xpuctl import __version__
from xpuctl.archive.recording import RecordingHost
from xpuctl.core.model import Report
from xpuctl.diagnosis import DeepOptions, diagnose
from xpuctl.errors import UsageError
from xpuctl.host import containers
from xpuctl.host.seam import Host
from xpuctl.parse import redact, runtimestate
from xpuctl.parse.archive import SCHEMA
from xpuctl.parse.net import TcpSocket, format_tcp, is_v6
from xpuctl.parse.procfs import parse_cmdline, parse_environ
from xpuctl.state import atomic
from xpuctl.state.regular import open_regular

LOG_LINES = 200
_LOG_TAIL_MAX = 4 << 20  # bytes read from the end of a log for its last lines
_PID_FILE = re.compile(r"^/proc/(\d+)/(environ|maps|cmdline)$")
_NET_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
#: container runtimes' state (host/containers.py): kept reduced to the names read
_BUNDLE = re.compile("^(?:" + re.escape(containers.CONTAINERD_TASKS)
                     + r")/[^/]+/[^/]+/config\.json$|^(?:"
                     + "|".join(re.escape(d) for d in containers.CRIO_STORAGE)
                     + r")/[^/]+/userdata/config\.json$")
_DOCKER_CONFIG = re.compile("^" + re.escape(containers.DOCKER_CONTAINERS) + r"/[^/]+/config\.v2\.json$")


class Taken(NamedTuple):
    path: str  # the archive written ("-": stdout)
    size_bytes: int
    members: int
    processes: int
    unreadable: int
    seconds: float
    report: Report  # what doctor found while the archive was recorded


def _tail(path: str, lines: int = LOG_LINES) -> bytes:
    """The last `lines` lines of a file (reads at most _LOG_TAIL_MAX bytes from its end)."""
    fd = open_regular(path)  # a FIFO in its place must not block the capture
    try:
        end = os.fstat(fd).st_size
        start = max(0, end - _LOG_TAIL_MAX)
        data = os.pread(fd, end - start, start)
    finally:
        os.close(fd)
    cut = data.splitlines(keepends=True)
    return b"".join(cut[-lines:])


def _state(state_dir: str | None,
           secrets: set[str]) -> tuple[dict[str, bytes], list[dict[str, str]]]:
    """Run records and log tails, as archive files under state/; and what failed. A record's
    command line is redacted like a process's, its texts and the logs scrubbed of every
    secret shape and of `secrets` (parse/redact.py)."""
    from xpuctl.state import runs

    files: dict[str, bytes] = {}
    problems: list[dict[str, str]] = []
    if state_dir is None or not os.path.isdir(state_dir):
        return files, problems
    try:
        sdir = runs.ensure_state_dir(state_dir, create=False)
    except UsageError as exc:
        return files, [{"op": "state", "path": state_dir, "reason": str(exc)}]
    found = runs.read_runs(sdir)
    problems += [{"op": "record", "path": u.path, "reason": u.why} for u in found.unread]
    for rec in found.records:
        secrets |= redact.secret_values(rec.command)
    for rec in found.records:
        doc = rec.to_dict()
        doc["command"] = redact.argv(rec.command)
        text = redact.scrub(json.dumps(doc, indent=2), secrets)
        files[f"state/runs/{rec.name}.json"] = text.encode("utf-8", "surrogateescape")
        if not rec.log_path:
            continue
        try:
            tail = _tail(rec.log_path).decode("utf-8", "surrogateescape")
        except OSError as exc:
            problems.append({"op": "log", "path": rec.log_path, "reason": exc.strerror or str(exc)})
            continue
        files[f"state/logs/{rec.name}.log"] = redact.scrub(tail, secrets).encode(
            "utf-8", "surrogateescape")
    return files, problems


def _secrets(rec: RecordingHost, environ: dict[str, str]) -> set[str]:
    """Every secret value in what the capture read (environments, command lines) and in the
    caller's environment: looked for in the free text the archive keeps (logs, records)."""
    found = redact.secret_values(env=environ)
    for path, data in rec.contents.items():
        m = _PID_FILE.match(path)
        if m and m.group(2) == "environ":
            found |= redact.secret_values(env=parse_environ(data))
        elif m and m.group(2) == "cmdline":
            found |= redact.secret_values(parse_cmdline(data))
    return found


def _fixed_text(host: Host, hostpath: str, live_value: str) -> str | None:
    """A fact about the host (name, kernel): from its /proc, else ours when /proc is ours."""
    try:
        return host.read_text(hostpath, 4096).strip() or None
    except OSError:
        return live_value if host.proc_is_live else None


def _contents(rec: RecordingHost, listeners: list[TcpSocket] | None) -> dict[str, bytes]:
    """Host path -> bytes to store, reduced to what doctor uses."""
    out: dict[str, bytes] = {}
    for path, data in rec.contents.items():
        m = _PID_FILE.match(path)
        if m and m.group(2) == "environ":
            data = redact.environ(data)
        elif m and m.group(2) == "cmdline":
            data = redact.cmdline(data)
        elif m:
            data = redact.maps(data, rec.to_host)
        elif path == "/proc/stat":
            data = redact.proc_stat(data)
        elif path == "/proc/net/unix":
            text = data.decode("utf-8", "surrogateescape")
            data = redact.net_unix(text, rec.to_host).encode("utf-8", "surrogateescape")
        elif path in _NET_TCP:
            continue  # written below from the sockets doctor found
        elif _BUNDLE.match(path):
            data = runtimestate.reduce_bundle(data)  # the annotations read, nothing else
        elif _DOCKER_CONFIG.match(path):
            data = runtimestate.reduce_docker(data)
        out[path] = data
    if listeners is not None:
        out["/proc/net/tcp"] = format_tcp([s for s in listeners if not is_v6(s)]).encode()
        out["/proc/net/tcp6"] = format_tcp([s for s in listeners if is_v6(s)]).encode()
    return out


def _host_link(rec: RecordingHost, link: str) -> str:
    """An fd link text as a host path, the way the pass strips a root from it."""
    root = rec.root
    if root and link.startswith(root) and link[len(root) : len(root) + 1] == "/":
        return link[len(root) :]
    return link


def _index(rec: RecordingHost, listeners: list[TcpSocket] | None) -> dict[str, Any]:
    lists = dict(rec.lists)
    if isinstance(lists.get("/proc"), list):  # only the pids matter
        lists["/proc"] = [n for n in lists["/proc"] if n.isdigit()]
    fds: dict[str, Any] = {}
    for pid, links in rec.fds.items():
        fds[str(pid)] = links if isinstance(links, dict) else [
            [fd, _host_link(rec, link)] for fd, link in links
        ]
    errors = {p: e for p, e in rec.read_errors.items()
              if not (listeners is not None and p in _NET_TCP)}
    return {
        "lists": lists,
        "links": rec.links,
        "resolved": rec.resolved,
        "lstat": rec.lstats,
        "exists": rec.existence,
        "rdev": rec.rdevs,
        "fds": fds,
        "read_errors": errors,
        "sizes": rec.sizes,
    }


def _unreadable(index: dict[str, Any]) -> list[dict[str, Any]]:
    """What could not be read and why, for people (the index keeps it for the replay)."""
    out = []
    for path, (_, text, _) in sorted(index["read_errors"].items()):
        out.append({"op": "read", "path": path, "reason": text})
    for op, key in (("list", "lists"), ("readlink", "links"), ("resolve", "resolved"),
                    ("lstat", "lstat")):
        for path, v in sorted(index[key].items()):
            if isinstance(v, dict):
                out.append({"op": op, "path": path, "reason": v["error"][1]})
    for pid, v in sorted(index["fds"].items(), key=lambda kv: int(kv[0])):
        if isinstance(v, dict):
            out.append({"op": "fds", "path": f"/proc/{pid}/fd", "reason": v["error"][1]})
    return out


def _listings(rec: RecordingHost) -> None:
    """lstat every entry of /dev/shm and /tmp (doctor looks only at names it knows); the
    index keeps the first answer, so doctor's own stay as they were."""
    for directory in ("/dev/shm", "/tmp"):
        try:
            names = rec.listdir(directory)
        except OSError:
            continue
        for name in names:
            try:
                rec.lstat(f"{directory}/{name}")
            except OSError:
                continue


def _safe_name(text: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text or "host").strip("._") or "host"


def default_name(host: Host, at: float | None = None) -> str:
    name = _fixed_text(host, "/proc/sys/kernel/hostname", socket.gethostname())
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at if at is not None else time.time()))
    return f"xpuctl-snapshot-{_safe_name(name)}-{stamp}"


def _add(tf: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(mtime)
    info.mode = 0o644
    tf.addfile(info, io.BytesIO(data))


def _versions_start(environ: dict[str, str]) -> Any:
    """The versions children (probes/versions.py), started before doctor runs."""
    from xpuctl.probes import versions

    return versions.start(environ)


def _probes_doc(deep: DeepOptions, report: Report) -> dict[str, Any] | None:
    """The probes' JSON of a `--deep` capture, with the idle baseline it was judged against."""
    from xpuctl.parse.probes import results_to_json
    from xpuctl.probes.baseline import load_baseline

    d = report.scan.deep
    if d is None:
        return None
    doc = results_to_json(d.probes, d.probe_pids)
    baseline, problem = load_baseline(deep.state_dir)
    doc["baseline"] = baseline
    doc["baseline_problem"] = list(problem) if problem is not None else None
    return doc


def take(
    host: Host,
    out: str | None,
    environ: dict[str, str],
    state_dir: str | None = None,
    deep: DeepOptions | None = None,
) -> Taken:
    """Capture `host` into the archive `out` (None: a default name in the current
    directory; "-": stdout). With `deep`, doctor --deep is what runs, and the probes' JSON is
    kept as probes.json. The archive is written to a temporary file and renamed, so a
    reader never sees half of one."""
    t0 = time.monotonic()
    rec = RecordingHost(host)
    reading = None if deep is not None else _versions_start(environ)
    try:
        report = diagnose(rec, caller_env=environ, deep=deep)  # doctor itself: every read is kept
    except BaseException:
        if reading is not None:
            reading.abandon()
        raise
    stack = report.scan.deep.versions if report.scan.deep is not None else \
        reading.finish(host, report.scan.devices) if reading is not None else ()
    probes = _probes_doc(deep, report) if deep is not None else None
    _listings(rec)
    listeners = rec.listeners
    at = rec.taken_at if rec.taken_at is not None else report.scan.taken_at
    index = _index(rec, listeners)
    contents = _contents(rec, listeners)
    state_files, state_problems = _state(state_dir, _secrets(rec, environ))
    unreadable = _unreadable(index) + state_problems
    manifest = _manifest(host, rec, at, environ, probes is not None, unreadable, index, contents, state_files)
    manifest["versions"] = [v._asdict() for v in stack]  # kernel, driver, runtimes, packages
    top = default_name(host, at)
    members = 2 + (probes is not None) + len(contents) + len(state_files)

    def write(fileobj: Any) -> None:
        with tarfile.open(fileobj=fileobj, mode="w:gz", compresslevel=6,
                          format=tarfile.PAX_FORMAT) as tf:
            _add(tf, f"{top}/manifest.json", json.dumps(manifest, indent=2).encode(), at)
            _add(tf, f"{top}/index.json", json.dumps(index, separators=(",", ":")).encode(), at)
            if probes is not None:
                _add(tf, f"{top}/probes.json", json.dumps(probes, indent=1).encode(), at)
            for path, data in sorted(contents.items()):
                _add(tf, f"{top}/root{path}", data, at)
            for name, data in sorted(state_files.items()):
                _add(tf, f"{top}/{name}", data, at)

    path, size = _deliver(out, top, write)
    return Taken(path, size, members, manifest["contents"]["processes"], len(unreadable),
                 time.monotonic() - t0, report)


def _manifest(host: Host, rec: RecordingHost, at: float, environ: dict[str, str], deep: bool,
              unreadable: list[dict[str, Any]], index: dict[str, Any], contents: dict[str, bytes],
              state_files: dict[str, bytes]) -> dict[str, Any]:
    """manifest.json: where and when, what was captured, and what could not be read."""
    listed = index["lists"].get("/proc")
    return {
        "schema": SCHEMA,
        "host": _fixed_text(host, "/proc/sys/kernel/hostname", socket.gethostname()),
        "time": at,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)),
        "kernel": _fixed_text(host, "/proc/sys/kernel/osrelease", os.uname().release),
        "xpuctl_version": __version__,
        "uid": os.geteuid(),
        "root": host.origin,
        "clk_tck": host.clk_tck,
        "comm_trusted": rec.comm_trusted,
        "rdev_checked": rec.rdev_checked,
        "tcp_listeners": "netlink" if rec.proc_is_live else "/proc/net/tcp",
        "caller_env": redact.env_dict(environ),
        "deep": deep,
        "statvfs": rec.statvfs_seen,  # /dev/shm's [size, free] as doctor saw it
        "unreadable": unreadable,
        "contents": {
            "files": len(contents),
            "processes": sum(1 for n in listed if n.isdigit()) if isinstance(listed, list) else 0,
            "runs": sum(1 for n in state_files if n.startswith("state/runs/")),
        },
    }


def _deliver(out: str | None, top: str, write: Any) -> tuple[str, int]:
    """Write the archive to stdout ("-") or atomically to a file: (path, size)."""
    if out == "-":
        import shutil
        import sys

        buf = io.BytesIO()
        write(buf)
        size = buf.tell()
        buf.seek(0)
        # the gzip'd archive itself (binary, for a pipe): no text for a terminal passes here
        shutil.copyfileobj(buf, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return "-", size
    path = os.path.abspath(out or f"{top}.tar.gz")
    try:
        atomic.replace(path, write)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path, os.path.getsize(path)
