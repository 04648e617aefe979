"""Hostile host text for tests: a fake host whose every printed string is controlled by
another user (argv, comm, file names in /tmp and /dev/shm, sysfs strings), and the checks
that output is safe for a terminal (no control byte but newline, valid UTF-8)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import fakehost as fh

# what issue 13 saw: window title, clear screen, red
OSC_CSI = "\x1b]0;owned\x07\x1b[2J\x1b[31mRED"
MARKUP = "[bold]x[/bold]"
# bytes that are not UTF-8, a C1 CSI, bidi override, line separator, tab, CR, newline, DEL
ODD_BYTES = b"\xff\xfe\x9b\xc3(" + "\u202eevil\u2028".encode() + b"\t\r\n\x7f"

EVIL_ARGV_BYTES = b"\0".join(
    [b"/usr/bin/evil", OSC_CSI.encode(), MARKUP.encode(), b":skull:", ODD_BYTES]
) + b"\0"
EVIL_ARGV = EVIL_ARGV_BYTES.decode("utf-8", "surrogateescape").split("\0")[:-1]
EVIL_COMM = "ev\x1b[2J\x07[b]l"  # <= 15 bytes, as the kernel keeps it

MODEL = OSC_CSI + MARKUP + "\u202e"
# names the stale-file rules accept (torch_.+, ccl-ipc-fd-sock-<pid>:.*), so they are listed
# (the patterns end in \Z: a newline can no longer end a listed name; a vertical tab can)
SHM_NAME = "/dev/shm/torch_" + "\x1b[2J\x07[bold]x[red]" + "\udcff\u202e\t\udcfe"
TMP_NAME = "/tmp/ccl-ipc-fd-sock-2901:" + "\x1b]0;owned\x07\x9b1m" + "\udce9\x0b"
VENDOR_BYTES = b"\xff\xfe\x1b[2J\x00\x9b" + MARKUP.encode() + b"\x07\n"
DEVICE_BYTES = b"\x1b]0;title\x07:skull:"
DRIVER = "xe\x1b[5m[bold]x"  # a link name: no slash
ODD_BDF = '0000:0a:00.0"\\\x1b[2J'
EVIL_PID, EVIL_API, EVIL_STUCK = 7000, 7001, 7002

# What may reach a terminal from xpuctl: printable text and newlines. Raw C0/C1 controls,
# DEL, stray surrogates (only as escapes), bidi overrides and Unicode line separators may not.
_BAD = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                  "\u2066-\u2069\ud800-\udfff]")
# rich's own styling on a terminal: SGR sequences only
SGR = re.compile("\x1b\\[[0-9;]*m")


def assert_terminal_safe(data: bytes, what: str = "", tty: bool = False) -> str:
    """`data` is valid UTF-8 with no control byte but newline (on a TTY: plus rich's SGR
    styling and the pty's CR before each newline). Returns the text."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AssertionError(f"{what}: not valid UTF-8 ({exc}):\n{data!r}") from None
    shown = text
    if tty:
        shown = SGR.sub("", text).replace("\r\n", "\n")
    bad = _BAD.search(shown)
    assert bad is None, f"{what}: raw {bad.group()!r} at {bad.start()}:\n{shown!r}"
    return text


def hostile_host(root: Path) -> fh.FakeHost:
    """The orphan scenario plus hostile text wherever xpuctl reads a string it prints."""
    h = fh.orphan_host(root)
    # a process of another user holding a GPU, with hostile argv and comm
    h.add_process(
        EVIL_PID, 1, EVIL_ARGV[:1], uid=1001, comm=EVIL_COMM, cmdline_bytes=EVIL_ARGV_BYTES,
        start_ticks=h.ticks(3600), fds={3: "/dev/dri/renderD129"},
        fdinfo={3: fh.xe_fdinfo(77, fh.BDF1, [64 * fh.MiB])},
    )
    # a live vLLM API server whose model name is hostile (argv: shown in ps, shutdown)
    h.add_process(
        EVIL_API, 1, ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL,
                      "--port", "8123"],
        uid=1001, start_ticks=h.ticks(3700),
    )
    # a stuck process in a hostile kernel function (wchan is kernel text: a fake host lies)
    h.add_process(EVIL_STUCK, 1, ["VLLM::Worker_TP3"], state="D", uid=1001,
                  wchan="wait\x1b[2J" + MARKUP, start_ticks=h.ticks(3650))
    # stale files with hostile names
    h.add_file(SHM_NAME, uid=1000, size=4096, mtime=h.at(700), mode=0o600)
    h.add_file(TMP_NAME, uid=1000, size=64, mtime=h.at(500), mode=0o600)
    # a non-Intel device whose sysfs strings are garbage, and an Intel one with an odd BDF
    pci = h.add_device("renderD130", "card2", "0000:09:00.0", vendor=0x1234, driver=DRIVER)
    (pci / "vendor").write_bytes(VENDOR_BYTES)
    (pci / "device").write_bytes(DEVICE_BYTES)
    h.add_device("renderD131", "card3", ODD_BDF, device=fh.B60, driver="xe")
    return h


def hostile_env() -> dict[str, str]:
    """A caller environment with hostile device-selection variables (the env check quotes them)."""
    return {
        "ZE_AFFINITY_MASK": "0,\x1b[2J" + MARKUP,
        "ONEAPI_DEVICE_SELECTOR": "level_zero:\x1b]0;t\x07",
        "ZE_FLAT_DEVICE_HIERARCHY": "\x9b31m\udcff",
    }


def escaped(text: str) -> str:
    """How the terminal shows host text (for asserting that it is there, escaped)."""
    from xpuctl.output.safetext import safe

    return safe(text)


if __name__ == "__main__":  # build one to look at: python tests/support/hostile.py DIR
    import sys

    hostile_host(Path(sys.argv[1]))
    print(os.path.abspath(sys.argv[1]))
