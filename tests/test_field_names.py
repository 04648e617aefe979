"""The names seen in the field since issue 37 (§5, §7): torch-xpu-ops' peer IPC exchange
and oneCCL's pid-less handle sockets, judged by who holds them; Prometheus's stale kinds
from the rules' registry.

Sources: torch-xpu-ops (its `un_allgather`, copied from oneCCL's examples) binds
`/tmp/open-peer-ipc-mem-server-rank_%d_%s` (rank, the user's name from getpwuid) and
`/tmp/open-peer-ipc-mem-client-rank_%d_%s`; oneCCL's IPC handle exchange
`/tmp/ccl-handle-<rank>-<tag>` carries no pid (oneCCL's ze handle manager).
"""

from __future__ import annotations

import pytest
from fakehost import clean_host

from xpuctl.core.rules import NEVER_STALE, PATTERNS, STALE_KINDS, match
from xpuctl.host.scan import take_scan
from xpuctl.host.seam import Host

SERVER = "/tmp/open-peer-ipc-mem-server-rank_0_alice"
CLIENT = "/tmp/open-peer-ipc-mem-client-rank_1_alice"
HANDLE = "/tmp/ccl-handle-3-7f2a"
LIBCCL = "7f0000000000-7f0000100000 r-xp 00000000 08:01 4242 /opt/oneccl/lib/libccl.so.1"


@pytest.mark.parametrize("name", ["open-peer-ipc-mem-server-rank_0_alice",
                                  "open-peer-ipc-mem-client-rank_12_bob.smith",
                                  "open-peer-ipc-mem-client-rank_3-1"])
def test_torch_xpu_ops_names_are_known(name):
    assert match("/tmp", name) == ("xpu-ipc-socket", False)


@pytest.mark.parametrize("name", ["open-peer-ipc-mem-server-rank_", "open-peer-ipc-mem-rank_0",
                                  "open-peer-ipc-mem-server-rank_x_alice"])
def test_near_names_are_not(name):
    assert match("/tmp", name) is None


def _artifacts(h):
    return {a.path: a for a in take_scan(Host(str(h.root)), port=None).artifacts}


def test_an_unheld_exchange_socket_is_stale_and_a_bound_one_is_kept(tmp_path):
    h = clean_host(tmp_path)
    h.add_file(SERVER, uid=1000, kind="socket", mtime=h.at(100))
    h.add_file(CLIENT, uid=1000, kind="socket", mtime=h.at(100))
    h.add_unix_socket(CLIENT, 51001)  # a live rank's client socket, bound
    h.add_process(5100, 1, ["python", "train.py"], fds={7: "socket:[51001]"})
    got = _artifacts(h)
    assert got[SERVER].kind == "xpu-ipc-socket" and got[SERVER].stale
    assert got[CLIENT].kind == "xpu-ipc-socket" and not got[CLIENT].stale
    assert "bound" in got[CLIENT].reason


def test_a_pidless_handle_is_judged_by_its_holders_only(tmp_path):
    """A live oneCCL process of the same user keeps `ccl-shm` files (their users cannot be
    told), but not a handle socket: only a holder does."""
    h = clean_host(tmp_path)
    h.add_file(HANDLE, uid=1000, kind="socket", mtime=h.at(100))
    h.add_process(5200, 1, ["python", "bench.py"], maps=[LIBCCL], start_ticks=h.ticks(50))
    got = _artifacts(h)
    assert got[HANDLE].stale, got[HANDLE].reason
    h.add_process(5201, 1, ["python", "bench.py"], fds={9: HANDLE}, maps=[LIBCCL])
    got = _artifacts(h)
    assert not got[HANDLE].stale and got[HANDLE].kept_by == (5201,)


def test_prometheus_kinds_are_the_registry():
    from xpuctl.output import prometheus

    kinds = {kind for _, _, kind, _ in PATTERNS} - NEVER_STALE
    assert set(STALE_KINDS) == kinds
    assert {"libfabric", "ccl-shm", "ccl-probe", "xpu-ipc-socket"} <= set(STALE_KINDS)
    assert prometheus.STALE_KINDS is STALE_KINDS


def test_the_exposition_has_a_sample_per_registry_kind(tmp_path):
    from typer.testing import CliRunner

    from xpuctl.cli import app

    h = clean_host(tmp_path)
    h.add_file("/dev/shm/2901:1000:0", uid=1000, size=64, mtime=h.at(100))  # libfabric
    h.add_file("/dev/shm/ccl-shm-file-1000", uid=1000, size=32, mtime=h.at(100))
    h.add_file("/tmp/oneccl_pidfd_check_getXXXXa1B2c3", uid=1000, mtime=h.at(100))
    h.add_file(SERVER, uid=1000, kind="socket", mtime=h.at(100))
    out = CliRunner().invoke(app, ["--root", str(h.root), "doctor", "--format", "prometheus"])
    text = out.stdout
    for kind in STALE_KINDS:
        assert f'xpuctl_stale_files{{kind="{kind}"}} ' in text, kind
    for kind in ("libfabric", "ccl-shm", "ccl-probe", "xpu-ipc-socket"):
        assert f'xpuctl_stale_files{{kind="{kind}"}} 1' in text, kind
    assert "xpuctl_stale_bytes 96" in text


def test_docs_list_every_registry_kind():
    from pathlib import Path

    row = next(line for line in (Path(__file__).parent.parent / "docs/output.md")
               .read_text().splitlines() if line.startswith("| `xpuctl_stale_files`"))
    for kind in STALE_KINDS:
        assert kind in row, kind
