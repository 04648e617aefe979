"""The kernel's word on the GPUs: its log (/dev/kmsg) and pending devcoredumps.

/dev/kmsg is read without blocking, every record in its buffer (Host.read_records); under
`--root`, ROOT/dev/kmsg is a plain file of records. Reading it needs root or CAP_SYSLOG when
`kernel.dmesg_restrict` is 1: unreadable, it is one inspection note, never a finding.

A devcoredump (Linux drivers/base/devcoredump.c) appears as `devcoredump/data` in the failing
device's sysfs directory (xe says "Check your /sys/class/drm/cardN/device/devcoredump/data",
xe_devcoredump.c) until it is read and freed, or times out (5 minutes by default). Its age
is that of the driver's "coredump has been created" record when the log has one, else the
mtime of the data file.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from xpuctl.core.model import Coredump, Device, Issue, KernelLog
from xpuctl.host.seam import Host
from xpuctl.parse.procfs import parse_boot_time

if TYPE_CHECKING:  # types only: the parser is imported where a record is read
    from xpuctl.parse.kmsg import GpuEvent

KMSG = "/dev/kmsg"
_COREDUMP_SAID = "coredump has been created"


def read_kernel(host: Host, devices: tuple[Device, ...]
                ) -> tuple[KernelLog | None, tuple[Coredump, ...], list[Issue]]:
    """The GPU records of the kernel log (None when it could not be read, with the issue
    saying why) and the devices' pending devcoredumps. Every read is bounded."""
    if host.reader is not None:
        return host.reader.call(read_kernel, host, devices)  # type: ignore[no-any-return]
    # here, not at the top: with a reader, the log is parsed there, and the caller (doctor)
    # does not compile the parser's patterns
    from xpuctl.parse.kmsg import HANG, gpu_events, parse_kmsg

    issues: list[Issue] = []
    try:
        boot: float | None = parse_boot_time(host.read_text("/proc/stat", 1 << 20))
    except OSError:
        boot = None
    log: KernelLog | None = None
    try:
        raw = host.read_records(KMSG)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno in (errno.EPERM, errno.EACCES):
            why += " (reading it needs root or CAP_SYSLOG when kernel.dmesg_restrict is 1)"
        issues.append(Issue(KMSG, f"kernel log not read: {why}; a wedged or hung GPU is not "
                                  "seen without it"))
    else:
        records = parse_kmsg(raw.decode("utf-8", "surrogateescape"), relevant_only=True)
        log = KernelLog(tuple(gpu_events(records)), boot)
    now = host.now()
    dumps = []
    for d in devices:
        if not d.is_intel:
            continue
        node = d.card_node or d.render_node
        if node is None:
            continue
        link = f"/sys/class/drm/{node.rsplit('/', 1)[-1]}/device/devcoredump/data"
        try:
            path = host.resolve(link)
            info = host.lstat(path)
        except OSError:
            continue
        age: float | None = max(0.0, now - info.mtime)
        if log is not None and log.boot_time is not None:
            said = [e for e in log.events if e.bdf == d.bdf and e.kind == HANG
                    and _COREDUMP_SAID in e.record.text]
            if said:
                age = max(0.0, now - (log.boot_time + said[-1].record.seconds))
        dumps.append(Coredump(d.bdf, link, age))
    return log, tuple(dumps), issues


class KernelFollower:
    """The kernel log's new GPU records, for serve's watch: what was logged since the last
    call, never the whole log again (a check every few seconds must stay cheap).

    /dev/kmsg is opened without blocking and moved to its end (SEEK_END: the next read gives
    the next record logged); each read(2) gives one record, EAGAIN says there is no more, and
    EPIPE says records were overwritten before they were read (the read continues with the
    oldest one left). Under `--root`, ROOT/dev/kmsg is a plain file of records: it is read
    from where the last call stopped, and from its start when it appeared after the watch
    began. A log that cannot be opened (no root, no CAP_SYSLOG) is tried again at each call.
    """

    READ = 8192  # one record is at most about 1 KiB of text plus its dictionary

    def __init__(self, host: Host) -> None:
        self.path = host.root + KMSG
        self.fd: int | None = None
        self.rest = b""  # a plain file: the start of a record whose end is not written yet
        self._open(at_end=True)

    def _open(self, at_end: bool) -> None:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self.fd = None
            return
        if at_end:
            try:
                os.lseek(self.fd, 0, os.SEEK_END)
            except OSError:
                pass

    def read(self) -> list[GpuEvent]:
        """The GPU records logged since the last call, in order."""
        if self.fd is None:
            self._open(at_end=False)
            if self.fd is None:
                return []
        chunks = [self.rest]
        while True:
            try:
                data = os.read(self.fd, self.READ)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue
                break
            if not data:
                break
            chunks.append(data)
        raw = b"".join(chunks)
        cut = raw.rfind(b"\n") + 1
        self.rest, raw = raw[cut:], raw[:cut]
        if not raw:
            return []
        from xpuctl.parse.kmsg import gpu_events, parse_kmsg

        return gpu_events(parse_kmsg(raw.decode("utf-8", "surrogateescape"), relevant_only=True))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
