"""/proc/<pid>/cgroup -> the container a process runs in (text in, `CgroupRef` out).

Each line is `hierarchy-ID:controller-list:cgroup-path` (Linux
Documentation/admin-guide/cgroup-v2.rst, "/proc/$PID/cgroup"; cgroups(7)): one line `0::/path`
on cgroup v2, one line per hierarchy on v1 (`12:memory:/path`, `1:name=systemd:/path`).
The container is named by the last path component a runtime or kubelet gives it:

- systemd cgroup driver: a scope `docker-<id>.scope` (docker), `cri-containerd-<id>.scope`
  (containerd's CRI: kubelet's SystemdPathPrefixOfRuntime), `crio-<id>.scope` (CRI-O),
  `libpod-<id>.scope` (podman), under `kubepods[-<qos>]-pod<uid>.slice` for a pod, whose uid
  has its dashes turned into underscores (kubelet pkg/kubelet/cm/cgroup_manager_linux.go,
  escapeSystemdCgroupName);
- cgroupfs driver: `/kubepods[/<qos>]/pod<uid>/<id>` (the runtime is not named), `/docker/<id>`,
  and CRI-O's `crio-<id>` directory.

`crio-conmon-<id>.scope` is CRI-O's monitor process, not the container. A process in a private
cgroup namespace shows `0::/` and names nothing: that is None, as is a host process.
Container ids are hex (12 to 64 digits): anything else is not taken, so an id can be put in a
path safely.
"""

from __future__ import annotations

import re
from typing import NamedTuple

DOCKER, CONTAINERD, CRIO, PODMAN = "docker", "containerd", "cri-o", "podman"

_HEX_ID = r"[0-9a-f]{12,64}"
_SCOPE = re.compile(rf"^(docker|cri-containerd|crio|libpod)-({_HEX_ID})(?:\.scope)?$")
_BARE = re.compile(rf"^{_HEX_ID}$")
_POD_FS = re.compile(r"^pod([0-9a-f][0-9a-f-]{7,63})$")
_POD_SD = re.compile(r"^kubepods(?:-[a-z]+)?-pod([0-9a-f][0-9a-f_]{7,63})\.slice$")
_PREFIX_RUNTIME = {"docker": DOCKER, "cri-containerd": CONTAINERD, "crio": CRIO, "libpod": PODMAN}


class CgroupRef(NamedTuple):
    """A container as its cgroup path names it."""

    runtime: str | None  # docker | containerd | cri-o | podman; None: a cgroupfs pod path
    id: str
    pod_uid: str | None  # with dashes (as the API server shows it)
    path: str  # the cgroup path it was read from


def _from_path(path: str) -> CgroupRef | None:
    parts = [p for p in path.split("/") if p]
    pod_uid = None
    in_kubepods = False
    found: CgroupRef | None = None
    for i, part in enumerate(parts):
        if part.startswith("kubepods"):
            in_kubepods = True
        m = _POD_SD.match(part)
        if m:
            pod_uid = m.group(1).replace("_", "-")
            continue
        m = _POD_FS.match(part)
        if m and in_kubepods:
            pod_uid = m.group(1)
            continue
        m = _SCOPE.match(part)
        if m:
            found = CgroupRef(_PREFIX_RUNTIME[m.group(1)], m.group(2), pod_uid, path)
            continue
        if _BARE.match(part) and i > 0 and found is None:
            parent = parts[i - 1]
            if parent == "docker":
                found = CgroupRef(DOCKER, part, None, path)
            elif pod_uid is not None and (_POD_FS.match(parent) or _POD_SD.match(parent)):
                found = CgroupRef(None, part, pod_uid, path)
    return found


def parse_cgroup(text: str) -> CgroupRef | None:
    """The container of a process from its /proc/<pid>/cgroup; None when it names none.

    The cgroup v2 line comes first when there is one (it is what the runtime placed the process
    in on a unified or hybrid host); then the v1 lines in their order."""
    lines = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        lines.append((fields[0] != "0", fields[2]))
    for _, path in sorted(lines, key=lambda x: x[0]):
        ref = _from_path(path)
        if ref is not None:
            return ref
    return None


class PodLogDir(NamedTuple):
    namespace: str
    pod: str
    uid: str


_POD_LOG = re.compile(r"^([a-z0-9][a-z0-9-]*)_([a-z0-9][a-z0-9.-]*)_([0-9a-f][0-9a-f-]{7,63})$")


def parse_pod_log_dir(name: str) -> PodLogDir | None:
    """A directory under /var/log/pods: `<namespace>_<pod>_<uid>` (kubelet
    pkg/kubelet/kuberuntime/helpers.go, BuildPodLogsDirectory). Namespaces and pod names are
    DNS labels and subdomains, which hold no `_`, so the split is unambiguous."""
    m = _POD_LOG.match(name)
    if m is None:
        return None
    return PodLogDir(m.group(1), m.group(2), m.group(3))
