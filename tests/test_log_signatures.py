"""oneCCL and vLLM failure signatures in a run's log: crashes told from hangs, each quoted in
the last-run finding with advice that fits. Every line below was read in a real log; its
source is beside it (the issue threads that hold them)."""

from __future__ import annotations

import json
import time

import pytest
from test_progress import REAL_0_32, _state_dir, _xpuctl, write_run

from xpuctl.core.checks import last_run_findings
from xpuctl.parse import vllmlog
from xpuctl.state import lastrun

XCCL = REAL_0_32[2].replace("backend=gloo", "backend=xccl")

# key -> (real line, its source)
REAL_LINES = {
    "oneccl-device-fds": [
        # vLLM #14612 (oneCCL's own error line, then vLLM's traceback)
        (("2025:03:13-10:36:27:(  636) |CCL_ERROR| ze_fd_manager.cpp:214 fill_device_fds: "
         "condition fds[dev_idx] > 0 failed"), "vLLM #14612"),
        # issue 22 §4 (the exception vLLM raises)
        (("RuntimeError: oneCCL: ze_fd_manager.cpp:214 fill_device_fds: EXCEPTION: open failed: "
         "fd: -1, errno: No such file or directory"), "xpuctl issue 22"),
        # ipex-llm #12990 (vLLM in docker, tensor parallel)
        (("RuntimeError: oneCCL: ze_fd_manager.cpp:144 init_device_fds: EXCEPTION: opendir failed: "
         "could not open device directory"), "ipex-llm #12990"),
    ],
    "oneccl-workers": [
        ("RuntimeError: oneCCL: exec.cpp:122 start_workers: EXCEPTION: failed to start worker # 0",
         "vLLM #10109"),
    ],
    "segfault": [
        ("!!!!!!! Segfault encountered !!!!!!!", "vLLM #27868"),
        ("(RayWorkerWrapper pid=24036) Fatal Python error: Segmentation fault", "vLLM #6783"),
    ],
    "kvs": [
        # issue 22 §4 quotes it with the line number elided; 529 is a stand-in number
        ("|CCL_ERROR| internal_kvs.cpp:529 kvs_set_value: condition can_use_internal_kvs() failed",
         "xpuctl issue 22"),
    ],
    "shm-broadcast": [
        (("(EngineCore_DP0 pid=323240) INFO 12-09 11:25:53 [shm_broadcast.py:466] No available shared "
         "memory broadcast block found in 60 seconds. This typically happens when some processes "
         "are hanging or doing some time-consuming work (e.g. compilation)."), "vllm-ascend #3717"),
        (("(EngineCore pid=2025) INFO 08-13 11:27:02 [shm_broadcast.py:802] No available shared memory "
         "broadcast block found in 60 seconds. This typically happens when some processes are "
         "hanging or doing some time-consuming work (e.g. compilation, weight/kv cache "
         "quantization)."), "vLLM #51986"),
    ],
    "atl-init": [
        # oneCCL atl_ofi_helper.cpp (LOG_ERROR "fi_getinfo error: ret ", ret, ", providers ",
        # ...); this capture from a public runbook (2026-06), the same line real oneCCL printed
        # here over leaked libfabric regions (xpuctl issue 31)
        (("2026:06:13-20:51:02 |CCL_ERROR| atl_ofi_helper.cpp:1118 atl_ofi_get_prov_list: "
          "fi_getinfo error: ret -61, providers 0"), "oneCCL atl_ofi_helper.cpp; a public runbook"),
        # xpuctl issue 31: what real oneCCL printed next (its words, without the file prefix)
        ("failed to initialize ATL", "xpuctl issue 31 (real oneCCL on CPU)"),
    ],
    "kvs-timeout": [
        # oneCCL internal_kvs.cpp kvs_init: LOG_ERROR("connection time (", connection_time,
        # ") >= limit (", CONNECTION_TIMEOUT, ")"), CONNECTION_TIMEOUT = 120 (internal_kvs.h);
        # xpuctl issue 31 quotes what real oneCCL printed after 120 s against a TIME_WAIT port
        ("kvs_init: connection time (120) >= limit (120)",
         "xpuctl issue 31; oneCCL internal_kvs.cpp"),
    ],
    "oneccl-exception": [
        # ipex-llm's LLM-Finetune README (Troubleshooting): any other oneCCL exception
        (("RuntimeError: oneCCL: comm_selector.cpp:57 create_comm_impl: EXCEPTION: ze_data was "
          "not initialized"), "ipex-llm LLM-Finetune README"),
    ],
}
CASES = [(key, line) for key, lines in REAL_LINES.items() for line, _src in lines]
CRASHES = {"oneccl-device-fds", "oneccl-workers", "segfault", "atl-init", "kvs-timeout",
           "oneccl-exception"}


@pytest.mark.parametrize(("key", "line"), CASES)
def test_each_real_line_is_its_signature(key, line):
    sigs = vllmlog.hang_signatures([REAL_0_32[0], line, "later"], ever_ready=True)
    assert [(s.key, s.line) for s in sigs] == [(key, line)]
    assert (sigs[0].kind == "crash") == (key in CRASHES)


def test_harmless_lines_match_nothing():
    lines = REAL_0_32 + [
        # vLLM #14612: oneCCL's warnings before the crash are not failures
        "2025:03:13-10:36:27:(  636) |CCL_WARN| pidfd is not supported, fallbacks to drmfd exchange mode",
        "(EngineCore pid=2) INFO 12-01 10:00:07 [kv_cache_utils.py:1] GPU KV cache size: 10 tokens",
    ]
    assert vllmlog.hang_signatures(lines, ever_ready=True) == []


def test_a_crash_in_oneccl_init_is_not_stuck():
    line = REAL_LINES["oneccl-device-fds"][1][0]
    sigs = vllmlog.hang_signatures(REAL_0_32[:2] + [XCCL, line], ever_ready=False)
    assert [s.key for s in sigs] == ["oneccl-device-fds"]  # no xccl-stuck
    assert vllmlog.crashed(sigs)
    # without the crash line the same start is stuck after backend=xccl
    assert [s.key for s in vllmlog.hang_signatures(REAL_0_32[:2] + [XCCL], ever_ready=False)] == [
        "xccl-stuck"]


def test_crashes_come_first_whatever_the_log_order():
    kvs = REAL_LINES["kvs"][0][0]
    seg = REAL_LINES["segfault"][0][0]
    assert [s.key for s in vllmlog.hang_signatures([kvs, seg], ever_ready=True)] == ["segfault", "kvs"]


def test_finding_says_crashed_quotes_the_line_and_advises_the_render_nodes(tmp_path):
    sd = _state_dir(tmp_path)
    ccl, _ = REAL_LINES["oneccl-device-fds"][0]
    exc, _ = REAL_LINES["oneccl-device-fds"][1]
    write_run(sd, "crashy", REAL_0_32[:2] + [XCCL, ccl, ("open failed: fd: -1, errno: No such file "
              "or directory"), exc], state="failed")
    (f,) = last_run_findings(lastrun.last_run(str(sd)))
    assert "crashy crashed (in: oneCCL init (xccl))" in f.message
    assert "stuck" not in f.message
    assert ccl[:100] in f.message
    assert f.remedy.startswith("before the next launch, try (advice only; each has a "
                                              "cost): make every render node and /dev/dri/by-path")


@pytest.mark.parametrize(("key", "line"), CASES)
def test_doctor_quotes_each_real_line(tmp_path, key, line):
    sd = _state_dir(tmp_path)
    write_run(sd, f"r-{key}", REAL_0_32[:2] + [XCCL, line], state="failed")
    root = tmp_path / "root"
    for sub in ("proc", "sys/class/drm", "dev/dri"):
        (root / sub).mkdir(parents=True)
    p = _xpuctl("--root", str(root), "doctor", "--json", "--state-dir", str(sd))
    (found,) = [f for f in json.loads(p.stdout)["findings"] if f["check"] == "last-run"]
    assert line[:100] in found["message"], found
    assert ("crashed" in found["message"]) == (key in CRASHES)
    assert "stuck" not in found["message"] or key not in CRASHES


def test_shm_broadcast_after_ready_is_a_hang_finding(tmp_path):
    sd = _state_dir(tmp_path)
    line = REAL_LINES["shm-broadcast"][1][0]
    write_run(sd, "hung", REAL_0_32 + [line], ready_at=time.time() - 50)
    (f,) = last_run_findings(lastrun.last_run(str(sd)))
    assert "a worker that stopped answering its engine" in f.message and "crashed" not in f.message
    assert "find the worker that stopped answering" in f.remedy


@pytest.mark.parametrize(("key", "cause", "advice"), [
    ("atl-init", "leaked libfabric shared-memory regions", "room in /dev/shm"),
    ("kvs-timeout", "a KVS port in TIME_WAIT after a killed run", "unset CCL_KVS_PORT"),
])
def test_atl_and_kvs_lines_name_their_cause_and_what_to_do(tmp_path, key, cause, advice):
    """The last-run finding says crashed, names the cause and what to try (issue 31 §3)."""
    sd = _state_dir(tmp_path)
    line = REAL_LINES[key][0][0]
    write_run(sd, f"r-{key}", REAL_0_32[:2] + [XCCL, line], state="failed")
    (f,) = last_run_findings(lastrun.last_run(str(sd)))
    assert f"r-{key} crashed (in: oneCCL init (xccl))" in f.message, f.message
    assert cause in f.message and "stuck" not in f.message, f.message
    assert advice in f.remedy, f.remedy


def test_a_kvs_timeout_line_is_the_timeout_not_the_general_kvs_error():
    """One line is one signature: the specific one first (kvs_init also matches `kvs`)."""
    line = REAL_LINES["kvs-timeout"][0][0]
    assert [s.key for s in vllmlog.hang_signatures([line], ever_ready=False)] == ["kvs-timeout"]
