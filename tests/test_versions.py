"""The software stack's versions in `doctor --deep` and in snapshots: kernel, driver, Level
Zero loader and GPU runtime, oneCCL, torch, IPEX, vLLM, Ray, xpu-smi; each missing one says
why. Nothing is loaded in the CLI process.

Formats: /proc/sys/kernel/osrelease (one line, proc(5)); /sys/module/<name>/version exists for
modules that declare MODULE_VERSION (out-of-tree and backport builds), not for in-tree xe
(Linux Documentation/ABI/stable/sysfs-module); library file names as the packages install them
(`libze_loader.so.1.21.9` from level-zero, `libze_intel_gpu.so.1.6.31294` from
compute-runtime: the maps line of docs/intel.md's fake host names it); package metadata as
importlib.metadata reads a `NAME-VERSION.dist-info/METADATA` (PyPA core metadata: `Name`,
`Version`); `xpu-smi --version` as parse/xpusmi.py documents it.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from importlib import metadata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_deep import base_scenario, deep_host, deep_json, standin_env
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.parse.versions import lib_version, module_version, newest_lib, parse_packages

runner = CliRunner()
NAMES = ("kernel", "xe", "guc", "level-zero-loader", "level-zero-gpu", "oneccl", "torch", "ipex",
         "vllm", "ray", "xpu-smi")


@pytest.mark.parametrize(("name", "stem", "version"), [
    ("libze_loader.so.1.21.9", "libze_loader", "1.21.9"),
    ("libze_intel_gpu.so.1.6.31294", "libze_intel_gpu", "1.6.31294"),
    ("libze_loader.so.1", "libze_loader", None),  # the soname link: only the major
    ("libze_loader.so", "libze_loader", None),
    ("libze_loader.so.1.21.9.bak", "libze_loader", None),
    ("libze_tracing_layer.so.1.21.9", "libze_loader", None),
])
def test_lib_version(name, stem, version):
    assert lib_version(name, stem) == version


def test_the_newest_library_wins():
    names = ["libze_loader.so.1", "libze_loader.so.1.9.2", "libze_loader.so.1.21.9", "x"]
    assert newest_lib(names, "libze_loader") == ("libze_loader.so.1.21.9", "1.21.9")
    assert newest_lib(["libc.so.6"], "libze_loader") is None


def test_packages_line():
    text = 'noise\n{"python": "3.11.7", "packages": {"torch": "2.8.0+xpu", "ray": null}}\n'
    pkgs = parse_packages(text)
    assert pkgs is not None and pkgs.python == "3.11.7"
    assert pkgs.found == {"torch": "2.8.0+xpu", "ray": None}
    assert parse_packages("Traceback (most recent call last):\n") is None
    assert module_version("1.3.6-debian\n") == "1.3.6-debian" and module_version("a b") is None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.text(max_size=40))
def test_parsers_never_raise(text, name):
    parse_packages(text)
    module_version(text)
    lib_version(name, "libze_loader")


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _stack_tree(tmp_path, site_packages: dict[str, str]):
    """The deep test host, plus the files the versions are read from, and a directory of
    dist-info metadata on PYTHONPATH (what pip writes)."""
    root = tmp_path / "root"
    deep_host(root)
    (root / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/osrelease").write_text("6.8.0-45-generic\n")
    (root / "sys/module/xe").mkdir(parents=True)  # in-tree: no version file
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    for name in ("libze_loader.so.1.21.9", "libze_intel_gpu.so.1.6.31294"):
        (lib / name).write_bytes(b"\x7fELF")
    os.symlink("libze_loader.so.1.21.9", lib / "libze_loader.so.1")
    meta = tmp_path / "meta"
    for dist, version in site_packages.items():
        d = meta / f"{dist.replace('-', '_')}-{version}.dist-info"  # pip's file name
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return root, meta


def _with_meta(env: dict[str, str], meta) -> dict[str, str]:
    return {**env, "PYTHONPATH": f"{env['PYTHONPATH']}{os.pathsep}{meta}"}


def test_doctor_deep_records_the_stack(tmp_path):
    _root, meta = _stack_tree(tmp_path, {"torch": "2.8.0+xpu", "oneccl": "2021.15.4",
                                         "vllm": "0.32.0"})
    env = _with_meta(standin_env(tmp_path, base_scenario(), pyzes=False), meta)
    _code, data = deep_json(tmp_path, env, "--probe-timeout", "60")
    got = {v["name"]: v for v in data["versions"]}
    assert list(got) == list(NAMES), data["versions"]
    assert got["kernel"]["version"] == "6.8.0-45-generic"
    assert got["xe"]["version"] == "6.8.0-45-generic" and "in-tree" in got["xe"]["source"]
    assert got["level-zero-loader"]["version"] == "1.21.9"
    assert got["level-zero-loader"]["source"] == "/usr/lib/x86_64-linux-gnu/libze_loader.so.1.21.9"
    assert got["level-zero-gpu"]["version"] == "1.6.31294"
    assert (got["torch"]["version"], got["oneccl"]["version"], got["vllm"]["version"]) == (
        "2.8.0+xpu", "2021.15.4", "0.32.0")
    assert got["torch"]["source"] == f"package torch of {sys.executable}"
    assert got["xpu-smi"]["version"] == "1.3.1.20250314"  # the stand-in's --version
    assert got["ipex"]["version"] is None
    assert got["ipex"]["why"] == f"not installed for {sys.executable} (the probe Python)"
    assert got["ray"]["version"] == _installed("ray")  # what this Python has (the Ray tier's)
    for v in data["versions"]:
        assert v["version"] or v["why"], v


def test_each_missing_piece_says_why(tmp_path):
    """No osrelease, no driver module, no libraries, no xpu-smi on PATH."""
    env = standin_env(tmp_path, base_scenario(), pyzes=False, xpusmi=False)
    env["PATH"] = str(tmp_path / "bin")
    _code, data = deep_json(tmp_path, env, "--probe-timeout", "60")
    got = {v["name"]: v for v in data["versions"]}
    assert got["kernel"]["version"] is None and "osrelease" in got["kernel"]["why"]
    assert got["driver"]["why"] == "neither xe nor i915 is loaded (/sys/module)"
    assert "no libze_loader.so.X.Y.Z in /usr/lib/x86_64-linux-gnu" in got["level-zero-loader"]["why"]
    assert got["xpu-smi"]["why"] == "xpu-smi is not on PATH"
    assert all(v["version"] or v["why"] for v in data["versions"])
    result = runner.invoke(app, ["--root", str(tmp_path / "root"), "doctor", "--deep",
                                 "--probe-timeout", "60"], env={**env, "COLUMNS": "400"})
    # the versions line is one paragraph that rich may wrap (its length follows the paths of
    # the machine: the venv's, the temporary root's), so it is read with its lines joined
    shown = " ".join(result.stdout.split())
    assert "versions: kernel ? (" in shown and "xpu-smi ? (xpu-smi is not on PATH)" in shown, \
        result.stdout


def test_without_deep_no_versions_are_read(tmp_path):
    root = tmp_path / "root"
    deep_host(root)
    result = runner.invoke(app, ["--root", str(root), "doctor", "--json"])
    assert json.loads(result.stdout)["versions"] is None


def test_a_snapshot_records_the_stack(tmp_path):
    root, meta = _stack_tree(tmp_path, {"intel-extension-for-pytorch": "2.8.10+xpu"})
    env = _with_meta(standin_env(tmp_path, base_scenario(), pyzes=False), meta)
    out = tmp_path / "snap.tar.gz"
    result = runner.invoke(app, ["--root", str(root), "snapshot", "-o", str(out)], env=env)
    assert result.exit_code == 0, result.output
    with tarfile.open(out) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("/manifest.json"))
        manifest = json.load(io.TextIOWrapper(tf.extractfile(member)))
    got = {v["name"]: v for v in manifest["versions"]}
    assert got["kernel"]["version"] == "6.8.0-45-generic"
    assert got["ipex"]["version"] == "2.8.10+xpu"
    assert got["torch"]["version"] == _installed("torch")  # this Python's own, if any
    assert got["xpu-smi"]["version"] == "1.3.1.20250314"  # `xpu-smi --version`, bounded
    assert got["level-zero-gpu"]["version"] == "1.6.31294"
