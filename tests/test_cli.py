"""CLI wiring: entry points, exit codes, one-line errors, JSON/Prometheus, imports, completions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fakehost
import pytest
from typer.testing import CliRunner

from xpuctl import __version__
from xpuctl.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
XPUCTL = Path(sys.executable).with_name("xpuctl")


def run(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "xpuctl", *args], capture_output=True, text=True,
                          env=full, timeout=60, **kw)


def test_version_module_and_console_script():
    assert run("--version").stdout.strip() == f"xpuctl {__version__}"
    if XPUCTL.exists():
        out = subprocess.run([str(XPUCTL), "--version"], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == f"xpuctl {__version__}"


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["doctor", "--device", "7"], 2, "unknown device '7'; devices here: 0=0000:03:00.0"),
        (["doctor", "--device", "0000:99:00.0"], 2, "unknown device"),
        (["ps", "--device", "renderD200"], 2, "unknown device"),
        (["doctor", "--json", "--format", "table"], 2, "--json and --format disagree"),
        (["shutdown"], 2, "say which server to stop"),
        (["serve", "m"], 2, "serve needs the live /proc"),
    ],
)
def test_usage_errors_are_one_line(tmp_path, args, code, needle):
    h = fakehost.clean_host(tmp_path / "root")
    out = run("--root", str(h.root), *args, env={"XPUCTL_STATE_DIR": str(tmp_path / "state")})
    assert out.returncode == code, out.stderr
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr


def test_bad_root_is_a_usage_error(tmp_path):
    out = run("--root", str(tmp_path / "missing"), "doctor")
    assert out.returncode == 2
    assert out.stderr.strip() == f"xpuctl: error: --root {tmp_path / 'missing'}: not a directory"


def test_serve_options_after_the_model_are_refused(tmp_path):
    h = fakehost.clean_host(tmp_path / "root")
    out = run("--root", str(h.root), "serve", "model", "--port", "9000", "--detach")
    assert out.returncode == 2
    assert out.stderr.startswith("xpuctl: error: --detach comes after MODEL, where everything goes "
                                 "to vLLM; it is an xpuctl option: put it before MODEL"), out.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["nosuch"], "no such command 'nosuch' (see 'xpuctl -h')"),
        (["doctor", "--bogus"], "no such option: --bogus (see 'xpuctl doctor -h')"),
        (["doctor", "--port", "0"], "'--port' / '-p': 0 is not in the range 1<=x<=65535"),
        (["doctor", "--format", "yaml"], "invalid value for '--format' / '-f'"),
        (["shutdown", "--pid", "x"], "invalid value for '--pid': 'x' is not a valid int"),
        (["serve"], "missing argument 'MODEL' (see 'xpuctl serve -h')"),
        (["logs"], "missing argument 'NAME'"),
        (["logs", "x", "-n", "-3"], "invalid value for '--lines' / '-n'"),
        (["completion", "tcsh"], "'tcsh' is not one of 'bash', 'zsh', 'fish'"),
        (["--root"], "option '--root' requires an argument"),
        (["serve", "--tensor-parallel-size", "2", "m"],
         "--tensor-parallel-size is not an xpuctl serve option: vLLM's options go after MODEL"),
        (["serve", "--port", "8000", "m", "--port", "9000"],
         "--port 8000 before MODEL and --port 9000 after it disagree: give it once"),
        (["serve", "--port", "99999", "m"], "'--port': 99999 is not in the range"),
    ],
)
def test_click_usage_errors_are_one_line_without_a_box(tmp_path, args, needle):
    """Through the real entry point (a subprocess): one line on stderr, exit 2, no panel."""
    # serve reaches its own checks: a live root
    root = ["--root", "/"] if args[0] == "serve" and "--port" in args else []
    out = run(*root, *args, env={"XPUCTL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "80"})
    assert out.returncode == 2, out
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("xpuctl: error: ") and needle in lines[0], lines[0]
    assert out.stdout == ""
    assert not any(ch in out.stderr for ch in "╭│╰"), out.stderr


def test_console_script_usage_error_is_one_line():
    if not XPUCTL.exists():
        pytest.skip("console script not installed in this interpreter's bin")
    out = subprocess.run([str(XPUCTL), "doctor", "--nope"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr == "xpuctl: error: no such option: --nope (see 'xpuctl doctor -h')\n"


def test_bare_xpuctl_still_shows_the_help():
    out = run()
    assert out.returncode == 2
    assert "Usage: xpuctl" in out.stdout + out.stderr and "doctor" in out.stdout + out.stderr


def test_findings_wrap_with_a_hanging_indent():
    from rich.console import Console

    from xpuctl.core.model import Finding
    from xpuctl.output.tables import findings_table

    long = "the quick brown fox jumps over the lazy dog " * 4
    findings = [Finding("stuck-processes", "fail", long.strip(), "run the thing " * 6),
                Finding("ports", "warn", "short\x1b[31mred", None)]
    console = Console(width=60, record=True, color_system=None)
    console.print(findings_table(findings))
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    indent = lines[0].index("the quick")
    assert lines[0].startswith("  FAIL stuck-processes")
    cont = lines[1:lines.index(next(line for line in lines if "fix:" in line))]
    assert len(cont) >= 2  # the message wrapped
    for line in cont:  # under the message, never under the severity
        assert line[:indent].strip() == "" and line[indent] != " ", line
    fix = next(line for line in lines if "fix:" in line)
    assert fix.index("fix:") == indent
    fix_cont = lines[lines.index(fix) + 1]
    assert fix_cont[:indent].strip() == "" and "run the thing" in fix_cont
    words = " ".join(line[indent:] for line in [lines[0], *cont]).split()
    assert words == long.split()
    assert any("short\\x1b[31mred" in line for line in lines)  # host text escaped, no markup


def test_internal_error_is_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch):
    import xpuctl.host.scan

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(xpuctl.host.scan, "take_scan", boom)
    h = fakehost.clean_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "devices"])
    assert res.exit_code == 70
    assert "internal error: RuntimeError: kaboom (run with --debug" in res.stderr
    res = runner.invoke(app, ["--root", str(h.root), "--debug", "devices"])
    assert isinstance(res.exception, RuntimeError)


def test_doctor_exit_codes_strict_and_wait_clean(tmp_path):
    clean = fakehost.clean_host(tmp_path / "clean")
    dirty = fakehost.orphan_host(tmp_path / "dirty")
    assert runner.invoke(app, ["--root", str(clean.root), "doctor"]).exit_code == 0
    res = runner.invoke(app, ["--root", str(dirty.root), "doctor", "--wait-clean", "0.3", "--json"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["status"] == "dirty"
    # healthy host: a live server is busy (info), exit 0; --expect-idle turns it into failures
    healthy = fakehost.healthy_host(tmp_path / "healthy")
    res = runner.invoke(app, ["--root", str(healthy.root), "doctor", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["status"] == "busy"
    res = runner.invoke(app, ["--root", str(healthy.root), "doctor", "--json", "--expect-idle"])
    assert res.exit_code == 1
    checks = {f["check"] for f in json.loads(res.stdout)["findings"] if f["severity"] == "fail"}
    assert {"device-holders", "ports"} <= checks


def test_strict_turns_warnings_into_failure(tmp_path):
    h = fakehost.clean_host(tmp_path / "root")
    h.add_file("/dev/shm/psm_leftover", uid=0, size=4096)
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json"])
    data = json.loads(res.stdout)
    assert res.exit_code == 0
    assert [f["check"] for f in data["findings"] if f["severity"] == "warn"] == ["stale-shm"]
    assert runner.invoke(app, ["--root", str(h.root), "doctor", "--strict"]).exit_code == 1


@pytest.mark.parametrize(
    "var, value",
    [
        ("ZE_AFFINITY_MASK", "0,,1"),
        ("ZE_AFFINITY_MASK", "gpu0"),
        ("ZE_AFFINITY_MASK", "5"),
        ("ONEAPI_DEVICE_SELECTOR", "level_zero"),
        ("ZE_FLAT_DEVICE_HIERARCHY", "flat"),
    ],
)
def test_env_check_flags_malformed_selection(tmp_path, var, value):
    h = fakehost.clean_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json"], env={var: value})
    data = json.loads(res.stdout)
    env = [f for f in data["findings"] if f["check"] == "env"]
    assert res.exit_code == 1 and env and env[0]["severity"] == "fail"
    assert var in env[0]["message"]


@pytest.mark.parametrize(
    "var, value",
    [("ZE_AFFINITY_MASK", "0,1"), ("ZE_AFFINITY_MASK", "0.0,1.1"),
     ("ONEAPI_DEVICE_SELECTOR", "level_zero:0,1"), ("ZE_FLAT_DEVICE_HIERARCHY", "FLAT")],
)
def test_env_check_accepts_valid_selection(tmp_path, var, value):
    h = fakehost.clean_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json"], env={var: value})
    assert not [f for f in json.loads(res.stdout)["findings"] if f["check"] == "env"]


def _check_types(record: dict, spec: dict) -> None:
    for key, types in spec.items():
        assert key in record, key
        assert isinstance(record[key], types), (key, record[key])


def test_json_contract_types(tmp_path):
    """Every documented field exists with its type; unknowns are null, never magic strings."""
    h = fakehost.orphan_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--json"])
    data = json.loads(res.stdout)
    opt_int = (int, type(None))
    assert data["schema"] == "xpuctl.doctor/1"
    assert data["status"] in ("clean", "busy", "dirty")
    for d in data["devices"]:
        _check_types(d, {"bdf": str, "render_node": (str, type(None)), "driver": (str, type(None)),
                         "vendor_id": (str, type(None)), "device_id": (str, type(None)),
                         "memory_used_bytes": opt_int, "memory_total_bytes": opt_int, "holders": list,
                         "index": opt_int})
    for p in data["processes"]:
        _check_types(p, {"pid": int, "ppid": int, "state": str, "cmdline": str, "role": (str, type(None)),
                         "orphan": bool, "devices": list, "memory_bytes": opt_int,
                         "run_id": (str, type(None))})
    for a in data["artifacts"]:
        _check_types(a, {"path": str, "kind": str, "stale": bool, "open_by": list, "owner_uid": int,
                         "size_bytes": int})
        assert a["path"].startswith(("/dev/shm/", "/tmp/")) and str(h.root) not in a["path"]
    for p in data["ports"]:
        _check_types(p, {"port": int, "pid": opt_int, "state": str})
    for f in data["findings"]:
        _check_types(f, {"check": str, "severity": str, "device": (str, type(None)), "pids": list,
                         "paths": list, "message": str, "remedy": (str, type(None))})
        assert f["severity"] in ("info", "warn", "fail")


def test_prometheus_output(tmp_path):
    h = fakehost.orphan_host(tmp_path / "root")
    res = runner.invoke(app, ["--root", str(h.root), "doctor", "--format", "prometheus"])
    assert res.exit_code == 1
    text = res.stdout
    assert text.endswith("\n")
    assert 'xpuctl_doctor_check_ok{check="orphans"} 0' in text
    assert 'xpuctl_doctor_status{status="dirty"} 1' in text
    assert 'xpuctl_device_orphan_processes{device="0000:03:00.0"}' in text
    for line in text.splitlines():
        assert line.startswith(("#", "xpuctl_")), line
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


BANNED = ("torch", "intel_extension_for_pytorch", "pyzes", "vllm", "ray")


# the deep probe modules import the GPU stacks: only their child processes may load them
PROBE_MODULES = ("xpuctl.probes.children.sysman", "xpuctl.probes.children.torch_xpu", "xpuctl.probes.children.kmd")


@pytest.mark.parametrize(
    "args",
    [["--version"], ["doctor", "--json"], ["doctor"], ["ps", "--json"], ["devices", "--json"],
     ["shutdown", "--all", "--dry-run"], ["reset", "--dry-run"], ["completion", "bash"],
     ["doctor", "--deep", "--json"], ["devices", "--deep", "--record-baseline"],
     ["doctor", "--deep", "--format", "prometheus"], ["doctor", "--ray", "127.0.0.1:1", "--json"],
     ["ps", "--ray"], ["devices", "--ray", "127.0.0.1:1"]],
)
def test_no_command_imports_gpu_libraries(tmp_path, args):
    """Trap modules named like the GPU stacks: importing one leaves a marker file named by the
    importing pid. With --deep the probe children import them (that is their job); the CLI
    process never does."""
    trap = tmp_path / "trap"
    for name in BANNED:
        pkg = trap / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(
            "import os\n"
            f"open({str(tmp_path)!r} + '/imported-{name}-' + str(os.getpid()), 'w').close()\n"
        )
    h = fakehost.healthy_host(tmp_path / "root")
    # the modules are printed by an exit handler: the CLI leaves through os._exit once the
    # exit handlers ran (cli.leave), so nothing after run_module would run
    code = (
        "import atexit, os, sys, runpy\n"
        "print(os.getpid())\n"
        f"atexit.register(lambda: print(sorted(m for m in sys.modules if m.split('.')[0] in {BANNED!r} "
        f"or m in {PROBE_MODULES!r})))\n"
        f"sys.argv = ['xpuctl', '--root', {str(h.root)!r}, *{args!r}]\n"
        "runpy.run_module('xpuctl', run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{trap}{os.pathsep}{REPO}", "XPUCTL_STATE_DIR": str(tmp_path / "s")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "[]", out.stdout + out.stderr
    cli_pid = lines[0]
    assert not list(tmp_path.glob(f"imported-*-{cli_pid}"))
    if "--deep" in args:  # the probes did run, in other processes, and met the traps
        assert list(tmp_path.glob("imported-torch-*")) and list(tmp_path.glob("imported-pyzes-*"))
    elif "--ray" in args:  # the Ray child met the trap (and reported no ray: exit 6)
        assert [p.name for p in tmp_path.glob("imported-*")] == [
            p.name for p in tmp_path.glob("imported-ray-*")]
        assert list(tmp_path.glob("imported-ray-*")) and "XPUCTL_RAY_PYTHON" in out.stderr
    else:
        assert not list(tmp_path.glob("imported-*"))


@pytest.mark.parametrize("shell, filename", [("bash", "xpuctl.bash"), ("zsh", "_xpuctl"), ("fish", "xpuctl.fish")])
def test_committed_completions_match_the_program(shell, filename):
    out = run("completion", shell)
    assert out.returncode == 0
    assert (REPO / "completions" / filename).read_text() == out.stdout
    if shell == "bash":
        # typer's protocol (Click-7 order); Click-8 order silently completes nothing
        assert "_XPUCTL_COMPLETE=complete_bash" in out.stdout


def test_completion_request_answers_commands_and_devices(tmp_path):
    h = fakehost.clean_host(tmp_path / "root")
    base = {"_XPUCTL_COMPLETE": "complete_bash"}
    out = run(env={**base, "COMP_WORDS": "xpuctl do", "COMP_CWORD": "1"})
    assert out.stdout.split() == ["doctor"]
    out = run(env={**base, "COMP_WORDS": f"xpuctl --root {h.root} doctor --device 0000:04",
                   "COMP_CWORD": "5"})
    assert out.stdout.split() == ["0000:04:00.0"]


def test_every_command_is_tested():
    """Meta-test: each registered command name appears in some test file."""
    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    text = "".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    missing = [n for n in names if f'"{n}"' not in text]
    assert not missing, missing
