"""The kernel's word on the GPUs: /dev/kmsg records, device-wedged, gpu-hang, devcoredump.

Samples (kmsg lines are built from them, with the PRI,SEQ,USEC,-; header of Linux
Documentation/ABI/testing/dev-kmsg):
- xe wedged, reset failure, coredump created: the dmesg in CachyOS/linux-cachyos #892
  ("xe 0000:00:02.0: [drm] *ERROR* CRITICAL: Xe has declared device 0000:00:02.0 as wedged.",
  then "IOCTLs and executions are blocked." on the next line of the same printk), the message
  of xe_device_declare_wedged in Linux drivers/gpu/drm/xe/xe_device.c;
- i915: "Failed to initialize GPU, declaring it wedged!" (Linux drivers/gpu/drm/i915/i915_gem.c)
  and "Failed to idle engines, declaring wedged!" (intel-gfx list report);
- "[drm] Initialized i915 1.6.0 20201103 for 0000:00:02.0 on minor 1" (chaotic-cx/nyx #260),
  drm_dev_register in Linux drivers/gpu/drm/drm_drv.c.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from fakehost import BDF0, BDF1, clean_host
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from xpuctl.cli import app
from xpuctl.host.seam import Host
from xpuctl.parse.kmsg import HANG, INITIALIZED, WEDGED, gpu_events, parse_kmsg, relevant_text

runner = CliRunner()

XE_WEDGED = ("3,{seq},{usec},-;xe {bdf}: [drm] *ERROR* CRITICAL: Xe has declared device {bdf} as "
             "wedged.\\x0aIOCTLs and executions are blocked.\\x0aFor recovery procedure, refer to "
             "https://docs.kernel.org/gpu/drm-uapi.html#device-wedging\n"
             " SUBSYSTEM=pci\n DEVICE=+pci:{bdf}\n")
XE_RESET_FAILED = "3,{seq},{usec},-;xe {bdf}: [drm] *ERROR* Tile0: GT0: reset failed (-ETIMEDOUT)\n"
XE_COREDUMP = "6,{seq},{usec},-;xe {bdf}: [drm] Xe device coredump has been created\n"
XE_INIT = "6,{seq},{usec},-;[drm] Initialized xe 1.1.0 20201103 for {bdf} on minor 0\n"
I915_WEDGED = "3,{seq},{usec},-;i915 {bdf}: Failed to initialize GPU, declaring it wedged!\n"
OTHER = "6,{seq},{usec},-;usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"


def rec(template: str, seq: int, seconds: float, bdf: str = BDF0) -> str:
    return template.format(seq=seq, usec=int(seconds * 1e6), bdf=bdf)


def write_kmsg(root: Path, *records: str) -> None:
    (root / "dev").mkdir(exist_ok=True)
    (root / "dev/kmsg").write_text("".join(records))


def doctor(root: Path, *extra: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["--root", str(root), "doctor", "--json", *extra])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, json.loads(result.stdout)


def findings(data: dict, check: str) -> list[dict]:
    return [f for f in data["findings"] if f["check"] == check]


def device(data: dict, bdf: str) -> dict:
    return next(d for d in data["devices"] if d["bdf"] == bdf)


# -- the parser -------------------------------------------------------------------------------


def test_parse_records_unescapes_and_reads_the_device_dictionary() -> None:
    text = rec(OTHER, 1, 1.0) + rec(XE_WEDGED, 2, 100.5)
    records = parse_kmsg(text)
    assert [r.seq for r in records] == [1, 2]
    wedged = records[1]
    assert wedged.level == 3 and wedged.facility == 0 and wedged.usec == 100_500_000
    assert wedged.device == BDF0
    assert "\nIOCTLs and executions are blocked." in wedged.text
    assert wedged.line().endswith(f"declared device {BDF0} as wedged.")
    assert [r.seq for r in parse_kmsg(text, relevant_only=True)] == [2]


def test_events_wedged_hang_and_initialized() -> None:
    text = (rec(XE_RESET_FAILED, 1, 10) + rec(XE_WEDGED, 2, 11) + rec(XE_INIT, 3, 50)
            + rec(I915_WEDGED, 4, 60, BDF1) + rec(XE_COREDUMP, 5, 70))
    events = gpu_events(parse_kmsg(text))
    assert [(e.kind, e.bdf) for e in events] == [
        (HANG, BDF0), (WEDGED, BDF0), (INITIALIZED, BDF0), (WEDGED, BDF1), (HANG, BDF0)]
    assert events[3].driver == "i915"


def test_relevant_text_keeps_only_gpu_records_and_their_dictionary() -> None:
    text = rec(OTHER, 1, 1) + rec(XE_WEDGED, 2, 2) + rec(OTHER, 3, 3)
    kept = relevant_text(text)
    assert "usb" not in kept
    assert [r.seq for r in parse_kmsg(kept)] == [2]
    assert parse_kmsg(kept)[0].device == BDF0


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789,;- \n\\xabc:.[]edrmXi915")), max_size=300))
def test_parse_kmsg_never_raises(text: str) -> None:
    records = parse_kmsg(text)
    gpu_events(records)
    assert parse_kmsg(relevant_text(text), relevant_only=True) == parse_kmsg(text, relevant_only=True)


# -- doctor -------------------------------------------------------------------------------------


def test_wedged_device_fails_with_when_record_and_rebind(tmp_path: Path) -> None:
    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(OTHER, 1, 5), rec(XE_RESET_FAILED, 2, 3600), rec(XE_WEDGED, 3, 3600.25))
    code, data = doctor(h.root)
    assert code == 1
    [f] = findings(data, "device-wedged")
    assert f["severity"] == "fail" and f["device"] == BDF0
    assert "3600 s after boot" in f["message"] and "as wedged" in f["message"]
    assert "xpuctl reset --device 0 --rebind" in f["remedy"]
    assert device(data, BDF0)["wedged"]["since_boot_seconds"] == 3600.25
    assert "Xe has declared device" in device(data, BDF0)["wedged"]["record"]
    assert device(data, BDF1)["wedged"] is None
    assert not findings(data, "gpu-hang")  # the reset failure is part of the wedging


def test_initialised_again_after_the_wedging_is_not_wedged(tmp_path: Path) -> None:
    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(XE_WEDGED, 1, 100), rec(XE_INIT, 2, 200))
    code, data = doctor(h.root)
    assert not findings(data, "device-wedged") and not findings(data, "gpu-hang")
    assert device(data, BDF0)["wedged"] is None
    assert code == 0


def test_hang_alone_is_a_warning(tmp_path: Path) -> None:
    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(XE_INIT, 1, 4), rec(XE_RESET_FAILED, 2, 500, BDF1))
    code, data = doctor(h.root)
    [f] = findings(data, "gpu-hang")
    assert f["severity"] == "warn" and f["device"] == BDF1
    assert code == 0


def test_pending_devcoredump_is_a_warning_with_its_age(tmp_path: Path) -> None:
    h = clean_host(tmp_path / "h")
    write_kmsg(h.root)
    dump = h.path("/sys/class/drm/card1/device") / "devcoredump"
    dump.mkdir()
    (dump / "data").write_text("**** Xe Device Coredump ****\n")
    old = h.at(0) + 2 * 86400 - 120  # two minutes ago
    os.utime(dump / "data", (old, old))
    code, data = doctor(h.root)
    [f] = findings(data, "devcoredump")
    assert f["severity"] == "warn" and f["device"] == BDF1
    assert "save it before a rebind" in f["remedy"]
    cd = device(data, BDF1)["coredump"]
    assert cd["path"] == "/sys/class/drm/card1/device/devcoredump/data"
    assert 100 <= cd["age_seconds"] <= 3600
    assert device(data, BDF0)["coredump"] is None
    assert code == 0


def test_unreadable_kernel_log_is_said_once(tmp_path: Path) -> None:
    h = clean_host(tmp_path / "h")  # no dev/kmsg at all
    code, data = doctor(h.root)
    notes = [f for f in data["findings"] if "/dev/kmsg" in f["message"]]
    assert len(notes) == 1 and notes[0]["check"] == "inspection" and notes[0]["severity"] == "info"
    assert device(data, BDF0)["wedged"] is None
    assert code == 0


def test_doctor_only_looks_at_the_devices_asked_for(tmp_path: Path) -> None:
    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(I915_WEDGED, 1, 10, BDF1))
    code, data = doctor(h.root, "--device", "0")
    assert not findings(data, "device-wedged") and code == 0


# -- the real device ----------------------------------------------------------------------------


def test_real_kmsg_is_read_to_its_end_without_blocking() -> None:
    """/dev/kmsg here: every record in the buffer, then EAGAIN (not a block). Read only."""
    try:
        st_ = os.stat("/dev/kmsg")
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        pytest.skip(f"/dev/kmsg: {exc}")
    os.close(fd)
    assert stat.S_ISCHR(st_.st_mode)
    data = Host("/", read_timeout=None).read_records("/dev/kmsg")
    records = parse_kmsg(data.decode("utf-8", "surrogateescape"))
    assert data == b"" or records  # every record well-formed enough to parse
    seqs = [r.seq for r in records]
    assert seqs == sorted(seqs)
    # and through the bounded reader, as doctor reads it
    bounded = Host("/")
    try:
        again = bounded.read_records("/dev/kmsg")
    finally:
        bounded.reader.close()  # type: ignore[union-attr]
    assert not again or parse_kmsg(again.decode("utf-8", "surrogateescape"))


def test_epipe_means_skip_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel returns EPIPE once when the records a reader was at were overwritten."""
    from xpuctl.host import seam

    answers: list[object] = [b"6,1,1,-;a\n", BrokenPipeError(errno.EPIPE, "Broken pipe"),
                             b"6,9,9,-;b\n", BlockingIOError(errno.EAGAIN, "again")]

    def fake_read(fd: int, n: int) -> bytes:
        a = answers.pop(0)
        if isinstance(a, BaseException):
            raise a
        return a  # type: ignore[return-value]

    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/kmsg").write_text("")
    monkeypatch.setattr(seam.os, "read", fake_read)
    data = Host(tmp_path, read_timeout=None).read_records("/dev/kmsg")
    assert data == b"6,1,1,-;a\n6,9,9,-;b\n"


# -- snapshots ------------------------------------------------------------------------------------


def test_snapshot_keeps_the_gpu_records_and_doctor_from_agrees(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import tarfile

    from test_snapshot import NOW, assert_same_as_live, take

    monkeypatch.setattr(Host, "now", lambda self: NOW)
    h = clean_host(tmp_path / "h")
    h.boot_time = int(NOW) - 86400
    write_kmsg(h.root, rec(OTHER, 1, 5), rec(XE_WEDGED, 2, 7200), rec(XE_RESET_FAILED, 3, 9000, BDF1))
    dump = h.path("/sys/class/drm/card1/device") / "devcoredump"
    dump.mkdir()
    (dump / "data").write_text("dump\n")
    os.utime(dump / "data", (NOW - 30, NOW - 30))
    archive = take(h.root, tmp_path / "snap.tar.gz")
    with tarfile.open(archive) as tar:
        kept = next(tar.extractfile(m).read() for m in tar.getmembers()  # type: ignore[union-attr]
                    if m.name.endswith("/root/dev/kmsg"))
    assert b"usb" not in kept and b"as wedged" in kept  # only the GPU records travel
    assert_same_as_live(h.root, archive)
    code, data = doctor(h.root)
    assert code == 1
    assert findings(data, "device-wedged") and findings(data, "gpu-hang") and findings(data, "devcoredump")


def test_wedged_message_gives_the_wall_time(tmp_path: Path) -> None:
    import time

    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(I915_WEDGED, 1, 7200, BDF1))
    _, data = doctor(h.root)
    [f] = findings(data, "device-wedged")
    assert time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h.at(7200))) in f["message"]
    assert "xpuctl reset --device 1 --rebind" in f["remedy"]


def test_coredump_age_comes_from_the_drivers_record_when_there_is_one(tmp_path: Path) -> None:
    import time

    h = clean_host(tmp_path / "h")
    write_kmsg(h.root, rec(XE_COREDUMP, 1, time.time() - h.boot_time - 90))
    dump = h.path("/sys/class/drm/card0/device") / "devcoredump"
    dump.mkdir()
    (dump / "data").write_text("dump\n")
    os.utime(dump / "data", (h.at(0), h.at(0)))  # an mtime of boot: not what is reported
    _, data = doctor(h.root)
    assert 60 <= device(data, BDF0)["coredump"]["age_seconds"] <= 3600
    assert findings(data, "gpu-hang")  # the dump's record is a hang record too
