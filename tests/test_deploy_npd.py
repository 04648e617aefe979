"""`xpuctl doctor --format npd` and deploy/kubernetes/node-problem-detector.yaml (issue 37 §8).

The contract is node-problem-detector's custom plugin monitor, read in its repository
(github.com/kubernetes/node-problem-detector): node-problem-detector/docs/custom_plugin_monitor.md
(the plugin and rule fields), pkg/custompluginmonitor/types/config.go (`plugin` must be
"custom"; a rule's timeout may not exceed the global one, 5s by default; a permanent rule's
condition needs a default condition; max_output_length defaults to 80) and
pkg/custompluginmonitor/types/types.go (exit status 0 OK, 1 NonOK, anything else Unknown;
a rule has `path` and `args`). The manifest itself is validated with the others
(kubernetes-validate --strict, tests/test_deploy_kubernetes.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import fakehost as fh
import proctools
import pytest
import yaml
from deploytools import DEPLOY, parse_xpuctl

MANIFEST = DEPLOY / "kubernetes" / "node-problem-detector.yaml"
XPUCTL = [sys.executable, "-m", "xpuctl"]
GO_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$")
PLUGIN_KEYS = {"invoke_interval", "timeout", "max_output_length", "concurrency",
               "enable_message_change_based_condition_update", "skip_initial_status"}
RULE_KEYS = {"type", "condition", "reason", "path", "args", "timeout", "invoke_interval"}
TOP_KEYS = {"plugin", "pluginConfig", "source", "conditions", "rules", "metricsReporting"}


def seconds(duration: str) -> float:
    units = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, _, u in re.findall(r"([0-9]+(\.[0-9]+)?)(ns|us|ms|s|m|h)",
                                                             duration))


def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def one(kind: str) -> dict:
    (found,) = [d for d in docs() if d["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def monitor() -> dict:
    return json.loads(one("ConfigMap")["data"]["xpuctl-monitor.json"])


@pytest.fixture(scope="module")
def rule(monitor) -> dict:
    (r,) = monitor["rules"]
    return r


# -- the plugin config, by NPD's own validation -----------------------------------------------

def test_the_monitor_config_is_what_npd_accepts(monitor, rule):
    assert set(monitor) <= TOP_KEYS and monitor["plugin"] == "custom"
    plugin = monitor["pluginConfig"]
    assert set(plugin) <= PLUGIN_KEYS
    assert plugin["max_output_length"] == 80
    for key in ("invoke_interval", "timeout"):
        assert GO_DURATION.match(plugin[key]), plugin[key]
    assert set(rule) <= RULE_KEYS and rule["type"] == "permanent"
    assert GO_DURATION.match(rule["timeout"])
    assert seconds(rule["timeout"]) <= seconds(plugin["timeout"])  # else NPD refuses to start
    assert rule["condition"] in {c["type"] for c in monitor["conditions"]}
    assert rule["reason"] and all(c["reason"] and c["message"] for c in monitor["conditions"])


def test_the_rule_runs_doctor_npd_and_nothing_slow(rule):
    command, params = parse_xpuctl(rule["args"])
    assert command == "doctor" and params["fmt"] == "npd"
    assert not params["deep"] and not params["collective"] and params["ray"] is None
    assert rule["path"].endswith("/xpuctl")


def test_the_daemonset_runs_npd_on_that_config_with_the_host_in_view(rule):
    spec = one("DaemonSet")["spec"]["template"]["spec"]
    assert spec["hostPID"] and spec["hostNetwork"]
    (c,) = spec["containers"]
    flag = next(a for a in c["command"] if a.startswith("--config.custom-plugin-monitor="))
    path = Path(flag.split("=", 1)[1])
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    cfg = next(n for n, m in mounts.items() if Path(m["mountPath"]) == path.parent)
    items = {i["path"]: i["key"] for i in vols[cfg]["configMap"]["items"]}
    assert vols[cfg]["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    assert items[path.name] == "xpuctl-monitor.json"
    root = rule["args"][rule["args"].index("--root") + 1]
    host = next(n for n, m in mounts.items() if m["mountPath"] == root)
    assert mounts[host]["readOnly"] and vols[host]["hostPath"]["path"] == "/"
    assert spec["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
    verbs = {(r["resources"][0], v) for r in one("ClusterRole")["rules"] for v in r["verbs"]}
    assert {("nodes/status", "patch"), ("events", "create")} <= verbs


# -- the rule, run as NPD runs it, on fake hosts ----------------------------------------------

def run_rule(rule: dict, root: Path, tmp: Path, token: str, *extra: str
             ) -> tuple[int, bytes, float]:
    """The rule's command with the fake host for /host; (exit, stdout bytes, seconds)."""
    args = [str(root) if a == "/host" else a for a in rule["args"]]
    env = proctools.token_env(token, XPUCTL_STATE_DIR=str(tmp / "state"))
    t0 = time.monotonic()
    p = subprocess.run([*XPUCTL, *extra, *args], env=env, capture_output=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert b"Traceback" not in p.stderr
    return p.returncode, p.stdout, time.monotonic() - t0


def assert_one_line(out: bytes, limit: int) -> str:
    assert len(out) <= limit and out.endswith(b"\n") and out.count(b"\n") == 1, out
    text = out.decode("ascii")
    assert text.isprintable() or text[:-1].isprintable()
    return text


def test_clean_host_is_ok_in_one_short_line_within_the_rule_timeout(rule, monitor, tmp_path,
                                                                     proc_token):
    fh.clean_host(tmp_path / "h")
    code, out, took = run_rule(rule, tmp_path / "h", tmp_path, proc_token)
    text = assert_one_line(out, monitor["pluginConfig"]["max_output_length"])
    assert code == 0 and text == "xpuctl: ok: 2 Intel GPU(s), clean, nothing failing\n", text
    # NPD kills a plugin at the rule's timeout: that is the contract, not a benchmark
    assert took < seconds(rule["timeout"]), took


def test_a_failing_finding_is_nonok_with_the_reason_cut_to_80_bytes(rule, monitor, tmp_path,
                                                                    proc_token):
    fh.orphan_host(tmp_path / "h")
    code, out, _ = run_rule(rule, tmp_path / "h", tmp_path, proc_token)
    text = assert_one_line(out, monitor["pluginConfig"]["max_output_length"])
    assert code == 1 and re.match(r"xpuctl: \d+ failing; [a-z-]+: ", text), text
    assert len(out) == 80 and text.rstrip().endswith("..."), text  # its message is longer


def test_a_read_that_does_not_answer_is_unknown(rule, monitor, tmp_path, proc_token):
    h = fh.clean_host(tmp_path / "h")
    h.block("/sys/class/drm/renderD128/device/vendor")
    code, out, _ = run_rule(rule, tmp_path / "h", tmp_path, proc_token, "--read-timeout", "0.5")
    text = assert_one_line(out, monitor["pluginConfig"]["max_output_length"])
    assert code == 8 and text.startswith("xpuctl: could not tell: "), (code, text)
    assert proctools.wait_for(lambda: not proctools.pids_with_token(proc_token), 10)


@pytest.mark.parametrize("slow", ["--collective", "--deep", "--wait-clean=5"])
def test_npd_never_runs_anything_slow(slow, tmp_path, proc_token):
    fh.clean_host(tmp_path / "h")
    env = proctools.token_env(proc_token, XPUCTL_STATE_DIR=str(tmp_path / "state"))
    p = subprocess.run([*XPUCTL, "--root", str(tmp_path / "h"), "doctor", "--format", "npd",
                        slow], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--format npd" in p.stderr, p.stderr  # Unknown to NPD


def test_strict_makes_a_warning_fail_and_json_disagrees(tmp_path, proc_token):
    h = fh.clean_host(tmp_path / "h")
    h.block("/sys/class/drm/renderD128/device/vendor")  # blocked-reads: a warning
    env = proctools.token_env(proc_token, XPUCTL_STATE_DIR=str(tmp_path / "state"))
    base = [*XPUCTL, "--root", str(h.root), "--read-timeout", "0.5", "doctor", "--format", "npd"]
    p = subprocess.run([*base, "--strict"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout.startswith("xpuctl: 1 failing; blocked-reads: ")
    p = subprocess.run([*base, "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "disagree" in p.stderr


def test_host_text_in_the_line_stays_one_printable_ascii_line():
    from xpuctl.output import npd

    for reason in ("\x1b[31mred\x1b[0m\nsecond line", "é→" * 60, "x" * 500, ""):
        line = npd.unknown_line(reason) + "\n"
        assert_one_line(line.encode("ascii"), npd.LIMIT)
