"""serve's diagnosis of a start that failed: a oneCCL crash is said as a crash (not "stuck"),
with its cause and what to try; vLLM's shm-broadcast hang is named. Against the fake vLLM,
whose worker rank 0 prints oneCCL's own lines after `backend=xccl` (FAKE_VLLM_ONECCL_LINES).

The lines, and where each was read: oneCCL atl_ofi_helper.cpp's `fi_getinfo error: ret -61`
(this form captured in a public runbook, and seen with real oneCCL over leaked libfabric
regions: xpuctl issue 31), oneCCL internal_kvs.cpp's `kvs_init: connection time (120) >= limit
(120)` (issue 31, real oneCCL after a relaunch on a port in TIME_WAIT), vLLM's
shm_broadcast.py `No available shared memory broadcast block found in 60 seconds` (vLLM #51986).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

ATL = ("2026:06:13-20:51:02 |CCL_ERROR| atl_ofi_helper.cpp:1118 atl_ofi_get_prov_list: "
       "fi_getinfo error: ret -61, providers 0")
KVS = "kvs_init: connection time (120) >= limit (120)"
SHM_BROADCAST = ("(EngineCore pid=2025) INFO 08-13 11:27:02 [shm_broadcast.py:802] No available "
                 "shared memory broadcast block found in 60 seconds. This typically happens when "
                 "some processes are hanging or doing some time-consuming work (e.g. compilation, "
                 "weight/kv cache quantization).")


def test_a_oneccl_crash_with_a_spinning_peer_is_crashed_not_stuck(rig):
    """Rank 0's ATL did not start (its error in the log) while the other rank spins: the
    readiness deadline passes, and the diagnosis says crashed, the cause and the advice."""
    res = rig.serve(name="atl", ready=10, teardown=3,
                    env={"FAKE_VLLM_FAULTS": "hang-startup", "FAKE_VLLM_ONECCL_LINES": ATL})
    assert res.rc == 4, str(res)
    said = [line for line in res.err.splitlines() if "not ready after 10s" in line]
    assert len(said) == 1, str(res)
    assert "crashed in: oneCCL init (xccl)" in said[0] and "stuck" not in said[0], said
    assert "leaked libfabric shared-memory regions" in said[0] and "fi_getinfo" in said[0], said
    assert "room in /dev/shm" in res.err, str(res)
    rig.assert_clean()


def test_the_shm_broadcast_hang_is_named(rig):
    res = rig.serve(name="shm", ready=10, teardown=3,
                    env={"FAKE_VLLM_FAULTS": "hang-startup", "FAKE_VLLM_ONECCL_LINES": SHM_BROADCAST})
    assert res.rc == 4, str(res)
    (said,) = [line for line in res.err.splitlines() if "not ready after 10s" in line]
    assert "stuck in: oneCCL init (xccl)" in said, said
    assert "its log shows vLLM's shm-broadcast hang" in said, said
    assert "find the worker that stopped answering" in res.err, str(res)
    rig.assert_clean()


def test_a_kvs_timeout_that_ends_the_start_names_the_cause(rig):
    """The KVS gave up and the rank exited: vLLM exits before it is ready; serve says it
    crashed, why (a KVS port in TIME_WAIT, or an unreachable master) and what to do."""
    res = rig.serve(name="kvs", ready=60, teardown=3,
                    env={"FAKE_VLLM_FAULTS": "crash-oneccl", "FAKE_VLLM_ONECCL_LINES": KVS})
    assert res.rc not in (0, 4), str(res)
    (said,) = [line for line in res.err.splitlines() if "before it was ready; " in line]
    assert "crashed in: oneCCL init (xccl)" in said, said
    assert "a KVS port in TIME_WAIT after a killed run" in said and KVS in said, said
    assert "unset CCL_KVS_PORT" in res.err, str(res)
    rig.assert_clean()


# oneCCL #212 (vLLM #41663): the hung ranks wait for ever in ze_base_entry::is_event_completed
# after the GPU page fault (gdb's frame, as a rank's log carries it when it prints its stack)
STALE_IPC = ("|CCL_WARN| ze_base_entry::is_event_completed: waiting on an event after a GPU "
             "page fault")


def test_a_hang_whose_log_shows_a_known_issue_names_the_row(rig):
    """The table's row (core/known.py) is named with its range, mitigation and link."""
    res = rig.serve(name="ipc", ready=10, teardown=3,
                    env={"FAKE_VLLM_FAULTS": "hang-startup", "FAKE_VLLM_ONECCL_LINES": STALE_IPC})
    assert res.rc == 4, str(res)
    (said,) = [line for line in res.err.splitlines() if "not ready after 10s" in line]
    assert "stuck in: oneCCL init (xccl)" in said, said
    assert "known issue oneccl-stale-ipc-handle" in said, said
    assert "CCL_ZE_CACHE_OPEN_IPC_HANDLES=0" in said and "oneCCL/issues/212" in said, said
    rig.assert_clean()


def test_the_diagnosis_names_every_row_its_log_shows():
    from xpuctl.serve.failedstart import _start_diagnosis

    _sigs, _keys, said = _start_diagnosis(
        ["xe 0000:03:00.0: [drm] Tile0: GT0: Fault response: Unsuccessful -ENOENT", STALE_IPC],
        "oneCCL init (xccl)", "")
    assert said.startswith("stuck in: oneCCL init (xccl)")
    assert "known issue oneccl-stale-ipc-handle" in said
    assert "known issue guc-70.58-engine-reset" in said and "70.72.1" in said
    _sigs, _keys, said = _start_diagnosis(["all quiet"], "loading model", "")
    assert "known issue" not in said


def test_a_hung_start_on_a_known_bad_version_names_the_row(rig, tmp_path):
    """The run's oneCCL (package metadata on its PYTHONPATH, as pip writes it) is 2022.1.1:
    serve's diagnosis names oneCCL #215's row with its mitigation."""
    meta = tmp_path / "meta" / "oneccl-2022.1.1.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: oneccl\nVersion: 2022.1.1\n")
    res = rig.serve(name="bad", ready=10, teardown=3,
                    env={"FAKE_VLLM_FAULTS": "hang-startup", "PYTHONPATH": str(meta.parent)})
    assert res.rc == 4, str(res)
    rows = [line for line in res.err.splitlines() if "known issue oneccl-2022-allreduce-hang" in line]
    assert rows and "oneCCL 2022.1.1" in rows[0] and "CCL_ALLREDUCE=ring" in rows[0], str(res)
    assert "oneCCL/issues/215" in rows[0]
    rig.assert_clean()
