"""An idle Level Zero context is not a leak: every process that initialises Level Zero keeps
about 20 MiB on each card it sees (xpuctl issue 31 §6, measured on real hosts; xpu-smi 2.4's
`ps` hides such processes, fdinfo does not). doctor shows such a holder as an idle context
(info), and still warns about a non-vLLM process with real memory on a card.

fdinfo text: xe_drm_client.c's layout (tests/support/fakehost_tree.py `xe_fdinfo`, the kernel
doc sample in docs/intel.md), sizes as drm_fdinfo_print_size prints them (`20 MiB`).
"""

from __future__ import annotations

import json

import pytest
from fakehost import BDF0, BDF1, GiB, MiB, clean_host, xe_fdinfo
from typer.testing import CliRunner

from xpuctl.cli import app

runner = CliRunner()
PY = ["/usr/bin/python3", "-c", "import torch; torch.xpu.init(); input()"]


def _holder(h, pid: int, per_card: list[int]) -> None:
    """A process (not vLLM) with one xe DRM client on each card, `per_card` bytes of vram0."""
    nodes = ("/dev/dri/renderD128", "/dev/dri/renderD129")
    h.add_process(pid, 1, PY, start_ticks=h.ticks(1000),
                  fds={10 + i: nodes[i] for i in range(len(per_card))},
                  fdinfo={10 + i: xe_fdinfo(700 + pid % 100 + i, bdf, [size], ino=9000 + i)
                          for i, (bdf, size) in enumerate(zip((BDF0, BDF1), per_card,
                                                              strict=False))})


def doctor(root, *extra):
    result = runner.invoke(app, ["--root", str(root), "doctor", "--json", *extra])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout)


def holder_findings(data, pid):
    return [f for f in data["findings"] if f["check"] == "device-holders" and pid in f["pids"]]


def test_an_idle_context_on_each_card_is_info_not_a_leak(tmp_path):
    h = clean_host(tmp_path / "h")
    _holder(h, 5100, [20 * MiB, 20 * MiB])
    code, data = doctor(h.root)
    found = holder_findings(data, 5100)
    assert [f["device"] for f in found] == [BDF0, BDF1], found
    for f in found:
        assert f["severity"] == "info", f
        assert "idle Level Zero context (20.0 MiB" in f["message"] and "not a leak" in f["message"]
        assert f["remedy"] is None
    assert code == 0 and data["status"] == "busy"


@pytest.mark.parametrize(("sizes", "severities"), [
    ([2 * GiB, 20 * MiB], ["warn", "info"]),  # real memory on card 0, a context on card 1
    ([33 * MiB, 0], ["warn", "info"]),  # above the 32 MiB threshold: memory, said as such
])
def test_memory_above_the_threshold_is_still_a_warning(tmp_path, sizes, severities):
    h = clean_host(tmp_path / "h")
    _holder(h, 5200, sizes)
    _code, data = doctor(h.root)
    found = holder_findings(data, 5200)
    assert [f["severity"] for f in found] == severities, found
    assert "of device memory" in found[0]["message"] and "idle" not in found[0]["message"]


def test_expect_idle_still_fails_on_an_idle_context(tmp_path):
    """A card meant to be free is not free while a context is on it."""
    h = clean_host(tmp_path / "h")
    _holder(h, 5300, [20 * MiB])
    code, data = doctor(h.root, "--expect-idle", "--device", "0")
    (f,) = holder_findings(data, 5300)
    assert f["severity"] == "fail" and "idle Level Zero context" in f["message"]
    assert code == 1
