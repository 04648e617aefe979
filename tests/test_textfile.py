"""`doctor --format prometheus [--textfile PATH]`: the text parses with prometheus_client's own
parser and follows the naming rules on every fake host; the textfile is written atomically."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import fakehost as fh
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import xpuctl.state.atomic as atomic
from xpuctl.cli import app

runner = CliRunner()
NOT_PROM = "--textfile writes Prometheus text"
HOSTS = {
    "clean": fh.clean_host,
    "healthy": fh.healthy_host,
    "orphan": fh.orphan_host,
    "i915": fh.i915_host,
    "mixed": fh.mixed_vendor_host,
}
# units that are not base units (https://prometheus.io/docs/practices/naming/)
BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
NOT_BASE = re.compile(r"_(k|m|g|ki|mi|gi)?b$|_(kib|mib|gib|kb|mb|gb|ms|us|ns|milliseconds|minutes|"
                      r"hours|days|percent|percentage|celsius_milli)$|_(mib|gib|kib)_")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> dict[str, fh.FakeHost]:
    base = tmp_path_factory.mktemp("promhosts")
    return {name: make(base / name) for name, make in HOSTS.items()}


def invoke(root: Path, *args: str):
    res = runner.invoke(app, ["--root", str(root), "doctor", *args])
    assert "Traceback" not in res.stdout + (res.stderr or "")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"uncaught {res.exception!r}") from res.exception
    return res


def families(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"{fam.name} appears twice"
        out[fam.name] = fam
    return out


def sample(fams: dict, name: str, **labels: str) -> float:
    found = [s.value for s in fams[name].samples if s.labels == labels]
    assert len(found) == 1, (name, labels, fams[name].samples)
    return found[0]


# --- the text itself ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_prometheus_text_parses_and_follows_the_naming_rules(hosts, name):
    res = invoke(hosts[name].root, "--format", "prometheus")
    text = res.stdout
    assert res.exit_code in (0, 1)
    assert text.endswith("\n") and "\n\n" not in text
    fams = families(text)
    assert "xpuctl_build_info" in fams and "xpuctl_doctor_status" in fams
    seen_help: set[str] = set()
    seen_type: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            seen_help.add(line.split()[2])
        elif line.startswith("# TYPE "):
            assert line.split()[2] in seen_help, f"TYPE before HELP: {line}"
            seen_type.add(line.split()[2])
        else:
            metric = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            assert metric in seen_type, f"sample before its HELP/TYPE: {line}"
            # no timestamps: node_exporter's textfile collector rejects them
            assert len(line.rsplit("}", 1)[-1].split()) == (1 if "{" in line else 2), line
    for fam in fams.values():
        assert re.fullmatch(r"xpuctl_[a-z0-9_]+", fam.name), fam.name
        assert fam.type in ("gauge", "counter"), (fam.name, fam.type)  # "unknown" = no TYPE
        assert fam.documentation.strip(), f"{fam.name} has no HELP"
        assert fam.name in seen_help and fam.name in seen_type
        assert not NOT_BASE.search(fam.name), f"{fam.name}: not a base unit"
        if fam.type == "counter":
            assert fam.name.endswith("_total")
        for s in fam.samples:
            assert s.timestamp is None
            assert "pid" not in s.labels and "cmdline" not in s.labels  # cardinality
            if "device" in s.labels:
                assert BDF.fullmatch(s.labels["device"]), s.labels


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_prometheus_values_are_base_units_and_exact(hosts, name):
    """Bytes and seconds, to the unit: the same figures as doctor's JSON."""
    root = hosts[name].root
    data = json.loads(invoke(root, "--json").stdout)
    fams = families(invoke(root, "--format", "prometheus").stdout)
    intel = [d for d in data["devices"] if d["intel"]]
    assert {s.labels["device"] for s in fams["xpuctl_device_memory_used_bytes"].samples} == {
        d["bdf"] for d in intel
    }
    for d in intel:
        used = sample(fams, "xpuctl_device_memory_used_bytes", device=d["bdf"])
        assert used == (d["memory_used_bytes"] or 0)
        assert sample(fams, "xpuctl_device_holder_processes", device=d["bdf"]) == len(d["holders"])
        if d["memory_total_bytes"]:
            total = sample(fams, "xpuctl_device_memory_total_bytes", device=d["bdf"])
            assert total == d["memory_total_bytes"]
    stale = [a for a in data["artifacts"] if a["stale"]]
    assert sample(fams, "xpuctl_stale_bytes") == sum(a["size_bytes"] for a in stale)
    assert sample(fams, "xpuctl_doctor_status", status=data["status"]) == 1
    # an epoch in seconds, to well under a second (`:g` had rounded it to 10 000 s)
    ts = sample(fams, "xpuctl_doctor_last_run_timestamp_seconds")
    assert abs(ts - data["taken_at"]) < 60


def test_orphan_metrics(hosts):
    fams = families(invoke(hosts["orphan"].root, "--format", "prometheus").stdout)
    assert sample(fams, "xpuctl_doctor_check_ok", check="orphans") == 0
    assert sample(fams, "xpuctl_doctor_findings", check="orphans", severity="fail") >= 1
    assert sum(s.value for s in fams["xpuctl_device_orphan_processes"].samples) > 0
    clean = families(invoke(hosts["clean"].root, "--format", "prometheus").stdout)
    assert all(s.value == 1 for s in clean["xpuctl_doctor_check_ok"].samples)
    assert all(s.value == 0 for s in clean["xpuctl_device_orphan_processes"].samples)


def test_value_formatting_is_exact():
    from xpuctl.output.prometheus import sample_value as _value

    assert _value(12889096192) == "12889096192"
    assert _value(1796107093.486507) == "1796107093.486507"
    assert _value(0.5) == "0.5"
    assert float(_value(2.0**60)) == 2.0**60
    specials = (_value(float("nan")), _value(float("inf")), _value(-float("inf")))
    assert specials == ("NaN", "+Inf", "-Inf")


# --- --textfile: atomic write ---------------------------------------------------------------


def listing(d: Path) -> set[str]:
    return set(os.listdir(d))


@pytest.mark.parametrize("name", ["clean", "orphan"])
def test_textfile_written_whole_with_nothing_else_left(hosts, tmp_path, name):
    out = tmp_path / "collector"
    out.mkdir()
    (out / "other.prom").write_text("# someone else's\n")
    target = out / "xpuctl.prom"
    res = invoke(hosts[name].root, "--format", "prometheus", "--textfile", str(target))
    assert res.exit_code == (0 if name == "clean" else 1)  # doctor's verdict, as on stdout
    assert res.stdout == ""
    assert listing(out) == {"other.prom", "xpuctl.prom"}
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    text = target.read_text()
    assert text.endswith("\n")
    fams = families(text)
    assert fams["xpuctl_doctor_status"].samples
    stdout_fams = families(invoke(hosts[name].root, "--format", "prometheus").stdout)
    assert set(fams) == set(stdout_fams)


def test_textfile_implies_prometheus_and_replaces_by_rename(hosts, tmp_path):
    """A reader that opened the old file keeps reading the old, complete text: the new one
    arrives by rename (a new inode), never by rewriting the file in place."""
    target = tmp_path / "xpuctl.prom"
    target.write_text("# HELP xpuctl_old old\n# TYPE xpuctl_old gauge\nxpuctl_old 1\n")
    old_inode = target.stat().st_ino
    with open(target) as reader:
        res = invoke(hosts["healthy"].root, "--textfile", str(target))
        assert res.exit_code == 0, res.output
        assert reader.read() == "# HELP xpuctl_old old\n# TYPE xpuctl_old gauge\nxpuctl_old 1\n"
    assert target.stat().st_ino != old_inode
    assert "xpuctl_old" not in families(target.read_text())
    assert listing(tmp_path) == {"xpuctl.prom"}


@pytest.mark.parametrize("fail_at", ["write", "fsync", "replace", "fchmod"])
def test_failed_write_leaves_the_old_file_and_no_temporary(hosts, tmp_path, monkeypatch, fail_at):
    target = tmp_path / "xpuctl.prom"
    old = "# HELP xpuctl_old old\n# TYPE xpuctl_old gauge\nxpuctl_old 1\n"
    target.write_text(old)
    inode = target.stat().st_ino

    def boom(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, fail_at, boom)
    res = invoke(hosts["clean"].root, "--textfile", str(target))
    monkeypatch.undo()
    assert res.exit_code == 1
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0] and "No space left" in err[0], err
    assert target.read_text() == old and target.stat().st_ino == inode
    assert listing(tmp_path) == {"xpuctl.prom"}


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--textfile", "{d}/missing/xpuctl.prom"], "does not exist"),
        (["--textfile", "{d}/xpuctl.txt"], "must end in .prom"),
        (["--textfile", "{d}/dir.prom"], "is a directory"),
        (["--json", "--textfile", "{d}/xpuctl.prom"], NOT_PROM),
        (["--format", "table", "--textfile", "{d}/xpuctl.prom"], NOT_PROM),
        (["--format", "json", "--textfile", "{d}/xpuctl.prom"], NOT_PROM),
    ],
)
def test_textfile_usage_errors(hosts, tmp_path, args, needle):
    (tmp_path / "dir.prom").mkdir()
    before = listing(tmp_path)
    res = invoke(hosts["orphan"].root, *[a.format(d=tmp_path) for a in args])
    assert res.exit_code == 2, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xpuctl: error:") and needle in err[0], err
    assert listing(tmp_path) == before


def test_textfile_usage_error_through_the_console_script(tmp_path):
    """One line and exit 2 in a real process too (no box, no traceback)."""
    h = fh.clean_host(tmp_path / "root")
    out = subprocess.run(
        [sys.executable, "-m", "xpuctl", "--root", str(h.root), "doctor", "--textfile",
         str(tmp_path / "nope" / "x.prom")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and "does not exist" in out.stderr
