"""The environment vLLM gets from `xpuctl serve`: vLLM's own teardown clock and Level Zero's
device order, read back from /proc/<pid>/environ of the fake vLLM's processes.

Sources: vLLM 0.32 `v1/executor/multiproc_executor.py` (and the core client's
BackgroundResources) wait VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (an int, default 5) for the
workers, then SIGTERM, 4 s, SIGKILL (the variable came with vLLM #43154); Level Zero numbers
devices in driver order unless ZE_ENABLE_PCI_ID_DEVICE_ORDER=1, and ZE_AFFINITY_MASK indices
follow that order (docs/intel.md).
"""

from __future__ import annotations

import pytest
from proctools import cmdline
from serverig import proc_env

from xpuctl.serve.budget import worker_shutdown_timeout

WORKER_VAR = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
ORDER_VAR = "ZE_ENABLE_PCI_ID_DEVICE_ORDER"


@pytest.mark.parametrize(("teardown", "expected"), [
    (20.0, 15),  # serve's default budget
    (9.0, 4),
    (5.5, 1),  # 0.5 left: never below 1
    (2.0, 1),
    (0.0, 1),
    (30.9, 25),  # whole seconds, rounded down: the ladder stays inside the budget
])
def test_worker_timeout_leaves_vllms_ladder_room(teardown, expected):
    assert worker_shutdown_timeout(teardown) == expected
    # the wait, vLLM's 4 s SIGTERM grace and a second for EngineCore fit the budget
    assert expected == 1 or expected + 4 + 1 <= teardown


def _vllm_envs(rig, name: str) -> list[dict[str, str]]:
    """The environment of the API server, EngineCore and every worker of a run."""
    api = rig.record(name)["pid"]
    core, workers = rig.tree(api)
    assert cmdline(core)[0] == "VLLM::EngineCore" and len(workers) == 2
    return [proc_env(pid) for pid in (api, core, *workers)]


def _stop(rig, name: str) -> None:
    res = rig.shutdown(name, "--kill-after", "1", "--release-timeout", "5")
    assert res.rc == 0, str(res)
    rig.assert_clean()


@pytest.mark.slow
@pytest.mark.parametrize(("teardown", "expected"), [(None, "15"), (9, "4")],
                         ids=["default-budget", "teardown-9"])
def test_vllm_gets_the_worker_timeout_and_pci_order(rig, teardown, expected):
    """Without --teardown-timeout the default 20 s budget gives 15; --teardown-timeout 9 gives
    4. --devices sets ZE_AFFINITY_MASK beside ZE_ENABLE_PCI_ID_DEVICE_ORDER=1. Nothing to say."""
    res = rig.serve(name="env", teardown=teardown, opts=["--devices", "1"])
    assert res.rc == 0, str(res)
    for env in _vllm_envs(rig, "env"):
        assert env.get(WORKER_VAR) == expected, env
        assert env.get("ZE_AFFINITY_MASK") == "1" and env.get(ORDER_VAR) == "1", env
    assert "note:" not in res.err, str(res)
    assert rig.record("env")["notes"] == []
    _stop(rig, "env")


@pytest.mark.slow
def test_the_users_values_are_kept_and_said(rig):
    """A worker timeout exported by the user stays, with one line when it outruns the budget;
    a PCI order of 0 stays, with one line (serve's indices are in PCI order)."""
    res = rig.serve(name="mine", teardown=9, opts=["--devices", "1"],
                    env={WORKER_VAR: "60", ORDER_VAR: "0"})
    assert res.rc == 0, str(res)
    for env in _vllm_envs(rig, "mine"):
        assert env.get(WORKER_VAR) == "60" and env.get(ORDER_VAR) == "0", env
    notes = [line for line in res.err.splitlines() if line.startswith("xpuctl: note: ")]
    timeout_notes = [n for n in notes if WORKER_VAR in n]
    order_notes = [n for n in notes if ORDER_VAR in n]
    assert len(timeout_notes) == 1 and len(order_notes) == 1, str(res)
    assert f"{WORKER_VAR}=60 kept (yours)" in timeout_notes[0]
    assert "budget of 9s (serve would pass 4)" in timeout_notes[0]
    assert f"{ORDER_VAR}=0 kept (yours)" in order_notes[0]
    assert "ZE_AFFINITY_MASK=1" in order_notes[0]
    _stop(rig, "mine")


@pytest.mark.slow
def test_a_users_timeout_within_the_budget_is_kept_quietly(rig):
    """--env VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=3 fits a 9 s budget: kept, nothing said;
    without --devices serve sets no mask, and no order either."""
    res = rig.serve(name="quiet", teardown=9, opts=["--env", f"{WORKER_VAR}=3"])
    assert res.rc == 0, str(res)
    for env in _vllm_envs(rig, "quiet"):
        assert env.get(WORKER_VAR) == "3", env
        assert "ZE_AFFINITY_MASK" not in env and ORDER_VAR not in env, env
    assert "note:" not in res.err, str(res)
    _stop(rig, "quiet")
