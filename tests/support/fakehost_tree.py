"""The fake host builder: trees laid out the way the kernel presents /proc, /sys and /dev.

Tests import it through `fakehost` (the scenarios built with it), which re-exports these names.

`FakeHost(root)` writes a directory tree that xpuctl reads through `--root`. Nothing is written
outside `root`. Link texts and paths inside files are host paths (no root prefix), exactly what
the kernel would show, so `proc/<pid>/fd/<n>` links usually dangle.

Layout notes (kernel behaviour this mirrors):
- `sys/class/drm/renderD128` is a symlink to
  `../../devices/pci0000:00/<bridge>/<bdf>/drm/renderD128`, whose `device` is `../../../<bdf>`
  (the PCI function); `dev` holds `226:<minor>`.
  `sys/dev/char/226:<minor>` links to the same node directory. Connectors (`card0-DP-1`) live
  under the card directory and are also linked from `sys/class/drm`.
- PCI function: `vendor`, `device`, `class`, `subsystem_*`, `uevent`, `driver` ->
  `../../../../bus/pci/drivers/<driver>`, `drm/` listing its nodes; `survivability_mode`
  (0400) while xe holds the card in survivability mode (`survivability_text`);
  xe `tile<T>/physical_vram_size_bytes`; i915 backport `lmem_total_bytes` on the card node
  directory.
- `dev/dri/<node>` are plain empty files (no char devices in a fake tree), with
  `dev/dri/by-path/pci-<bdf>-{render,card}` symlinks.
- `proc/<pid>/stat` has the 52 fields of proc(5); `cmdline` is NUL-separated with a trailing NUL,
  a setproctitle'd process shows its title followed by NULs, a zombie an empty cmdline; `environ`
  zeroed by setproctitle is all NULs; `proc/<pid>` and its files are owned by the process uid.
- `proc/net/tcp{,6}` and `proc/net/unix` use the kernel's column layout.

Times: `boot_time` is an epoch; process start times are clock ticks (100 Hz) since boot;
`host.at(s)` turns "s seconds after boot" into an epoch for file mtimes.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from pathlib import Path

HZ = 100
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

STATE_NAMES = {
    "R": "R (running)",
    "S": "S (sleeping)",
    "D": "D (disk sleep)",
    "T": "T (stopped)",
    "t": "t (tracing stop)",
    "Z": "Z (zombie)",
    "X": "X (dead)",
    "I": "I (idle)",
}

PCI_CLASS = {"xe": "0x030000", "i915": "0x030000", "amdgpu": "0x030000", "nvidia": "0x030000"}


# --- fdinfo text generators (kernel printer formats) ----------------------------------------


def kernel_size(sz: int) -> str:
    """drm_fdinfo_print_size of recent kernels: the largest of B/KiB/MiB that divides exactly."""
    units = ["", " KiB", " MiB"]
    i = 0
    while i < len(units) - 1:
        if sz == 0 or sz % 1024:
            break
        sz //= 1024
        i += 1
    return f"{sz}{units[i]}"


def generic_fdinfo(ino: int, flags: str = "02", mnt_id: int = 1, pos: int = 0) -> str:
    return f"pos:\t{pos}\nflags:\t{flags}\nmnt_id:\t{mnt_id}\nino:\t{ino}\n"


def xe_fdinfo(
    client_id: int,
    pdev: str | None,
    vram: list[int] | None = None,
    *,
    gtt: int = 192 * KiB,
    ino: int = 685,
    cycles_ccs: int = 0,
) -> str:
    """An xe client's fdinfo as xe_drm_client.c prints it (regions system, gtt, vram<N>, stolen)."""
    vram = [0] if vram is None else vram
    lines = [generic_fdinfo(ino, flags="02100002", mnt_id=26).rstrip("\n")]
    lines.append("drm-driver:\txe")
    lines.append(f"drm-client-id:\t{client_id}")
    if pdev is not None:
        lines.append(f"drm-pdev:\t{pdev}")
    regions = [("system", 0), ("gtt", gtt)] + [(f"vram{i}", v) for i, v in enumerate(vram)]
    regions.append(("stolen", 0))
    for name, total in regions:
        lines.append(f"drm-total-{name}:\t{kernel_size(total)}")
        lines.append(f"drm-shared-{name}:\t0")
        lines.append(f"drm-active-{name}:\t0")
        lines.append(f"drm-resident-{name}:\t{kernel_size(total)}")
        if name == "system":
            lines.append(f"drm-purgeable-{name}:\t0")
    total_cycles = 7655183225
    for cls, cap in (("rcs", 1), ("bcs", 1), ("vcs", 2), ("vecs", 2), ("ccs", 4)):
        lines.append(f"drm-cycles-{cls}:\t{cycles_ccs if cls == 'ccs' else 0}")
        lines.append(f"drm-total-cycles-{cls}:\t{total_cycles}")
        if cap > 1:
            lines.append(f"drm-engine-capacity-{cls}:\t{cap}")
    return "\n".join(lines) + "\n"


def i915_fdinfo(
    client_id: int,
    pdev: str,
    *,
    local0: int | None = None,
    system0: int = 2 * MiB,
    ino: int = 284,
) -> str:
    """An i915 client's fdinfo: system0 (+ stolen-system0 on an iGPU), local0 on a dGPU."""
    lines = [generic_fdinfo(ino, flags="02100002", mnt_id=26).rstrip("\n")]
    lines += ["drm-driver:\ti915", f"drm-client-id:\t{client_id}", f"drm-pdev:\t{pdev}"]
    regions = [("system0", system0)]
    if local0 is None:
        regions.append(("stolen-system0", 0))
    else:
        regions += [("local0", local0), ("stolen-local0", 0)]
    for name, total in regions:
        lines.append(f"drm-total-{name}:\t{kernel_size(total)}")
        lines.append(f"drm-shared-{name}:\t0")
        lines.append(f"drm-active-{name}:\t0")
        lines.append(f"drm-resident-{name}:\t{kernel_size(total)}")
        if not name.startswith("stolen"):
            lines.append(f"drm-purgeable-{name}:\t0")
    lines += [
        "drm-engine-render:\t346249 ns",
        "drm-engine-copy:\t0 ns",
        "drm-engine-video:\t0 ns",
        "drm-engine-capacity-video:\t2",
        "drm-engine-video-enhance:\t0 ns",
    ]
    if local0 is not None:
        lines.append("drm-engine-compute:\t912345678901 ns")
    return "\n".join(lines) + "\n"


def amdgpu_fdinfo(client_id: int, pdev: str, vram: int, ino: int = 900) -> str:
    lines = [generic_fdinfo(ino, flags="02100002", mnt_id=26).rstrip("\n")]
    lines += [
        "drm-driver:\tamdgpu",
        f"drm-pdev:\t{pdev}",
        f"drm-client-id:\t{client_id}",
        "pasid:\t32771",
        f"drm-memory-vram:\t{vram // KiB} KiB",
        "drm-memory-gtt: \t2048 KiB",
        "drm-memory-cpu: \t0 KiB",
        f"drm-total-vram:\t{kernel_size(vram)}",
        f"drm-resident-vram:\t{kernel_size(vram)}",
        "drm-engine-gfx:\t1000 ns",
    ]
    return "\n".join(lines) + "\n"


def dmabuf_fdinfo(size: int, exporter: str = "xe", ino: int = 1234, count: int = 1) -> str:
    return generic_fdinfo(ino, flags="02", mnt_id=15) + (
        f"size:\t{size}\ncount:\t{count}\nexp_name:\t{exporter}\nname:\t\n"
    )


def maps_line(
    path: str,
    inode: int,
    start: int,
    length: int = 0x1000,
    perms: str = "rw-s",
    dev: str = "00:1a",
    offset: int = 0,
) -> str:
    """One /proc/<pid>/maps line; the path starts at column 73 as show_map_vma pads it."""
    head = f"{start:08x}-{start + length:08x} {perms} {offset:08x} {dev} {inode} "
    return head.ljust(73) + path


def survivability_text(mode: str = "Runtime", boot_failure: bool = False) -> str:
    """xe's `survivability_mode` as survivability_mode_show prints it (Linux
    drivers/gpu/drm/xe/xe_survivability_mode.c): the type line, then, for a boot failure, one
    `<name>: 0x<reg> - 0x<value>` line per scratch register (these register values are made
    up; the names are the kernel's)."""
    text = f"Survivability mode type: {mode}\n"
    if boot_failure:
        text += ("Capability Info: 0x138320 - 0x1e0f\n"
                 "Postcode Info: 0x138324 - 0x51\n"
                 "Auxiliary Info 0: 0x138330 - 0x0\n")
    return text


# --- the builder ----------------------------------------------------------------------------


class FakeHost:
    """A fake host tree under `root`. Methods return what they created (pid, path)."""

    def __init__(
        self, root: Path | str, boot_time: int | None = None, hostname: str = "xpu-node-07"
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # booted two days ago by default, so processes and files are in the past
        self._boot_time = int(time.time()) - 2 * 86400 if boot_time is None else int(boot_time)
        self.pids: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self._tcp: list[str] = []
        self._tcp6: list[str] = []
        self._unix: list[str] = []
        self._bridge_no = 0
        for d in (
            "proc/net",
            "sys/class/drm",
            "sys/bus/pci/drivers",
            "sys/bus/pci/devices",
            "sys/dev/char",
            "dev/dri/by-path",
            "dev/shm",
            "tmp",
            "run",
        ):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "tmp", 0o1777)
        os.chmod(self.root / "dev/shm", 0o1777)
        self._write("sys/class/drm/version", "drm 1.1.0 20060810\n")
        self._write("proc/sys/kernel/hostname", hostname + "\n")
        self._write_proc_stat()
        self._flush_net()

    # -- time helpers --

    @property
    def boot_time(self) -> int:
        """Epoch of boot: `btime` in proc/stat (setting it rewrites proc/stat and proc/uptime)."""
        return self._boot_time

    @boot_time.setter
    def boot_time(self, value: int) -> None:
        self._boot_time = int(value)
        self._write_proc_stat()

    def at(self, seconds_after_boot: float) -> float:
        """Epoch of `seconds_after_boot`."""
        return self.boot_time + seconds_after_boot

    @staticmethod
    def ticks(seconds_after_boot: float) -> int:
        return round(seconds_after_boot * HZ)

    # -- low-level writers --

    def path(self, hostpath: str) -> Path:
        return self.root / hostpath.lstrip("/")

    def _write(self, rel: str, data: str | bytes, mode: int | None = None) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            data = data.encode()
        p.write_bytes(data)
        if mode is not None:
            os.chmod(p, mode)
        return p

    def block(self, hostpath: str) -> Path:
        """Make one file a FIFO with no writer: opening it never returns, as a read of a
        wedged process's cmdline or of a device in reset does not. Returns the FIFO."""
        p = self.path(hostpath)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink() or p.exists():
            p.unlink()
        os.mkfifo(p)
        return p

    def _symlink(self, rel: str, target: str) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink() or p.exists():
            p.unlink()
        os.symlink(target, p)
        return p

    def _write_proc_stat(self) -> None:
        up = max(1, int(time.time() - self.boot_time))
        self._write(
            "proc/stat",
            "cpu  10132153 290696 3084719 46828483 16683 0 25195 0 0 0\n"
            "cpu0 5066076 145348 1542359 23414241 8341 0 12597 0 0 0\n"
            "cpu1 5066077 145348 1542360 23414242 8342 0 12598 0 0 0\n"
            "intr 199292 28 9 0 0 0 0 3 0 1 0 0 0 0\n"
            "ctxt 1990473\n"
            f"btime {self.boot_time}\n"
            "processes 2915\n"
            "procs_running 1\n"
            "procs_blocked 1\n"
            "softirq 1226436 0 230436 7 64237 47373 0 56417 456204 0 371762\n",
        )
        self._write("proc/uptime", f"{up}.42 {2 * up}.17\n")
        self._write("proc/loadavg", "0.52 0.58 0.59 2/389 9001\n")
        self._write(
            "proc/meminfo",
            "MemTotal:       263846144 kB\nMemFree:        201544320 kB\n"
            "MemAvailable:   240112160 kB\nShmem:            1048576 kB\n",
        )

    # -- devices --

    def add_device(
        self,
        node: str = "renderD128",
        card: str = "card0",
        bdf: str = "0000:03:00.0",
        vendor: int = 0x8086,
        device: int = 0xE20B,
        driver: str = "xe",
        vram_tiles: list[int] | None = None,
        lmem_total: int | None = None,
        bridge: str | None = None,
        connectors: list[str] = (),
        subsystem_vendor: int | None = None,
        subsystem_device: int = 0x1100,
        survivability: str | None = None,
        drm: bool = True,
        health: str | None = None,
    ) -> Path:
        """Make a DRM device: PCI function, drm nodes, class links, /dev/dri; return the PCI dir.
        `survivability`: the text of xe's survivability_mode (`survivability_text`); `drm=False`:
        no DRM node (xe in boot survivability mode makes none)."""
        if bridge is None:  # a root port per device; bridge="" puts it on the root bus (an iGPU)
            self._bridge_no += 1
            bridge = f"0000:00:{self._bridge_no:02x}.0"
        parent = f"pci0000:00/{bridge}" if bridge else "pci0000:00"
        pci_rel = f"devices/{parent}/{bdf}"
        pci = self.root / "sys" / pci_rel
        pci.mkdir(parents=True, exist_ok=True)
        self._write(f"sys/{pci_rel}/vendor", f"0x{vendor:04x}\n")
        self._write(f"sys/{pci_rel}/device", f"0x{device:04x}\n")
        self._write(f"sys/{pci_rel}/class", PCI_CLASS.get(driver, "0x030000") + "\n")
        sv = vendor if subsystem_vendor is None else subsystem_vendor
        self._write(f"sys/{pci_rel}/subsystem_vendor", f"0x{sv:04x}\n")
        self._write(f"sys/{pci_rel}/subsystem_device", f"0x{subsystem_device:04x}\n")
        self._write(f"sys/{pci_rel}/numa_node", "0\n")
        self._write(f"sys/{pci_rel}/enable", "1\n")
        self._write(
            f"sys/{pci_rel}/uevent",
            f"DRIVER={driver}\nPCI_CLASS=30000\nPCI_ID={vendor:04X}:{device:04X}\n"
            f"PCI_SUBSYS_ID={sv:04X}:{subsystem_device:04X}\nPCI_SLOT_NAME={bdf}\n"
            f"MODALIAS=pci:v{vendor:08X}d{device:08X}"
            f"sv{sv:08X}sd{subsystem_device:08X}bc03sc00i00\n",
        )
        (self.root / "sys/bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
        up = "../" * (pci_rel.count("/") + 1)  # from the PCI dir back to sys/
        self._symlink(f"sys/{pci_rel}/driver", f"{up}bus/pci/drivers/{driver}")
        self._symlink(f"sys/bus/pci/drivers/{driver}/{bdf}", f"../../../../{pci_rel}")
        self._symlink(f"sys/bus/pci/devices/{bdf}", f"../../../{pci_rel}")
        if driver == "xe" and vram_tiles:
            for t, size in enumerate(vram_tiles):
                self._write(f"sys/{pci_rel}/tile{t}/physical_vram_size_bytes", f"{size}\n")
        if health is not None:  # xe's gpu_health (issue 37): ok | warning | critical
            self._write(f"sys/{pci_rel}/gpu_health", health)
        if survivability is not None:  # DEVICE_ATTR_ADMIN_RO: root only
            self._write(f"sys/{pci_rel}/survivability_mode", survivability, mode=0o400)
        for name in (card, node) if drm else ():
            minor = (
                int(name[len("renderD") :])
                if name.startswith("renderD")
                else int(name[len("card") :])
            )
            ndir = f"sys/{pci_rel}/drm/{name}"
            self._write(f"{ndir}/dev", f"226:{minor}\n")
            self._write(
                f"{ndir}/uevent",
                f"MAJOR=226\nMINOR={minor}\nDEVNAME=dri/{name}\nDEVTYPE=drm_minor\n",
            )
            self._symlink(f"{ndir}/device", "../../../" + bdf)
            self._symlink(f"{ndir}/subsystem", "../" * (pci_rel.count("/") + 3) + "class/drm")
            self._symlink(f"sys/class/drm/{name}", f"../../{pci_rel}/drm/{name}")
            self._symlink(f"sys/dev/char/226:{minor}", f"../../{pci_rel}/drm/{name}")
            self._write(f"dev/dri/{name}", b"", mode=0o660)
            kind = "render" if name.startswith("renderD") else "card"
            self._symlink(f"dev/dri/by-path/pci-{bdf}-{kind}", f"../{name}")
        if lmem_total is not None:
            self._write(f"sys/{pci_rel}/drm/{card}/lmem_total_bytes", f"{lmem_total}\n")
            self._write(f"sys/{pci_rel}/drm/{card}/lmem_avail_bytes", f"{lmem_total}\n")
        for conn in connectors:
            cname = f"{card}-{conn}"
            cdir = f"sys/{pci_rel}/drm/{card}/{cname}"
            self._write(f"{cdir}/status", "disconnected\n")
            self._write(f"{cdir}/enabled", "disabled\n")
            self._symlink(f"{cdir}/device", f"../../{card}")
            self._symlink(f"sys/class/drm/{cname}", f"../../{pci_rel}/drm/{card}/{cname}")
        return pci

    # -- processes --

    def add_process(
        self,
        pid: int,
        ppid: int,
        cmdline: list[str],
        state: str = "S",
        uid: int = 1000,
        comm: str | None = None,
        environ: dict[str, str] | None = None,
        start_ticks: int = 100_000,
        threads: int = 1,
        pgrp: int | None = None,
        session: int | None = None,
        wchan: str | None = None,
        fds: dict[int, str] | None = None,
        fdinfo: dict[int, str] | None = None,
        maps: list[str] | None = None,
        tasks: list[int] | None = None,
        *,
        title: str | None = None,
        environ_zeroed: int | None = None,
        cmdline_bytes: bytes | None = None,
        gid: int | None = None,
        tty_nr: int = 0,
        exe: str | None = None,
        cwd: str = "/",
        rss_pages: int = 25_000,
        vsize: int = 2_000_000_000,
        name: str | None = None,
        nspid: tuple[int, ...] | None = None,
    ) -> int:
        """Write proc/<pid>. `title`: setproctitle'd process: cmdline is the title + NULs over the
        original argv area (`cmdline` is the original argv), comm the title cut to 15 bytes.
        `environ_zeroed=N`: environ is N NULs (setproctitle without SPT_NOENV). State "Z": no fds,
        empty cmdline/environ/maps, like the kernel shows a zombie. `nspid`: its ids in each PID
        namespace, outermost first (`(pid, 1)`: the init of a container's namespace)."""
        d = f"proc/{pid}"
        gid = uid if gid is None else gid
        pgrp = pid if pgrp is None else pgrp
        session = pgrp if session is None else session
        zombie = state == "Z"
        if comm is None:
            comm = title if title is not None else os.path.basename(cmdline[0]) if cmdline else "?"
        comm = comm.encode()[:15].decode("utf-8", errors="ignore")
        fds = {} if zombie or fds is None else dict(fds)
        fdinfo = {} if fdinfo is None else dict(fdinfo)

        # stat: 52 fields (proc(5)); comm may contain spaces and parens
        utime, stime = 1234, 567
        starttime = start_ticks
        fields = [
            str(pid),
            f"({comm})",
            state,
            str(ppid),
            str(pgrp),
            str(session),
            str(tty_nr),
            str(pgrp if tty_nr else -1),
            "4194560" if not zombie else "4227084",
            "183924",
            "0",
            "61",
            "0",
            str(utime),
            str(stime),
            "0",
            "0",
            "20",
            "0",
            str(threads),
            "0",
            str(starttime),
            "0" if zombie else str(vsize),
            "0" if zombie else str(rss_pages),
            "18446744073709551615",
            "94662839201792",
            "94662839205429",
            "140723413443632",
            "0",
            "0",
            "0",
            "0",
            "16781312",
            "134234626",
            "1" if wchan and not zombie else "0",
            "0",
            "0",
            "17",
            "1",
            "0",
            "0",
            "0",
            "0",
            "0",
            "94662839218640",
            "94662839219856",
            "94662868156416",
            "140723413449587",
            "140723413449680",
            "140723413449680",
            "140723413450731",
            "0",
        ]
        assert len(fields) == 52, len(fields)
        self._write(f"{d}/stat", " ".join(fields) + "\n")
        self._write(f"{d}/comm", comm + "\n")
        vm = (
            ""
            if zombie
            else (
                f"VmPeak:\t{vsize // 1024 + 4096} kB\nVmSize:\t{vsize // 1024} kB\n"
                f"VmRSS:\t{rss_pages * 4} kB\n"
            )
        )
        ns = " ".join(map(str, nspid or (pid,)))  # outermost namespace first
        self._write(
            f"{d}/status",
            f"Name:\t{(name or comm)}\nUmask:\t0022\nState:\t{STATE_NAMES.get(state, state)}\n"
            f"Tgid:\t{pid}\nNgid:\t0\nPid:\t{pid}\nPPid:\t{ppid}\nTracerPid:\t0\n"
            f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{gid}\t{gid}\t{gid}\t{gid}\n"
            f"FDSize:\t{64 if not zombie else 0}\nGroups:\t{gid} 44 109 \n"
            f"NStgid:\t{ns}\nNSpid:\t{ns}\nNSpgid:\t{pgrp}\nNSsid:\t{session}\n"
            f"{vm}Threads:\t{threads}\n"
            "SigQ:\t0/1030152\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n"
            "SigBlk:\t0000000000000000\nSigIgn:\t0000000001001000\nSigCgt:\t0000000180004002\n"
            "CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n",
        )
        # cmdline
        if cmdline_bytes is not None:
            raw = cmdline_bytes
        elif zombie or not cmdline:
            raw = b""
        elif title is not None:
            original = sum(len(a.encode()) + 1 for a in cmdline)
            raw = title.encode() + b"\0" * max(1, original - len(title.encode()))
        else:
            raw = b"".join(a.encode() + b"\0" for a in cmdline)
        self._write(f"{d}/cmdline", raw)
        # environ
        if zombie:
            env_raw = b""
        elif environ_zeroed is not None:
            env_raw = b"\0" * environ_zeroed
        elif environ is None:
            env_raw = b""
        else:
            env_raw = b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items())
        self._write(f"{d}/environ", env_raw, mode=0o400)
        self._write(f"{d}/wchan", "0" if (zombie or not wchan) else wchan)
        self._write(f"{d}/maps", "" if zombie else "".join(line + "\n" for line in (maps or [])))
        self._write(
            f"{d}/statm",
            "0 0 0 0 0 0 0\n" if zombie else f"{vsize // 4096} {rss_pages} 3000 500 0 40000 0\n",
        )
        self._write(f"{d}/oom_score_adj", "0\n")
        self._write(f"{d}/loginuid", f"{uid}\n")
        if not zombie and (cmdline or exe):
            self._symlink(
                f"{d}/exe",
                exe or (cmdline[0] if cmdline[0].startswith("/") else "/usr/bin/python3.11"),
            )
            self._symlink(f"{d}/cwd", cwd)
        (self.root / d / "fd").mkdir(parents=True, exist_ok=True)
        (self.root / d / "fdinfo").mkdir(parents=True, exist_ok=True)
        for fd, link in fds.items():
            self._symlink(f"{d}/fd/{fd}", link)
            text = fdinfo[fd] if fd in fdinfo else self._default_fdinfo(link, fd, pid)
            if text is not None:
                self._write(f"{d}/fdinfo/{fd}", text)
        # tasks: the main thread always; extra tids share the same stat
        for tid in [pid] + list(tasks or []):
            tdir = f"{d}/task/{tid}"
            tfields = list(fields)
            tfields[0] = str(tid)
            self._write(f"{tdir}/stat", " ".join(tfields) + "\n")
            self._write(f"{tdir}/comm", comm + "\n")
        self._chown_tree(self.root / d, uid, gid)
        return pid

    @staticmethod
    def _chown_tree(top: Path, uid: int, gid: int) -> None:
        """The kernel shows /proc/<pid> and its entries owned by the process' euid."""
        os.chown(top, uid, gid)
        for dirpath, dirnames, filenames in os.walk(top):  # never follows symlinks
            for name in dirnames + filenames:
                os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)

    @staticmethod
    def _default_fdinfo(link: str, fd: int, pid: int) -> str | None:
        if link.startswith("socket:[") and link.endswith("]"):
            return generic_fdinfo(int(link[8:-1]), flags="02000002", mnt_id=8)
        if link.startswith("pipe:[") and link.endswith("]"):
            return generic_fdinfo(int(link[6:-1]), flags="00", mnt_id=14)
        if link.startswith("anon_inode:"):
            return generic_fdinfo(1057, flags="02000002", mnt_id=15)
        return generic_fdinfo(100_000 + pid % 1000 * 100 + fd)

    def remove_process(self, pid: int) -> None:
        import shutil

        shutil.rmtree(self.root / "proc" / str(pid), ignore_errors=True)

    def set_environ_raw(self, pid: int, raw: bytes) -> None:
        self._write(f"proc/{pid}/environ", raw)

    # -- files --

    def add_file(
        self,
        hostpath: str,
        uid: int = 1000,
        size: int = 0,
        mtime: float | None = None,
        kind: str = "file",
        target: str | None = None,
        mode: int | None = None,
        gid: int | None = None,
    ) -> Path:
        """A regular file, socket (mknod S_IFSOCK, as bind() leaves it) or symlink under root."""
        p = self.path(hostpath)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink() or p.exists():
            p.unlink()
        gid = uid if gid is None else gid
        if kind == "file":
            with open(p, "wb") as f:
                if size:
                    f.truncate(size)
            os.chmod(p, 0o644 if mode is None else mode)
        elif kind == "socket":
            os.mknod(p, stat.S_IFSOCK | (0o755 if mode is None else mode))
        elif kind == "symlink":
            os.symlink(target or "/etc/passwd", p)
        elif kind == "dir":
            p.mkdir()
            os.chmod(p, 0o700 if mode is None else mode)
        else:
            raise ValueError(kind)
        os.chown(p, uid, gid, follow_symlinks=False)
        if mtime is not None:
            os.utime(p, (mtime, mtime), follow_symlinks=False)
        return p

    # -- sockets --

    @staticmethod
    def _hex4(addr: str) -> str:
        return f"{struct.unpack('<I', socket.inet_aton(addr))[0]:08X}"

    @staticmethod
    def _hex6(addr: str) -> str:
        raw = socket.inet_pton(socket.AF_INET6, addr)
        return "".join(f"{struct.unpack('<I', raw[i : i + 4])[0]:08X}" for i in range(0, 16, 4))

    def add_tcp(
        self,
        port: int,
        inode: int,
        addr: str = "0.0.0.0",
        v6: bool = False,
        st: int = 0x0A,
        rem_addr: str | None = None,
        rem_port: int = 0,
        uid: int = 1000,
    ) -> None:
        """One row of proc/net/tcp or tcp6; st 0A = LISTEN, 01 = ESTABLISHED, 06 = TIME_WAIT."""
        if v6:
            rows = self._tcp6
            local = f"{self._hex6(addr)}:{port:04X}"
            remote = f"{self._hex6(rem_addr or '::')}:{rem_port:04X}"
        else:
            rows = self._tcp
            local = f"{self._hex4(addr)}:{port:04X}"
            remote = f"{self._hex4(rem_addr or '0.0.0.0')}:{rem_port:04X}"
        sl = len(rows)
        if st == 0x06:  # TIME_WAIT: a timewait sock, no owner, no inode
            line = (
                f"{sl:4d}: {local} {remote} {st:02X} 00000000:00000000 03:00000F9A 00000000 "
                f"{0:5d} {0:8d} 0 3 0000000000000000"
            )
        else:
            line = (
                f"{sl:4d}: {local} {remote} {st:02X} 00000000:00000000 00:00000000 00000000 "
                f"{uid:5d} {0:8d} {inode} 1 0000000000000000 100 0 0 10 0"
            )
        rows.append(line if v6 else line.ljust(149))
        self._flush_net()

    def add_tcp_listen(
        self, port: int, inode: int, addr: str = "0.0.0.0", v6: bool = False, uid: int = 1000
    ) -> None:
        self.add_tcp(port, inode, addr=addr, v6=v6, st=0x0A, uid=uid)

    def add_unix_socket(
        self, path: str | None, inode: int, listening: bool = True, type_: int = 1
    ) -> None:
        """A row of proc/net/unix. `path` None: unnamed; '@name': abstract."""
        flags = 0x00010000 if listening else 0
        st = 1 if listening or path is None else 3
        line = f"0000000000000000: 00000002 00000000 {flags:08X} {type_:04X} {st:02X} {inode:5d}"
        if path:
            line += " " + path
        self._unix.append(line)
        self._flush_net()

    def _flush_net(self) -> None:
        hdr = (
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
            "   uid  timeout inode"
        ).ljust(149)
        hdr6 = (
            "  sl  local_address                         remote_address                        "
            "st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
        )
        self._write("proc/net/tcp", "".join(line + "\n" for line in [hdr] + self._tcp))
        self._write("proc/net/tcp6", "".join(line + "\n" for line in [hdr6] + self._tcp6))
        self._write(
            "proc/net/unix",
            "".join(
                line + "\n"
                for line in ["Num       RefCount Protocol Flags    Type St Inode Path"] + self._unix
            ),
        )
        self._write(
            "proc/net/udp",
            "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when "
            "retrnsmt   uid  timeout inode ref pointer drops             \n",
        )
