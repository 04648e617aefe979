"""Typed records of what a scan saw. No I/O, no rich.

"Unknown" is `None`; why a value is unknown is recorded as an `Issue` on the scan.

Records are `typing.NamedTuple`s: immutable and typed like frozen dataclasses, and about ten
times cheaper to define (0.06 ms against 0.6 ms per class on Python 3.11), which every
command pays at start-up. Change one with `_replace`. A record holding a dict (`Process.env`,
`Scan.caller_env`) is not hashable.
"""

from __future__ import annotations

import stat as _stat
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from xpuctl.core.collective import CollectiveResult
from xpuctl.core.runrecords import RecordIssue, RunHealth

if TYPE_CHECKING:  # records of the parsers, held in fields; not imported by every command
    from xpuctl.parse.kmsg import GpuEvent
    from xpuctl.parse.probes import ProbeProcess, ProbeResult
    from xpuctl.parse.vllmlog import LogSignature

# An environment with nothing in it (a request's default, read only).
EMPTY_ENV: Mapping[str, str] = MappingProxyType({})

class Issue(NamedTuple):
    """Something the scan could not read, and why (and what to do, when the source's usual
    remedy does not apply: core/checks/inspection)."""

    source: str
    reason: str
    remedy: str | None = None


class Device(NamedTuple):
    """One DRM device (a PCI function) with its card and render nodes."""

    bdf: str
    vendor_id: str | None
    device_id: str | None
    driver: str | None
    render_node: str | None
    card_node: str | None
    minors: tuple[int, ...]
    memory_total_bytes: int | None
    index: int | None = None  # type: ignore[assignment]  # a field named index shadows tuple.index, never called on a record; Level Zero order (Intel devices sorted by BDF); None otherwise
    # xe's survivability_mode (Boot | Runtime | unknown) while the card is in it, else None:
    # only a firmware flash brings it back (parse/survivability.py)
    survivability: str | None = None
    # xe's gpu_health in its PCI directory: ok | warning | critical | unknown (a text that
    # names none); None: no such file (parse/health.py)
    health: str | None = None

    @property
    def is_intel(self) -> bool:
        # a vendor file that did not answer (a device in reset) does not hide an xe/i915 GPU
        return self.vendor_id == "0x8086" or (self.vendor_id is None and self.driver in ("xe", "i915"))

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for n in (self.render_node, self.card_node) if n)


class DrmClient(NamedTuple):
    """One DRM file (`struct drm_file`), possibly reached through several fds/processes."""

    bdf: str | None
    client_id: int | None
    driver: str | None
    memory_bytes: int | None  # drm-total of the device regions: private + shared
    pids: tuple[int, ...]
    node: str
    shared_bytes: int | None = None  # drm-shared: the part of memory_bytes shared with others
    resident_bytes: int | None = None  # drm-resident
    memory_source: str | None = None  # fdinfo | sysfs-clients (the i915 backport's clients dir)
    imported_bytes: int | None = None  # sysfs-clients: imported_bytes (buffers of other clients)


class DmabufHold(NamedTuple):
    """A dma-buf exported by a GPU driver and held open by a process."""

    pid: int
    exporter: str
    size_bytes: int | None
    inode: int | None
    bdf: str | None


class RayActor(NamedTuple):
    """The Ray actor a process runs, from Ray's state API (xpuctl.ray.actors)."""

    actor_id: str
    name: str | None
    class_name: str | None
    job_id: str | None
    node_id: str | None
    namespace: str | None = None
    driver_pid: int | None = None  # its job's driver (for vLLM, the EngineCore)
    driver_gone: bool = False  # the job ended or its driver is not alive


class Container(NamedTuple):
    """The container a process runs in: from its cgroup (runtime, id), named by the runtime's
    own state (host/containers.py). A name, never a reason to signal anything."""

    runtime: str | None  # docker | containerd | cri-o | podman; None: a pod's, runtime unknown
    id: str
    name: str | None  # the container's name (in a pod: the pod spec's container name)
    pod: str | None
    namespace: str | None

    @property
    def label(self) -> str:
        """`pod serving/llama-0, container vllm`; outside a pod `container vllm (docker)`."""
        who = self.name or self.id[:12]
        if self.pod:
            where = f"{self.namespace}/{self.pod}" if self.namespace else self.pod
            return f"pod {where}, container {who}"
        return f"container {who}" + (f" ({self.runtime})" if self.runtime else "")

    @property
    def short(self) -> str:
        """For a table cell: `serving/llama-0/vllm`, or the container's name or short id."""
        who = self.name or self.id[:12]
        if self.pod:
            return "/".join(x for x in (self.namespace, self.pod, who) if x)
        return who


class Launcher(NamedTuple):
    """The live process that runs vLLM as a library and launched a tree (core/trees): an
    `LLM(...)` script, an app with an AsyncLLM, a Ray Serve replica. It owns the tree."""

    pid: int
    command: str
    blocked: bool = False  # a read of it did not answer: what it is, is unknown

    def describe(self, width: int = 60) -> str:
        """`vLLM embedded in pid 4242 (python3 batch.py)`; for one that did not answer,
        `vLLM under pid 4242 ([python3]), which did not answer a read`."""
        cmd = self.command if len(self.command) <= width else self.command[: width - 1] + "…"
        if self.blocked:
            return f"vLLM under pid {self.pid} ({cmd}), which did not answer a read"
        return f"vLLM embedded in pid {self.pid} ({cmd})"


class Process(NamedTuple):
    pid: int
    ppid: int
    state: str
    comm: str
    cmdline: tuple[str, ...]
    start_time: float | None  # seconds since the epoch
    start_ticks: int
    session: int
    pgrp: int
    threads: int
    uid: int | None = None
    role: str | None = None
    rank: str | None = None
    orphan: bool = False
    top: int | None = None  # top-most vLLM ancestor (the API server of a live server)
    run_id: str | None = None
    devices: tuple[str, ...] = ()
    memory_bytes: int | None = None
    wchan: str | None = None
    env: dict[str, str] | None = None  # read only when asked for (doctor's env check)
    ray: RayActor | None = None  # the Ray actor it runs, when Ray's state was asked
    blocked: str | None = None  # a file of it that did not answer: its role is unknown
    container: Container | None = None  # its container or pod (listed processes only)
    cmdline_bytes: int = 0  # the whole command line's length (0: cmdline is all of it)
    # vLLM run as a library: the live process its tree is embedded in (never an orphan)
    embedded_in: Launcher | None = None
    run_proven: bool = False  # a live run's record vouches for its run_id (RecordedRun)
    # devices it is tied to without holding them (yet): named by its ZE_AFFINITY_MASK, or
    # claimed by its proven run's record
    claims: tuple[str, ...] = ()
    # the run whose live supervisor is stopping it, its API server gone (core/trees): no orphan
    stopping_by: str | None = None

    @property
    def is_zombie(self) -> bool:
        return self.state == "Z"

    @property
    def command(self) -> str:
        """argv as one line for people, capped (`…[+N bytes]` when cut); [comm] without."""
        if not self.cmdline:
            return f"[{self.comm}]"
        from xpuctl.parse.procfs import shown_command

        return shown_command(self.cmdline, self.cmdline_bytes)

    @property
    def shown_argv(self) -> tuple[tuple[str, ...], int]:
        """(argv as every output shows it, capped; the bytes not shown): procfs.shown_argv."""
        from xpuctl.parse.procfs import shown_argv

        return shown_argv(self.cmdline, self.cmdline_bytes)

    @property
    def proven_run(self) -> str | None:
        """Its run id, when a live run's record vouches for it; None otherwise (a tag alone
        proves nothing: any process may carry one)."""
        return self.run_id if self.run_proven else None

    @property
    def tied(self) -> frozenset[str]:
        """The devices it holds or claims: what `--device` scopes by."""
        return frozenset(self.devices) | frozenset(self.claims)


class Unreadable(NamedTuple):
    """A process the scan could not read in full: a file that did not answer within the
    bound (`blocked`: it may be stuck in the kernel, and may hold anything), or fds it may
    not read (another user's process)."""

    pid: int
    command: str | None  # its argv, when that was read
    comm: str | None  # from its stat, when that answered
    state: str | None
    wchan: str | None
    file: str  # host path of the file that was not read
    reason: str
    blocked: bool
    fds_known: bool  # its open files were read (which devices it holds is known)


class Artifact(NamedTuple):
    """A file in /dev/shm or /tmp whose name a stale-file rule knows (core/rules.py)."""

    path: str  # host path
    # shm | libfabric | ccl-shm | filestore | ccl-socket | ccl-probe | zmq-socket | cache
    kind: str
    stale: bool
    reason: str
    open_by: tuple[int, ...]  # open or mapped by these processes
    owner_uid: int
    size_bytes: int
    age_seconds: float | None
    inode: int | None = None
    dev: int | None = None  # st_dev: with the inode, which file was judged
    kept_by: tuple[int, ...] = ()  # the live processes that keep it from being stale
    unseen: int = 0  # kept only because this many processes could not be inspected


class Port(NamedTuple):
    port: int
    address: str | None
    pid: int | None
    state: str  # listen | free
    role: str | None = None
    orphan: bool = False
    kind: str | None = None  # oneccl-kvs: oneCCL's KVS listener, by proof (core/oneccl.py)


class Finding(NamedTuple):
    check: str
    severity: str  # info | warn | fail
    message: str
    remedy: str | None = None
    device: str | None = None
    pids: tuple[int, ...] = ()
    paths: tuple[str, ...] = ()


class RuntimeView(NamedTuple):
    """One device as the deep probes see it, reconciled with what fdinfo shows (`xpuctl.probes.reconcile`)."""

    bdf: str
    source: str | None  # the probe whose used memory counts: kmd, else sysman, else torch
    memory_used_bytes: int | None  # by that probe, the probes' own allocations taken out
    memory_total_bytes: int | None
    processes: tuple[ProbeProcess, ...]  # pids the device reports (not the probes' own)
    process_source: str | None
    state: str  # ok | lost | survivability (xpu-smi v2 device_state: firmware needs recovery)
    lost_reasons: tuple[str, ...]  # "probe: why", one per probe that saw it lost (or in survivability)
    visible_bytes: int  # fdinfo memory of the holders doctor can see
    baseline_bytes: int  # the idle baseline recorded by `devices --deep --record-baseline`
    unattributed_bytes: int | None  # used − visible − baseline (never below 0)
    invisible_pids: tuple[int, ...]  # reported by a probe, absent from /proc
    # Sysman's health extension (zesDeviceGetHealthStatusExt): ok | warning | critical |
    # failed, kept across resets; None: not reported (parse/health.py)
    health: str | None = None


class Version(NamedTuple):
    """One piece of the software stack and its version (probes/versions.py)."""

    name: str  # kernel | xe | i915 | level-zero-loader | level-zero-gpu | oneccl | torch | ...
    version: str | None
    source: str | None  # where it was read (a path, a package, a command)
    why: str | None = None  # why it is unknown


class Deep(NamedTuple):
    """What `--deep` added to a scan: every probe's result and the per-device reconciliation."""

    probes: tuple[ProbeResult, ...]
    devices: tuple[RuntimeView, ...]
    probe_pids: tuple[int, ...] = ()  # the probe children, left out of every result
    lost_unplaced: tuple[str, ...] = ()  # "probe: why" for lost devices without a PCI address
    versions: tuple[Version, ...] = ()  # the software stack (kernel, driver, runtimes, packages)

    def device(self, bdf: str) -> RuntimeView | None:
        return next((d for d in self.devices if d.bdf == bdf), None)
class LastRun(NamedTuple):
    """The most recent run in the state directory, as far as the relaunch advice needs it:
    its newest record and the tail of its log (probes.lastrun)."""

    name: str
    state: str  # starting | ready | stopping | stopped | failed
    log_path: str
    not_ready: bool  # it ended in a readiness timeout
    phase: str  # label of the furthest start-up phase its log reached
    signatures: tuple[LogSignature, ...]
    ended_at: float | None = None
    devices: tuple[str, ...] = ()  # the BDFs it claimed (what doctor --device scopes by)


class KernelLog(NamedTuple):
    """What the kernel log said about the GPUs (parse/kmsg.py): their driver records in log
    order, and the boot time that dates them."""

    events: tuple[GpuEvent, ...]
    boot_time: float | None  # seconds since the epoch (/proc/stat btime)

    def _since_init(self, bdf: str) -> list[GpuEvent]:
        """The device's records after its last "Initialized" (a rebind starts afresh)."""
        from xpuctl.parse.kmsg import INITIALIZED

        mine = [e for e in self.events if e.bdf == bdf]
        last = max((i for i, e in enumerate(mine) if e.kind == INITIALIZED), default=-1)
        return mine[last + 1:]

    def wedged(self, bdf: str) -> GpuEvent | None:
        """The first record that declared the device wedged, when it was not initialised again."""
        from xpuctl.parse.kmsg import WEDGED

        return next((e for e in self._since_init(bdf) if e.kind == WEDGED), None)

    def wedge_method(self, bdf: str) -> str | None:
        """The recovery the driver asked for since the device was last initialised (the
        last wedged record that names one: `WEDGED=<method>`), else None."""
        return next((e.method for e in reversed(self._since_init(bdf)) if e.method), None)

    def hangs(self, bdf: str) -> tuple[GpuEvent, ...]:
        """Hang and reset records of the device since it was last initialised."""
        from xpuctl.parse.kmsg import HANG

        return tuple(e for e in self._since_init(bdf) if e.kind == HANG)

    def wall_time(self, event: GpuEvent) -> float | None:
        return self.boot_time + event.record.seconds if self.boot_time is not None else None


class ShmRoom(NamedTuple):
    """The filesystem under /dev/shm (statvfs): vLLM's MessageQueue rings and libfabric's
    regions live there (core/shmroom.py)."""

    path: str  # host path
    size_bytes: int
    free_bytes: int  # what an unprivileged writer may still use (f_bavail)


class Coredump(NamedTuple):
    """A GPU crash dump the kernel holds for a device (devcoredump) until it is read or freed."""

    bdf: str
    path: str  # host path of its data file
    age_seconds: float | None


class Scan(NamedTuple):
    """Everything one scan saw, before any judgement."""

    root: str
    taken_at: float
    devices: tuple[Device, ...]
    processes: tuple[Process, ...]  # vLLM processes and device holders
    clients: tuple[DrmClient, ...]
    dmabufs: tuple[DmabufHold, ...]
    artifacts: tuple[Artifact, ...]
    ports: tuple[Port, ...]
    issues: tuple[Issue, ...]
    unreadable: int  # processes whose fds could not be read
    caller_env: dict[str, str] | None = None  # the environment of the command that scanned
    deep: Deep | None = None  # device-level view, only with --deep
    last_run: LastRun | None = None  # the state directory's newest run (doctor, reset)
    unreadable_processes: tuple[Unreadable, ...] = ()
    blocked: tuple[Issue, ...] = ()  # every read that did not answer (path, reason)
    kernel: KernelLog | None = None  # the kernel log's GPU records (doctor); None: not read
    coredumps: tuple[Coredump, ...] = ()  # pending devcoredumps of the devices (doctor)
    collective: CollectiveResult | None = None  # doctor --collective
    records: tuple[RecordIssue, ...] = ()  # the state directory's stale and damaged records
    runs: tuple[RunHealth, ...] = ()  # the live runs of the state directory (doctor)
    shm: ShmRoom | None = None  # /dev/shm's size and room (doctor); None: not read

    def process(self, pid: int) -> Process | None:
        for p in self.processes:
            if p.pid == pid:
                return p
        return None

    def device(self, bdf: str) -> Device | None:
        for d in self.devices:
            if d.bdf == bdf:
                return d
        return None

    def holders(self, bdf: str) -> tuple[int, ...]:
        return tuple(sorted(p.pid for p in self.processes if bdf in p.devices))

    def unknown_holders(self, bdf: str) -> tuple[int, ...]:
        """Processes that may hold the device, as far as the scan knows: those that did not
        answer a read and hold it, or whose open files are unknown."""
        held = set(self.holders(bdf))
        return tuple(sorted(u.pid for u in self.unreadable_processes
                            if u.blocked and (not u.fds_known or u.pid in held)))

    def blocked_pids(self) -> tuple[int, ...]:
        return tuple(sorted({u.pid for u in self.unreadable_processes if u.blocked}))

    def memory_used(self, bdf: str) -> int | None:
        """De-duplicated device memory: each DRM client's drm-total-vram*/local* counted once,
        and its shared part (drm-shared) once for the device: a buffer shared by two clients is
        in both their drm-total, and the kernel does not say which buffer, so the device counts
        every client's private part plus the largest shared part (the least the shared buffers
        can be); `memory_shared` is the sum of the shared parts, shown apart.

        dma-bufs are not added: an exported buffer is already in its exporter's drm-total.
        """
        clients = [c for c in self.clients if c.bdf == bdf and c.memory_bytes is not None]
        if not clients:
            return None
        shared = [min(c.shared_bytes or 0, c.memory_bytes or 0) for c in clients]
        return sum((c.memory_bytes or 0) for c in clients) - sum(shared) + max(shared)

    def memory_shared(self, bdf: str) -> int | None:
        """The clients' drm-shared device memory, summed (a buffer may be in several)."""
        sizes = [c.shared_bytes for c in self.clients if c.bdf == bdf and c.shared_bytes is not None]
        return sum(sizes) if sizes else None

    def memory_source(self, bdf: str) -> str | None:
        """Where the device's client memory was read: fdinfo, sysfs-clients, or both."""
        sources = sorted({c.memory_source for c in self.clients if c.bdf == bdf and c.memory_source})
        return "+".join(sources) or None

    def memory_resident(self, bdf: str) -> int | None:
        """The clients' drm-resident device memory, summed (shared buffers may repeat)."""
        sizes = [c.resident_bytes for c in self.clients if c.bdf == bdf and c.resident_bytes is not None]
        return sum(sizes) if sizes else None


class Report(NamedTuple):
    """A scan judged: findings and a status."""

    scan: Scan
    findings: tuple[Finding, ...]
    status: str  # clean | busy | dirty | unknown (a read did not answer)

    @property
    def failed(self) -> bool:
        return any(f.severity == "fail" for f in self.findings)

    @property
    def warned(self) -> bool:
        return any(f.severity == "warn" for f in self.findings)


class FileInfo(NamedTuple):
    """What `lstat` says about a file, in host terms."""

    mode: int
    uid: int
    size: int
    mtime: float
    inode: int
    dev: int

    @property
    def is_regular(self) -> bool:
        return _stat.S_ISREG(self.mode)

    @property
    def is_socket(self) -> bool:
        return _stat.S_ISSOCK(self.mode)
