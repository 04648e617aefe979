"""Known issues, one table (issue 37 §2): core/known.py, docs/known-issues.md made from it,
doctor --deep's `known-issues` warnings, serve's diagnosis naming a row.

Sources of the rows (each row carries its links): oneCCL #215 (2022.0.0 and 2022.1.1 hang in
the default allreduce on multi-GPU Arc Pro B60; 2021.17.2 works; CCL_ALLREDUCE=ring avoids
it) with vLLM #50545; oneCCL #212 (a stale cached opened IPC handle: GPU page fault, then an
endless wait in ze_base_entry::is_event_completed; seen on 2021.17.2;
CCL_ZE_CACHE_OPEN_IPC_HANDLES=0) with vLLM #41663; vLLM #55425 (GuC 70.58.0 faults, 70.72.1
does not) and compute-runtime #948 (70.58.0 → 70.65.0 ended the faults on a B580).

The GuC version lines: xe `Using GuC firmware from xe/bmg_guc_70.bin version 70.44.1` and i915
`GT0: GuC firmware i915/tgl_guc_70.bin version 70.29.2` (compute-runtime #809's dmesg);
debugfs guc_info as Linux drivers/gpu/drm/xe/xe_uc_fw.c xe_uc_fw_print prints it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fakehost import BDF0, BDF1
from hypothesis import given, settings
from hypothesis import strategies as st
from test_deep import base_scenario, deep_json, standin_env
from test_versions import _stack_tree, _with_meta

from xpuctl.core import known
from xpuctl.core.model import Version
from xpuctl.parse.versions import guc_info_version, guc_log_versions

DOC = Path(__file__).resolve().parent.parent / "docs" / "known-issues.md"

GUC_INFO = """GuC firmware: xe/bmg_guc_70.bin
\tstatus: RUNNING
\tversion: wanted 70.44.1, found 70.58.0
\tuAPI version: wanted 1.0.0, found 1.0.0
"""
GUC_INFO_NEWER = """GuC firmware: xe/bmg_guc_70.bin
\tstatus: RUNNING
\trelease version: wanted 70.44.1, found 70.72.1
\tcompatibility version: wanted 1.19.0, found 1.21.0
"""
XE_LOADED = "xe {bdf}: [drm] Using GuC firmware from xe/bmg_guc_70.bin version {v}"
I915_LOADED = "i915 0000:00:02.0: [drm] GT0: GuC firmware i915/tgl_guc_70.bin version 70.29.2"


def test_the_doc_is_made_from_the_table():
    assert DOC.read_text() == known.markdown(), (
        "write it again: python -c 'import sys, xpuctl.core.known as k; "
        "sys.stdout.write(k.markdown())' > docs/known-issues.md")


def test_every_row_has_a_link_a_range_a_symptom_and_a_mitigation():
    keys = [k.key for k in known.KNOWN]
    assert len(set(keys)) == len(keys)
    for k in known.KNOWN:
        assert k.links and all(re.match(r"^https://github\.com/[^/]+/[^/]+/(issues|pull)/\d+$", u)
                               for u in k.links), k.key
        assert k.first or k.last or k.fixed, k.key
        assert k.symptom and k.mitigation and k.component in known.COMPONENTS, k.key
        assert k.key in DOC.read_text() and k.links[0] in DOC.read_text()


@pytest.mark.parametrize(("name", "version", "keys"), [
    ("oneccl", "2022.0.0", {"oneccl-2022-allreduce-hang", "oneccl-stale-ipc-handle"}),
    ("oneccl", "2022.1.1", {"oneccl-2022-allreduce-hang", "oneccl-stale-ipc-handle"}),
    ("oneccl", "2021.17.2", {"oneccl-stale-ipc-handle"}),
    ("oneccl", "2021.15.4", set()),
    ("guc", "70.58.0", {"guc-70.58-engine-reset"}),
    ("guc", "70.72.1", set()),
    ("guc", "70.44.1", set()),
    ("oneccl", None, set()),
    ("oneccl", "garbage", set()),
])
def test_versions_against_the_ranges(name, version, keys):
    got = known.by_version([Version(name, version, "somewhere")])
    assert {m.issue.key for m in got} == keys


def test_guc_parsers():
    assert guc_info_version(GUC_INFO) == "70.58.0"
    assert guc_info_version(GUC_INFO_NEWER) == "70.72.1"
    assert guc_info_version("HuC firmware: xe/bmg_huc.bin\n\tversion: wanted 8, found 8.1.2") is None
    lines = [XE_LOADED.format(bdf=BDF0, v="70.58.0"), I915_LOADED, "xe: something else"]
    assert guc_log_versions(lines) == [(BDF0, "70.58.0"), ("0000:00:02.0", "70.29.2")]


def test_the_signs_of_a_log_name_the_rows():
    rows = known.by_signs(["... Fault response: Unsuccessful -ENOENT", "all fine"])
    assert [k.key for k in rows] == ["guc-70.58-engine-reset"]
    said = known.named(rows[0])
    assert "70.58.0" in said and "https://github.com/vllm-project/vllm/issues/55425" in said


def _doctor_deep(tmp_path, oneccl: str, kmsg: str = "", debugfs: dict[str, str] | None = None):
    root, meta = _stack_tree(tmp_path, {"oneccl": oneccl})
    if kmsg:
        (root / "dev").mkdir(exist_ok=True)
        (root / "dev/kmsg").write_text(kmsg)
    for name, text in (debugfs or {}).items():
        path = root / "sys/kernel/debug/dri" / name / "gt0/uc/guc_info"
        path.parent.mkdir(parents=True)
        path.write_text(text)
    env = _with_meta(standin_env(tmp_path, base_scenario(), pyzes=False), meta)
    return deep_json(tmp_path, env, "--probe-timeout", "60")


def test_doctor_deep_warns_with_the_mitigation(tmp_path):
    kmsg = "".join(f"6,{n},{n * 1000000},-;{XE_LOADED.format(bdf=bdf, v='70.58.0')}\n"
                   for n, bdf in enumerate((BDF0, BDF1), 1))
    _code, data = _doctor_deep(tmp_path, "2022.1.1", kmsg=kmsg)
    guc = [v for v in data["versions"] if v["name"] == "guc"]
    assert [(v["version"], v["source"]) for v in guc] == [
        ("70.58.0", f"{BDF0} (the kernel log), {BDF1} (the kernel log)")]
    found = [f for f in data["findings"] if f["check"] == "known-issues"]
    # the open-ended row (no fixed oneCCL known: it holds for every current release) is info,
    # the ranged rows warn
    severity = {k: f["severity"] for f in found for k in known.KNOWN if k.key in f["message"]}
    assert severity == {known.ONECCL_ALLREDUCE: "warn", known.GUC_70_58: "warn",
                        known.ONECCL_IPC_CACHE: "info"}, severity
    text = json.dumps(found)
    for want in ("oneccl-2022-allreduce-hang", "CCL_ALLREDUCE=ring", "oneCCL/issues/215",
                 "guc-70.58-engine-reset", "vllm/issues/55425", "oneccl-stale-ipc-handle",
                 "CCL_ZE_CACHE_OPEN_IPC_HANDLES=0"):
        assert want in text, want


def test_doctor_deep_reads_guc_from_debugfs_first_and_a_good_stack_is_quiet(tmp_path):
    kmsg = f"6,1,1000000,-;{XE_LOADED.format(bdf=BDF0, v='70.58.0')}\n"
    _code, data = _doctor_deep(tmp_path, "2021.15.4", kmsg=kmsg,
                               debugfs={BDF0: GUC_INFO_NEWER, "1": GUC_INFO_NEWER})
    guc = {v["version"]: v["source"] for v in data["versions"] if v["name"] == "guc"}
    assert list(guc) == ["70.72.1"] and "/sys/kernel/debug/dri/" in guc["70.72.1"]
    assert [f for f in data["findings"] if f["check"] == "known-issues"] == []


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=60), st.from_regex(r"\A\d{1,5}(\.\d{1,5}){0,6}[+a-z]*\Z")))
def test_version_keys_never_raise_and_order_like_numbers(text):
    key = known.version_key(text)
    assert key is None or (len(key) == 6 and all(isinstance(n, int) for n in key))
    for k in known.KNOWN:
        assert k.matches(text) in (True, False)


def test_version_keys_order():
    assert known.version_key("2022.1.1") > known.version_key("2022.1")
    assert known.version_key("2021.17.2+xpu") == known.version_key("2021.17.2")
    assert known.version_key("70.58.0") < known.version_key("70.65.0") < known.version_key("70.72.1")
