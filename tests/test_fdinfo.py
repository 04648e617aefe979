"""DRM fdinfo and dma-buf fdinfo parsers against golden samples (tests/data/fdinfo).

The four kernel samples are the layouts of Linux Documentation/gpu/drm-usage-stats.rst, the
xe driver's xe_drm_client.c and the i915 man-page patch (tabs kept; docs/intel.md); the
others are variants written for this suite. Every expected figure below was computed by hand from the
sample text, not by running the parser.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from xpuctl.parse.fdinfo import parse_dmabuf, parse_fdinfo

DATA = Path(__file__).parent / "data" / "fdinfo"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def sample(name: str) -> str:
    # The way a host reader gets it: bytes from /proc, decoded without ever failing.
    return (DATA / name).read_bytes().decode("utf-8", errors="replace")


def test_samples_are_verbatim_kernel_layout():
    # Guard against an editor turning the kernel's ":\t" into spaces in the golden files.
    for name in ("xe_kerneldoc.txt", "xe_pvc_two_tile.txt", "i915_igpu.txt", "i915_dgpu.txt"):
        text = sample(name)
        assert "drm-driver:\t" in text
        assert ":  " not in text and ": " not in text


# --- xe -------------------------------------------------------------------------------------


def test_xe_kerneldoc():
    info = parse_fdinfo(sample("xe_kerneldoc.txt"))
    assert info.driver == "xe"
    assert info.pdev == "0000:03:00.0"
    assert info.client_id == 3
    assert info.memory_bytes == 23992 * KiB == 24567808
    # every drm-total-<region>, in bytes; drm-total-cycles-* are not regions
    assert info.regions == {
        "system": 0,
        "gtt": 192 * KiB,
        "vram0": 23992 * KiB,
        "stolen": 0,
    }
    assert not any(k.startswith("cycles") for k in info.regions)
    # raw keys keep the kernel text
    assert info.keys["drm-shared-vram0"] == "16 MiB"
    assert info.keys["drm-engine-capacity-ccs"] == "4"
    assert info.keys["drm-total-cycles-rcs"] == "7655183225"
    assert info.keys["drm-driver"] == "xe"
    # only drm-* keys; the generic fdinfo header is not part of them
    assert "pos" not in info.keys and "ino" not in info.keys and "flags" not in info.keys
    assert all(k.startswith("drm-") for k in info.keys)
    assert len(info.keys) == 33


def test_xe_pvc_two_tiles_sum_vram0_and_vram1():
    info = parse_fdinfo(sample("xe_pvc_two_tile.txt"))
    assert info.driver == "xe"
    assert info.pdev == "0000:4d:00.0"
    assert info.client_id == 173
    assert info.memory_bytes == (65072580 + 63753540) * KiB == 131917946880
    assert info.regions["vram0"] == 65072580 * KiB
    assert info.regions["vram1"] == 63753540 * KiB
    assert info.regions["gtt"] == 264 * KiB
    assert info.keys["drm-active-vram0"] == "65069124 KiB"


def test_xe_units_mib_gib_bytes_and_spaces():
    info = parse_fdinfo(sample("xe_units_mib_gib.txt"))
    assert info.driver == "xe"
    assert info.pdev == "0000:03:00.0"
    assert info.client_id == 42
    assert info.regions == {
        "system": 4096,  # "4096 B"
        "gtt": 2 * MiB,  # "2 MiB"
        "vram0": 12 * GiB,  # "  12 GiB" (extra spaces)
        "vram1": 536870912,  # bare bytes
        "stolen": 8 * MiB,  # stolen is a region but never client memory
    }
    assert info.memory_bytes == 12 * GiB + 512 * MiB == 13421772800


def test_xe_reordered_keys():
    info = parse_fdinfo(sample("xe_reordered.txt"))
    assert info.pdev == "0000:04:00.0"  # after the memory keys
    assert info.client_id == 77  # last line
    assert info.memory_bytes == 1048576 * KiB == GiB


def test_xe_without_pdev_old_kernel():
    info = parse_fdinfo(sample("xe_no_pdev.txt"))
    assert info.driver == "xe"
    assert info.pdev is None
    assert info.client_id == 5
    assert info.memory_bytes == 2 * MiB


# --- i915 -----------------------------------------------------------------------------------


def test_i915_igpu_has_no_device_memory():
    info = parse_fdinfo(sample("i915_igpu.txt"))
    assert info.driver == "i915"
    assert info.pdev == "0000:00:02.0"
    assert info.client_id == 39
    # only system0 / stolen-system0: system memory is not device memory
    assert info.memory_bytes is None
    assert info.regions == {"system0": 6044 * KiB, "stolen-system0": 0}
    assert info.keys["drm-engine-render"] == "346249 ns"


def test_i915_dgpu_memory_from_local0_only():
    info = parse_fdinfo(sample("i915_dgpu.txt"))
    assert info.driver == "i915"
    assert info.pdev == "0000:03:00.0"
    assert info.client_id == 12
    # local0 only; not system0 (2 MiB), not stolen-local0
    assert info.memory_bytes == 14680064 * KiB == 15032385536
    assert info.regions == {"system0": 2 * MiB, "local0": 14680064 * KiB, "stolen-local0": 0}


# --- what is not counted --------------------------------------------------------------------


def test_stolen_system_and_gtt_are_not_memory():
    text = (
        "drm-driver:\txe\n"
        "drm-total-system:\t1 GiB\n"
        "drm-total-gtt:\t1 GiB\n"
        "drm-total-stolen:\t1 GiB\n"
        "drm-total-stolen-local0:\t1 GiB\n"
        "drm-resident-vram0:\t1 GiB\n"
        "drm-shared-vram0:\t1 GiB\n"
    )
    info = parse_fdinfo(text)
    assert info.memory_bytes is None
    assert info.regions["stolen-local0"] == GiB


def test_zero_vram_is_zero_not_none():
    # an idle xe client (e.g. a monitor) prints "drm-total-vram0:\t0"
    info = parse_fdinfo("drm-driver:\txe\ndrm-client-id:\t9\ndrm-total-vram0:\t0\n")
    assert info.memory_bytes == 0


def test_vram_and_local_are_summed_together():
    info = parse_fdinfo(
        "drm-driver:\ti915\ndrm-total-local0:\t1 MiB\ndrm-total-local1:\t3 MiB\n"
        "drm-total-vram0:\t1024\n"
    )
    assert info.memory_bytes == 4 * MiB + 1024


@pytest.mark.parametrize(
    "value, expected",
    [
        ("0", 0),
        ("1", 1),
        ("7 B", 7),
        ("3 KiB", 3 * KiB),
        ("3 MiB", 3 * MiB),
        ("3 GiB", 3 * GiB),
        ("  5   KiB  ", 5 * KiB),
    ],
)
def test_units(value, expected):
    info = parse_fdinfo(f"drm-driver:\txe\ndrm-total-vram0:{value}\n")
    assert info.regions["vram0"] == expected
    assert info.memory_bytes == expected


# --- garbage never raises -------------------------------------------------------------------


def test_malformed_sample():
    info = parse_fdinfo(sample("malformed.txt"))
    assert info.driver == "xe"
    assert info.pdev == "0000:03:00.0"
    assert info.client_id == 17
    # "drm-total-vram0 8192 KiB" has no colon: ignored; vram1 "lots" and local0 "12 furlongs"
    # are bad values: ignored; only vram0 4096 KiB counts.
    assert info.memory_bytes == 4096 * KiB
    assert info.regions["vram0"] == 4096 * KiB
    assert "vram1" not in info.regions
    assert "local0" not in info.regions
    # "-5" is not a size
    assert info.regions.get("stolen", 0) >= 0


def test_malformed_sample_with_surrogateescape():
    text = (DATA / "malformed.txt").read_bytes().decode("utf-8", errors="surrogateescape")
    info = parse_fdinfo(text)
    assert info.memory_bytes == 4096 * KiB
    assert info.client_id == 17


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n\n",
        "\x00" * 64,
        ":::\n",
        "drm-driver\n",
        "drm-driver:\n",
        "drm-client-id:\tabc\n",
        "drm-client-id:\t-3\n",
        "drm-client-id:\t\u00b2\n",  # "²": str.isdigit() is True, int() raises
        "drm-client-id:\t\u0663\n",  # Arabic-Indic digit three
        "drm-total-vram0:\t\u00b2 KiB\n",
        "drm-total-vram0:\t1.5 GiB\n",
        "drm-total-vram0:\t0x100\n",
        "drm-total-vram0:\t\n",
        "drm-total-vram0:\tKiB\n",
        "drm-total-vram0:\t12 KiB MiB\n",
        "drm-total-vram0:\t" + "9" * 5000 + "\n",
        "drm-total-\n",
        "drm-total-:\t5\n",
        "\udcff\udcfe:\t1\n",
    ],
)
def test_garbage_never_raises(text):
    info = parse_fdinfo(text)
    assert info.driver in (None, "xe") or isinstance(info.driver, str)
    assert info.client_id is None or isinstance(info.client_id, int)
    assert info.memory_bytes is None or (
        isinstance(info.memory_bytes, int) and info.memory_bytes >= 0
    )


def test_bad_memory_value_is_ignored():
    info = parse_fdinfo("drm-driver:\txe\ndrm-client-id:\t4\ndrm-total-vram0:\tlots\n")
    assert info.driver == "xe"
    assert info.client_id == 4
    assert info.memory_bytes is None
    assert "vram0" not in info.regions
    assert info.keys["drm-total-vram0"] == "lots"


def test_bad_client_id_is_none():
    assert parse_fdinfo("drm-driver:\txe\ndrm-client-id:\tnope\n").client_id is None
    assert parse_fdinfo("drm-driver:\txe\ndrm-client-id:\t\u00b2\n").client_id is None


def test_fractional_size_is_not_truncated_into_a_wrong_number():
    info = parse_fdinfo("drm-driver:\txe\ndrm-total-vram0:\t1.5 GiB\n")
    assert info.memory_bytes in (None, 1536 * MiB)


def test_not_drm_fdinfo():
    info = parse_fdinfo(sample("not_drm.txt"))
    assert info.driver is None
    assert info.pdev is None
    assert info.client_id is None
    assert info.memory_bytes is None
    assert info.regions == {}
    assert info.keys == {}


def test_dmabuf_fdinfo_is_not_a_drm_client():
    info = parse_fdinfo(sample("dmabuf_xe.txt"))
    assert info.driver is None
    assert info.memory_bytes is None


# --- dma-buf --------------------------------------------------------------------------------


def test_parse_dmabuf():
    buf = parse_dmabuf(sample("dmabuf_xe.txt"))
    assert buf is not None
    assert buf.size_bytes == 2097152
    assert buf.exporter == "xe"
    assert buf.inode == 1234


def test_parse_dmabuf_i915_without_name_line():
    buf = parse_dmabuf(
        "pos:\t0\nflags:\t02\nmnt_id:\t15\nino:\t99\nsize:\t4096\ncount:\t3\nexp_name:\ti915\n"
    )
    assert buf is not None
    assert (buf.size_bytes, buf.exporter, buf.inode) == (4096, "i915", 99)


@pytest.mark.parametrize("name", ["not_drm.txt", "xe_kerneldoc.txt", "i915_dgpu.txt"])
def test_parse_dmabuf_none_for_other_fdinfo(name):
    assert parse_dmabuf(sample(name)) is None


@pytest.mark.parametrize("text", ["", "size:\tbig\nexp_name:\n", "\x00\xff", "exp_name\n"])
def test_parse_dmabuf_garbage_never_raises(text):
    buf = parse_dmabuf(text)
    assert buf is None or buf.size_bytes is None or isinstance(buf.size_bytes, int)
