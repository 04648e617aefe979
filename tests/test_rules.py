"""The stale-file name patterns (xpuctl/core/rules.py) match whole names only (issue 17 item 5).

With `$`, a pattern also matched a name with one more, final newline: `psm_abc\\n` was
judged a vLLM leftover, so reset would have planned to delete a file no vLLM ever makes.
"""

from __future__ import annotations

import pytest

from xpuctl.core.rules import PATTERNS, match

# one real name per pattern, in PATTERNS order
EXAMPLES = (
    ("/dev/shm", "psm_1a2b3c"),
    ("/dev/shm", "sem.mp-abc_1"),
    ("/dev/shm", "torch_4242_1234_0"),
    ("/dev/shm", "fi_shm_region"),
    ("/dev/shm", "ze_ipc_0"),
    ("/dev/shm", "2901:1000:0"),
    ("/dev/shm", "EPS-shm-file-default-1000"),
    ("/dev/shm", "ccl-shm-file-1000"),
    ("/dev/shm", "ccl-rank2proc-eps-shm-1000"),
    ("/tmp", "vllm_dist_abc123"),
    ("/tmp", "ccl-ipc-fd-sock-2901:0"),
    ("/tmp", "ccl-handle-12-3"),
    ("/tmp", "open-peer-ipc-mem-server-rank_0_alice"),
    ("/tmp", "oneccl_pidfd_check_getXXXXa1B2c3"),
    ("/tmp", "ccl-module-cache-1000"),
    ("/tmp", "0b4c0e8e-2d0f-4a9b-9f3e-6b1f6f7c9d10"),
)


def test_every_pattern_has_an_example():
    assert len(EXAMPLES) == len(PATTERNS)
    for (directory, name), (pdir, pattern, _kind, _sock) in zip(EXAMPLES, PATTERNS, strict=True):
        assert directory == pdir and pattern.match(name), name


@pytest.mark.parametrize(("directory", "name"), EXAMPLES, ids=[n for _, n in EXAMPLES])
def test_a_trailing_newline_is_not_part_of_a_known_name(directory, name):
    assert match(directory, name) is not None
    assert match(directory, name + "\n") is None
    assert match(directory, name + "\n\n") is None


def test_a_fake_host_file_ending_in_newline_is_not_listed(tmp_path):
    from fakehost import clean_host

    from xpuctl.host.scan import take_scan
    from xpuctl.host.seam import Host

    h = clean_host(tmp_path)
    h.add_file("/dev/shm/psm_abc", uid=0, size=8, mtime=h.at(0), mode=0o600)
    h.add_file("/dev/shm/psm_abc\n", uid=0, size=8, mtime=h.at(0), mode=0o600)
    paths = {a.path for a in take_scan(Host(str(h.root)), port=None).artifacts}
    assert "/dev/shm/psm_abc" in paths and "/dev/shm/psm_abc\n" not in paths
