"""Issue 12 on real vLLM (CPU build): `xpuctl serve --detach`, its stderr read as a script
reads it (a file, not a terminal), names the start-up phases as they happen, in order, the
model-loading and engine phases before "ready".

No speed assertion: the seconds are recorded in the tier's timings, never compared with a
constant (the tier's rules for slower machines).
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.vllm

# vLLM 0.32.0 on CPU: EngineCore configures, gloo (XPU: xccl) initialises, the model loads,
# memory is profiled and the KV cache made, then the API server starts.
ENGINE_AND_LOADING = ["engine start", "loading model", "KV cache + warm-up"]


def test_serve_detach_names_the_start_phases_in_order(xpuctl_serve, vllm_timings, request):
    run = xpuctl_serve()
    sr = run.serve_result
    assert sr is not None and sr.rc == 0, (
        f"{sr.describe() if sr else '-'}\n--- log tail\n{run.log_tail()}")
    err = sr.stderr
    assert "\x1b" not in err and "\r" not in err, repr(err[-2000:])  # plain lines off a terminal
    rx = re.compile(rf"^xpuctl: {re.escape(run.name)}: +(\d+\.\d+)s (.+)$")
    seen = [(float(m.group(1)), m.group(2)) for m in map(rx.match, err.splitlines()) if m]
    names = [n for _, n in seen]
    assert len(names) == len(set(names)), names  # one line per phase change
    order = [n for n in names if n in ENGINE_AND_LOADING]
    assert order == ENGINE_AND_LOADING, f"phases seen: {names}\n{sr.describe(6000)}"
    assert [t for t, _ in seen] == sorted(t for t, _ in seen), seen
    ready = [i for i, ln in enumerate(err.splitlines()) if f"{run.name} is ready on port" in ln]
    assert len(ready) == 1, sr.describe(6000)
    last_phase = max(i for i, ln in enumerate(err.splitlines()) if rx.match(ln))
    assert last_phase < ready[0], sr.describe(6000)
    summary = err.splitlines()[ready[0]]
    for name in ENGINE_AND_LOADING:
        assert re.search(rf"\b{re.escape(name)} \d+\.\d+s", summary), summary
    rec = run.record()
    assert rec["state"] == "ready" and rec["ready_at"] >= rec["started_at"], rec

    vllm_timings[request.node.name] = {
        "serve_detach": sr.seconds,
        **{f"at:{n}": t for t, n in seen},
    }
    stop = run.xpuctl("shutdown", run.name, "--state-dir", run.state_dir, timeout=120)
    assert stop.rc == 0, stop.describe()
    gone, _ = run.wait_gone(60)
    assert gone, run.describe_tree()
