"""Parsers of the deep probes' outputs on golden samples: the kernel's memory query replies
(bytes built from the documented uapi layouts), xpu-smi JSON (v1 and v2), the probes' JSON."""

from __future__ import annotations

import json
import struct

import pytest

from xpuctl.parse import kmd, xpusmi
from xpuctl.parse.probes import (
    ProbeOutputError,
    parse_probe_output,
    result_from_dict,
    result_to_dict,
)
from xpuctl.probes.children.kmd import privileged

GiB, MiB = 1 << 30, 1 << 20

# struct drm_xe_query_mem_regions, written out field by field from xe_drm.h:
# {u32 num_mem_regions; u32 pad} then drm_xe_mem_region {u16 mem_class; u16 instance;
# u32 min_page_size; u64 total_size; u64 used; u64 cpu_visible_size; u64 cpu_visible_used;
# u64 reserved[6]}
XE_TWO_TILES = (
    struct.pack("<II", 3, 0)
    + struct.pack("<HHIQQQQ", 0, 0, 4096, 64 * GiB, 3 * GiB, 0, 0) + bytes(48)   # system memory
    + struct.pack("<HHIQQQQ", 1, 1, 65536, 24 * GiB, 9 * GiB, 256 * MiB, 0) + bytes(48)  # vram0
    + struct.pack("<HHIQQQQ", 1, 2, 65536, 24 * GiB, 1 * GiB, 256 * MiB, 0) + bytes(48)  # vram1
)
# struct drm_i915_query_memory_regions {u32 num_regions; u32 rsvd[3]} then
# drm_i915_memory_region_info {u16 class; u16 instance; u32 rsvd0; u64 probed_size;
# u64 unallocated_size; u64 rsvd1[8]}
I915_DG2 = (
    struct.pack("<IIII", 2, 0, 0, 0)
    + struct.pack("<HHIQQ", 0, 0, 0, 32 * GiB, 30 * GiB) + bytes(64)
    + struct.pack("<HHIQQ", 1, 0, 0, 16 * GiB, 10 * GiB) + bytes(64)
)


def test_ioctl_numbers_and_sizes_follow_the_uapi_headers():
    assert kmd.DRM_IOCTL_XE_DEVICE_QUERY == 0xC0286440  # _IOWR('d', 0x40, 40 bytes)
    assert kmd.DRM_IOCTL_I915_QUERY == 0xC0106479  # _IOWR('d', 0x79, 16 bytes)
    assert (kmd.XE_QUERY.size, kmd.XE_REGION.size, kmd.I915_QUERY_ITEM.size, kmd.I915_REGION.size) == (40, 88, 24, 88)
    q = kmd.xe_query(264, 0xDEAD0000)
    assert struct.unpack("<QIIQQQ", q) == (0, 1, 264, 0xDEAD0000, 0, 0)
    assert kmd.xe_query_size(q) == 264
    assert kmd.i915_item_length(kmd.i915_item(-22)) == -22


def test_xe_mem_regions_golden():
    regions = kmd.parse_xe_mem_regions(XE_TWO_TILES)
    assert [r.mem_class for r in regions] == [0, 1, 1]
    assert regions[1] == kmd.MemRegion(1, 1, 24 * GiB, 9 * GiB)
    assert kmd.device_memory(regions, privileged=True) == kmd.KmdMemory(48 * GiB, 10 * GiB, 2)
    # without CAP_PERFMON the kernel writes 0 into `used`: not a figure to trust
    assert kmd.device_memory(regions, privileged=False) == kmd.KmdMemory(48 * GiB, None, 2)


def test_i915_memory_regions_golden():
    regions = kmd.parse_i915_memory_regions(I915_DG2)
    assert regions[1] == kmd.MemRegion(1, 0, 16 * GiB, 6 * GiB)
    assert kmd.device_memory(regions, True) == kmd.KmdMemory(16 * GiB, 6 * GiB, 1)
    igpu = struct.pack("<IIII", 1, 0, 0, 0) + struct.pack("<HHIQQ", 0, 0, 0, 8 * GiB, 8 * GiB) + bytes(64)
    assert kmd.device_memory(kmd.parse_i915_memory_regions(igpu), True) == kmd.KmdMemory(None, None, 0)


@pytest.mark.parametrize("data", [b"", b"\x01\x00", XE_TWO_TILES[:100], struct.pack("<II", 10**6, 0)])
def test_short_or_impossible_replies_raise_the_parser_error(data):
    with pytest.raises(kmd.KmdReplyError):
        kmd.parse_xe_mem_regions(data)
    with pytest.raises(kmd.KmdReplyError):
        kmd.parse_i915_memory_regions(data[:8] + bytes(8) if len(data) >= 8 else data)


def kmd_line(privileged_: bool, devices: list[dict]) -> str:
    return "\n" + json.dumps({"name": "kmd", "privileged": privileged_, "devices": devices}) + "\n"


def test_kmd_probe_result_fills_total_and_used():
    dev = {"bdf": "0000:03:00.0", "driver": "xe", "node": "/dev/dri/renderD128",
           "reply": XE_TWO_TILES.hex(), "errno": None, "error": None}
    r = kmd.probe_result(kmd_line(True, [dev]), 0.05)
    assert r.available and r.devices[0].memory_total_bytes == 48 * GiB
    assert r.devices[0].memory_used_bytes == 10 * GiB and not r.notes
    r = kmd.probe_result(kmd_line(False, [dev]), 0.05)
    assert r.devices[0].memory_used_bytes is None and "CAP_PERFMON" in r.notes[0]
    i915 = dict(dev, driver="i915", reply=I915_DG2.hex())
    assert kmd.probe_result(kmd_line(True, [i915])).devices[0].memory_used_bytes == 6 * GiB


def test_kmd_probe_result_errors():
    wedged = {"bdf": "0000:03:00.0", "driver": "xe", "node": "/dev/dri/renderD128", "reply": None,
              "errno": 125, "error": "query on /dev/dri/renderD128: Operation canceled"}
    denied = dict(wedged, bdf="0000:04:00.0", errno=13, error="open /dev/dri/renderD129: Permission denied")
    r = kmd.probe_result(kmd_line(False, [wedged, denied]))
    assert [d.state for d in r.devices] == ["lost", "ok"]
    assert any("Permission denied" in n for n in r.notes)
    assert not kmd.probe_result(kmd_line(False, [])).available
    for bad in ("", "garbage", json.dumps({"devices": [{"bdf": "x"}]}),
                kmd_line(True, [dict(wedged, reply="zz")])):
        with pytest.raises(kmd.KmdReplyError):
            kmd.probe_result(bad)


def test_capabilities_from_status():
    assert privileged("Name:\tx\nCapEff:\t000001ffffffffff\n")  # root
    assert privileged(f"CapEff:\t{1 << 38:016x}\n")  # CAP_PERFMON alone
    assert not privileged("CapEff:\t0000000000000000\n")
    assert not privileged("CapEff:\tnot-hex\n") and not privileged("")


# --- xpu-smi -------------------------------------------------------------------------------

DISCOVERY_V1 = """{
    "device_list": [
        {
            "device_function_type": "physical",
            "device_id": 0,
            "device_name": "Intel(R) Data Center GPU Max 1550",
            "device_type": "GPU",
            "drm_device": "/dev/dri/card1",
            "pci_bdf_address": "0000:29:00.0",
            "pci_device_id": "0xbd5",
            "uuid": "01000000-0000-0000-0000-000000290000",
            "vendor_name": "Intel(R) Corporation"
        }
    ]
}"""
DISCOVERY_V2 = json.dumps({"device_list": [
    {"device_id": 0, "device_name": "Intel(R) Arc(TM) Pro B60 Graphics", "device_type": "GPU",
     "pci_bdf_address": "0000:03:00.0", "device_state": "normal", "memory_physical_size_byte": 25769803776,
     "number_of_tiles": 1},
    {"device_id": 1, "device_name": "Intel(R) Arc(TM) Pro B60 Graphics", "device_type": "GPU",
     "pci_bdf_address": "0000:04:00.0"}]})
PS_V1 = ('{"device_util_by_proc_list": [{"device_id": 0, "mem_size": 61865984, "process_id": 12345, '
         '"process_name": "python3", "shared_mem_size": 0}]}')
PS_V2 = json.dumps({"device_util_by_proc_list": [
    {"process_id": 7, "process_name": "vllm", "device_id": 1, "engines": 2, "shared_mem_size": 1,
     "mem_size": 1048576}]})


def test_xpusmi_v1_and_v2_golden():
    (d,) = xpusmi.parse_discovery(DISCOVERY_V1)
    assert d == xpusmi.SmiDevice(0, "0000:29:00.0", "Intel(R) Data Center GPU Max 1550", None)
    v2 = xpusmi.parse_discovery(DISCOVERY_V2)
    assert [x.bdf for x in v2] == ["0000:03:00.0", "0000:04:00.0"] and v2[0].state == "normal"
    (p,) = xpusmi.parse_ps(PS_V1)
    assert p == xpusmi.SmiProcess(12345, 0, 61865984 * 1024, 0, "python3")  # kB → bytes
    r = xpusmi.probe_result((0, DISCOVERY_V2), (0, PS_V2), 0.3,
                            version=(0, "CLI:\n    Version: 2.0.0.20250225\n"))
    assert r.available and r.devices[1].processes[0].memory_bytes == GiB
    assert r.devices[0].processes == ()


@pytest.mark.parametrize("text", ["", "xpu-smi: command failed", "[]", '{"device_list": 3}',
                                  '{"device_list": [{"device_name": "x"}]}',
                                  '{"error": "device not found", "errno": 5}'])
def test_xpusmi_bad_discovery(text):
    with pytest.raises(xpusmi.XpuSmiError):
        xpusmi.parse_discovery(text)
    r = xpusmi.probe_result((0, text), (0, PS_V2))
    assert not r.available and r.reason.startswith("xpu-smi discovery -j")


# --- the probes' own JSON ------------------------------------------------------------------

SYSMAN_LINE = json.dumps({
    "name": "sysman", "available": True, "reason": None, "version": "0.1.3", "notes": [],
    "devices": [{"bdf": "0000:03:00.0", "index": None, "name": "Intel(R) Arc(TM) B580 Graphics",
                 "state": "ok", "reason": None, "memory_total_bytes": 12 * GiB,
                 "memory_used_bytes": 2 * GiB,
                 "processes": [{"pid": 4242, "memory_bytes": MiB, "shared_bytes": 0}]}]})


def test_probe_output_golden_last_line_wins():
    r = parse_probe_output("loader says hello\n" + SYSMAN_LINE + "\n", "sysman", 0.2)
    assert r.available and r.seconds == 0.2 and r.live is True
    assert r.devices[0].processes[0].pid == 4242 and r.devices[0].memory_used_bytes == 2 * GiB
    assert result_from_dict(result_to_dict(r)) == r


@pytest.mark.parametrize("text", [
    "", "not json", "[1, 2]", json.dumps({"name": "torch", "available": True}),
    json.dumps({"name": "sysman", "available": "yes"}),
    json.dumps({"name": "sysman", "available": True, "devices": [{"bdf": "03:00.0"}]}),
    json.dumps({"name": "sysman", "available": True, "devices": [{"state": "melted"}]}),
    json.dumps({"name": "sysman", "available": True, "devices": [{"processes": [{"pid": -1}]}]}),
    json.dumps({"name": "sysman", "available": True, "devices": [{"memory_used_bytes": 1.5}]}),
])
def test_probe_output_rejects_what_is_not_documented(text):
    with pytest.raises(ProbeOutputError):
        parse_probe_output(text, "sysman")


# --- the ioctl calls themselves, against a stand-in for the kernel ---------------------------


def test_kmd_probe_two_call_protocol(monkeypatch):
    """The xe and i915 queries are asked twice (size, then data) through real pointers; a
    stand-in for the kernel answers the way the uapi documents."""
    import ctypes

    from xpuctl.probes.children import kmd as probe

    def kernel(fd, req, buf, mutate):
        assert mutate is True and isinstance(buf, bytearray)
        if req == kmd.DRM_IOCTL_XE_DEVICE_QUERY:
            ext, query, size, data, r0, r1 = kmd.XE_QUERY.unpack(bytes(buf))
            assert query == kmd.DRM_XE_DEVICE_QUERY_MEM_REGIONS
            if size == 0:
                buf[:] = kmd.XE_QUERY.pack(ext, query, len(XE_TWO_TILES), data, r0, r1)
            else:
                ctypes.memmove(data, XE_TWO_TILES, len(XE_TWO_TILES))
            return 0
        assert req == kmd.DRM_IOCTL_I915_QUERY
        num, _flags, items = kmd.I915_QUERY.unpack(bytes(buf))
        assert num == 1
        qid, length, flags, data = kmd.I915_QUERY_ITEM.unpack(ctypes.string_at(items, kmd.I915_QUERY_ITEM.size))
        assert qid == kmd.DRM_I915_QUERY_MEMORY_REGIONS
        if length == 0:
            answer = kmd.I915_QUERY_ITEM.pack(qid, len(I915_DG2), flags, data)
        else:
            ctypes.memmove(data, I915_DG2, len(I915_DG2))
            answer = kmd.I915_QUERY_ITEM.pack(qid, len(I915_DG2), flags, data)
        ctypes.memmove(items, answer, len(answer))
        return 0

    monkeypatch.setattr(probe.fcntl, "ioctl", kernel)
    assert probe._xe(0) == XE_TWO_TILES
    assert probe._i915(0) == I915_DG2

    def refuses(fd, req, buf, mutate):
        _num, _flags, items = kmd.I915_QUERY.unpack(bytes(buf))
        qid, _, flags, data = kmd.I915_QUERY_ITEM.unpack(ctypes.string_at(items, kmd.I915_QUERY_ITEM.size))
        ctypes.memmove(items, kmd.I915_QUERY_ITEM.pack(qid, -22, flags, data), kmd.I915_QUERY_ITEM.size)
        return 0

    monkeypatch.setattr(probe.fcntl, "ioctl", refuses)
    with pytest.raises(OSError) as err:
        probe._i915(0)
    assert err.value.errno == 22


def test_kmd_probe_child_on_this_machine():
    """No xe/i915 render node here: the child says so, in the documented JSON."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "xpuctl.probes.children.kmd"], capture_output=True, text=True,
                         timeout=60, check=True)
    r = kmd.probe_result(out.stdout)
    assert not r.available and "render node" in r.reason
