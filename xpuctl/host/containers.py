"""Which container or pod a process runs in: its /proc/<pid>/cgroup, then the runtime's own
state for the names, all read through the host (re-rooted by --root, bounded like every read
of a scan). Layouts and sources: docs/containers.md.

Cost: the cgroup file is read only for the processes a scan lists (vLLM processes and device
holders), and a runtime's state once per container id.
"""

from __future__ import annotations

from xpuctl.core.model import Container
from xpuctl.host.seam import Host
from xpuctl.parse.cgroup import CONTAINERD, CRIO, DOCKER, CgroupRef, parse_cgroup, parse_pod_log_dir
from xpuctl.parse.runtimestate import Names, bundle_names, docker_names

#: containerd's v2 shim task bundles: <dir>/<namespace>/<id>/config.json (k8s.io for CRI)
CONTAINERD_TASKS = "/run/containerd/io.containerd.runtime.v2.task"
#: CRI-O (containers/storage): <dir>/<id>/userdata/config.json, the run root first
CRIO_STORAGE = ("/run/containers/storage/overlay-containers",
                "/var/lib/containers/storage/overlay-containers")
DOCKER_CONTAINERS = "/var/lib/docker/containers"  # <dir>/<id>/config.v2.json
POD_LOGS = "/var/log/pods"  # <namespace>_<pod>_<uid>/<container>/
#: The largest state file read (a bundle holds the container's environment and mounts; a
#: larger one is not parsed, and the container keeps its id only).
STATE_LIMIT = 1 << 20


class ContainerLookup:
    """One scan's lookups: each container id's names are read once."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._names: dict[tuple[str | None, str], tuple[str | None, Names | None]] = {}
        self._namespaces: list[str] | None = None
        self._pod_logs: dict[str, str] | None = None  # pod uid -> its log directory name
        #: cgroup file text -> what it names: the processes of one service or container
        #: share it, so each text is parsed once
        self._refs: dict[str, CgroupRef | None] = {}

    def of(self, text: str | None) -> Container | None:
        """The container of a process whose /proc/<pid>/cgroup reads `text` (the scan's
        procfiles.Facts), or None (a host process, or its cgroup unreadable)."""
        if text is None:
            return None
        if text not in self._refs:
            self._refs[text] = parse_cgroup(text)
        ref = self._refs[text]
        if ref is None:
            return None
        key = (ref.runtime, ref.id)
        if key not in self._names:
            runtime, names = self._lookup(ref)
            if ref.pod_uid and (names is None or not (names.pod and names.namespace)):
                names = self._from_pod_logs(ref.pod_uid, names)
            self._names[key] = runtime, names
        runtime, names = self._names[key]
        return Container(runtime, ref.id, names.name if names else None,
                         names.pod if names else None, names.namespace if names else None)

    # -- the runtimes' state ------------------------------------------------------------
    def _read(self, path: str) -> bytes | None:
        try:
            data = self.host.read_bytes(path, STATE_LIMIT + 1)
        except OSError:
            return None
        return data if len(data) <= STATE_LIMIT else None

    def _lookup(self, ref: CgroupRef) -> tuple[str | None, Names | None]:
        order = {DOCKER: (DOCKER,), CONTAINERD: (CONTAINERD,), CRIO: (CRIO,)}.get(
            ref.runtime or "", (CONTAINERD, CRIO, DOCKER) if ref.runtime is None else ())
        for runtime in order:
            names = {CONTAINERD: self._containerd, CRIO: self._crio, DOCKER: self._docker}[runtime](ref.id)
            if names is not None:
                return runtime, names
        return ref.runtime, None

    def _containerd(self, cid: str) -> Names | None:
        if self._namespaces is None:
            try:
                listed = self.host.listdir(CONTAINERD_TASKS)
            except OSError:
                listed = []
            # k8s.io (the CRI's) first; a namespace name never holds a slash
            self._namespaces = sorted((n for n in listed if "/" not in n and n not in (".", "..")),
                                      key=lambda n: (n != "k8s.io", n))
        for ns in self._namespaces:
            data = self._read(f"{CONTAINERD_TASKS}/{ns}/{cid}/config.json")
            if data is not None:
                return bundle_names(data) or Names(None, None, None)
        return None

    def _crio(self, cid: str) -> Names | None:
        for d in CRIO_STORAGE:
            data = self._read(f"{d}/{cid}/userdata/config.json")
            if data is not None:
                return bundle_names(data) or Names(None, None, None)
        return None

    def _docker(self, cid: str) -> Names | None:
        data = self._read(f"{DOCKER_CONTAINERS}/{cid}/config.v2.json")
        if data is None:
            return None
        return docker_names(data) or Names(None, None, None)

    # -- when nothing else answers: kubelet's log directories -----------------------------
    def _from_pod_logs(self, uid: str, names: Names | None) -> Names | None:
        if self._pod_logs is None:
            try:
                listed = self.host.listdir(POD_LOGS)
            except OSError:
                listed = []
            self._pod_logs = {}
            for listed_name in listed:
                found = parse_pod_log_dir(listed_name)
                if found is not None:
                    self._pod_logs[found.uid] = listed_name
        entry = self._pod_logs.get(uid)
        if entry is None:
            return names
        parsed = parse_pod_log_dir(entry)
        assert parsed is not None
        name = names.name if names else None
        if name is None:
            # one container directory: that is the container (several: which one is not said)
            try:
                dirs = [d for d in self.host.listdir(f"{POD_LOGS}/{entry}") if "/" not in d]
            except OSError:
                dirs = []
            name = dirs[0] if len(dirs) == 1 else None
        return Names(name, (names.pod if names else None) or parsed.pod,
                     (names.namespace if names else None) or parsed.namespace)
