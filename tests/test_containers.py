"""Containers and pods: /proc/<pid>/cgroup and the runtimes' own state, through doctor, ps
and devices (table, JSON, Prometheus) and a snapshot round trip.

Samples and where they were read (each test names its own):
- kubelet pkg/kubelet/cm/cgroup_manager_linux.go: ToSystemd's example
  `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_abcd_5678_efgh.slice`
  (dashes of the pod uid become underscores, escapeSystemdCgroupName) and
  SystemdPathPrefixOfRuntime (`cri-containerd`, `crio`).
- a runc state.json of a containerd CRI container quoted in a public test fixture: pod
  hostname-lb-edge-64df67bd8b-xmzhv in namespace default, container hostname, bundle
  /run/containerd/io.containerd.runtime.v2.task/k8s.io/6a825448…, cgroup
  /kubepods/pod005f082b-5fd9-4650-8ef4-473e63bc2d13/6a825448… (cgroupfs driver, v1).
- "Understanding resource limits in kubernetes: memory" (Mark Betz), as quoted in a notes
  repository: `6:memory:/kubepods/burstable/podfbc202d3-…/0a1b22ec…` from /proc/9513/cgroup.
- CJLove/rt-operator notes/cgroupv1_notes.md: `kubepods.slice/kubepods-podXXX.slice/
  docker-YYY.scope` (Kubernetes 1.23 with Docker), `…/crio-YYY.scope` (1.25 with CRI-O).
- kubelet pkg/kubelet/kuberuntime/helpers.go BuildPodLogsDirectory: `<ns>_<pod>_<uid>`.
- CRI-O's annotation keys (cri-o pkg/annotations: io.kubernetes.cri-o.Labels, a JSON object
  of the pod's labels) and kubelet's label keys (pkg/kubelet/types/labels.go); containerd's
  CRI annotation keys (io.kubernetes.cri.sandbox-name, -namespace, container-name).
"""

from __future__ import annotations

import io
import json
import tarfile

import fakehost as fh
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_snapshot import assert_same_as_live, cli, pinned_now, take  # noqa: F401 (fixture)

from xpuctl.parse.cgroup import CgroupRef, parse_cgroup, parse_pod_log_dir
from xpuctl.parse.runtimestate import bundle_names, docker_names, reduce_bundle, reduce_docker

# the real ids and uids of the samples above
CTR_ID = "6a825448c5ef07ac0c3b99532b18bdec0e1d0bb1eb41b4672d570634a1409a85"
CTR_POD_UID = "005f082b-5fd9-4650-8ef4-473e63bc2d13"
BETZ_UID = "fbc202d3-da21-11e8-ab5e-42010a80014b"
BETZ_ID = "0a1b22ec1361a97c3511db37a4bae932d41b22264e5b97611748f8b662312574"
POD_UID = "74c13223-5a00-11e9-b385-42010a80018d"
DOCKER_ID = "34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376"
CRIO_ID = "432816899dbe1fa3bbd053b5d0ed027165b2216ebcab7973bcb921abe751e76b"


def systemd_pod(uid: str, qos: str = "burstable") -> str:
    """kubelet's systemd form of a pod's cgroup (cgroup_manager_linux.go ToSystemd)."""
    u = uid.replace("-", "_")
    return f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{u}.slice"


# --- the parser: golden samples ----------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    # cgroup v1, cgroupfs driver, containerd (the runc state.json sample): runtime not named
    (f"12:memory:/kubepods/pod{CTR_POD_UID}/{CTR_ID}\n11:devices:/kubepods/pod{CTR_POD_UID}/{CTR_ID}\n",
     CgroupRef(None, CTR_ID, CTR_POD_UID, f"/kubepods/pod{CTR_POD_UID}/{CTR_ID}")),
    # cgroup v1 with a QoS level (Betz's /proc/9513/cgroup line)
    (f"6:memory:/kubepods/burstable/pod{BETZ_UID}/{BETZ_ID}\n",
     CgroupRef(None, BETZ_ID, BETZ_UID, f"/kubepods/burstable/pod{BETZ_UID}/{BETZ_ID}")),
    # cgroup v2, systemd driver, containerd (kubelet's ToSystemd example form, cri-containerd)
    (f"0::{systemd_pod(POD_UID)}/cri-containerd-{CTR_ID}.scope\n",
     CgroupRef("containerd", CTR_ID, POD_UID, f"{systemd_pod(POD_UID)}/cri-containerd-{CTR_ID}.scope")),
    # guaranteed pod (no QoS level) with docker (rt-operator notes, Kubernetes 1.23 + Docker)
    (f"0::/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/docker-{DOCKER_ID}.scope\n",
     CgroupRef("docker", DOCKER_ID, POD_UID,
               f"/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/docker-{DOCKER_ID}.scope")),
    # CRI-O, systemd driver, on a v1 host: the name=systemd line and a controller line
    ((f"1:name=systemd:{systemd_pod(POD_UID, 'besteffort')}/crio-{CRIO_ID}.scope\n"
     f"4:pids:{systemd_pod(POD_UID, 'besteffort')}/crio-{CRIO_ID}.scope\n"),
     CgroupRef("cri-o", CRIO_ID, POD_UID, f"{systemd_pod(POD_UID, 'besteffort')}/crio-{CRIO_ID}.scope")),
    # plain docker, cgroupfs driver (v1)
    (f"1:name=systemd:/docker/{DOCKER_ID}\n", CgroupRef("docker", DOCKER_ID, None, f"/docker/{DOCKER_ID}")),
    # plain docker, systemd driver (v2)
    (f"0::/system.slice/docker-{DOCKER_ID}.scope\n",
     CgroupRef("docker", DOCKER_ID, None, f"/system.slice/docker-{DOCKER_ID}.scope")),
    # a process in a sub-cgroup of its container's scope (a v2 delegated subtree)
    (f"0::{systemd_pod(POD_UID)}/cri-containerd-{CTR_ID}.scope/init\n",
     CgroupRef("containerd", CTR_ID, POD_UID, f"{systemd_pod(POD_UID)}/cri-containerd-{CTR_ID}.scope/init")),
])
def test_cgroup_samples(text, want):
    assert parse_cgroup(text) == want


@pytest.mark.parametrize("text", [
    "0::/\n",  # a private cgroup namespace: names nothing
    "0::/user.slice/user-1000.slice/session-1.scope\n",  # a login session
    "0::/system.slice/sshd.service\n",
    f"0::{systemd_pod(POD_UID)}/crio-conmon-{CRIO_ID}.scope\n",  # CRI-O's monitor, not the container
    "0::/docker/../../etc\n",  # not an id: nothing of it may reach a path
    "0::/system.slice/docker-NOTHEX.scope\n",
    f"0::/{DOCKER_ID}\n",  # a bare id outside a pod or /docker says nothing
    "garbage\n",
    "",
])
def test_cgroup_names_nothing(text):
    assert parse_cgroup(text) is None


def test_v2_line_wins_on_a_hybrid_host():
    text = (f"1:name=systemd:/docker/{DOCKER_ID}\n"
            f"0::{systemd_pod(POD_UID)}/cri-containerd-{CTR_ID}.scope\n")
    ref = parse_cgroup(text)
    assert ref is not None and ref.runtime == "containerd" and ref.id == CTR_ID


def test_pod_log_dir():
    # kubelet BuildPodLogsDirectory: namespace, pod name and uid joined by "_"
    d = parse_pod_log_dir(f"default_hostname-lb-edge-64df67bd8b-xmzhv_{CTR_POD_UID}")
    assert d is not None and (d.namespace, d.pod, d.uid) == ("default", "hostname-lb-edge-64df67bd8b-xmzhv",
                                                           CTR_POD_UID)
    assert parse_pod_log_dir("not-a-pod-dir") is None
    assert parse_pod_log_dir(CTR_POD_UID) is None  # the old /var/log/pods/<uid> layout


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("0123456789abcdef:/-_.kubepodslicescrio=dckrntainer\n"), max_size=300))
def test_cgroup_parser_fuzz(text):
    ref = parse_cgroup(text)
    if ref is not None:
        assert all(c in "0123456789abcdef" for c in ref.id) and 12 <= len(ref.id) <= 64
        assert "/" not in ref.id and ".." not in ref.id


_JSON = st.recursive(
    st.none() | st.text(max_size=10) | st.integers(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3))
_STATE = st.dictionaries(st.text(max_size=10), _JSON, max_size=4).map(
    lambda d: json.dumps({"annotations": d, "Config": d, "Name": d}).encode())


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=200), _STATE))
def test_runtime_state_parsers_fuzz(data):
    for parse in (bundle_names, docker_names):
        names = parse(data)
        assert names is None or all(v is None or isinstance(v, str) for v in names)
    json.loads(reduce_bundle(data))
    json.loads(reduce_docker(data))


# --- fake hosts with the runtimes' state -------------------------------------------------

CONTAINERD_BUNDLE = {  # the OCI config.json of a CRI container: the annotations and more
    "ociVersion": "1.1.0",
    "process": {"env": ["HF_TOKEN=secret-token", "PATH=/usr/bin"], "args": ["vllm", "serve"]},
    "annotations": {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.container-name": "vllm",
        "io.kubernetes.cri.sandbox-name": "llama-0",
        "io.kubernetes.cri.sandbox-namespace": "serving",
        "io.kubernetes.cri.sandbox-uid": POD_UID,
        "io.kubernetes.cri.sandbox-id": CRIO_ID,
    },
}
CONTAINERD_TASKS = "run/containerd/io.containerd.runtime.v2.task"


def containerd_pod(h: fh.FakeHost, pids: list[int], bundle: dict | None = None) -> None:
    """Put `pids` in the containerd container CTR_ID of pod serving/llama-0 (cgroup v2,
    systemd driver)."""
    for pid in pids:
        h._write(f"proc/{pid}/cgroup", f"0::{systemd_pod(POD_UID)}/cri-containerd-{CTR_ID}.scope\n")
    h._write(f"{CONTAINERD_TASKS}/k8s.io/{CTR_ID}/config.json", json.dumps(bundle or CONTAINERD_BUNDLE))
    h._write(f"{CONTAINERD_TASKS}/moby/.keep", "")  # another namespace, without this id


def served_in_pod(root):
    h = fh.healthy_host(root)
    containerd_pod(h, [3000, 3001, 3010, 3020, 3021])
    return h


def test_containerd_pod_through_doctor_ps_devices(tmp_path):
    h = served_in_pod(tmp_path / "host")
    want = {"runtime": "containerd", "id": CTR_ID, "name": "vllm", "pod": "llama-0", "namespace": "serving"}
    doc = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    by_pid = {p["pid"]: p for p in doc["processes"]}
    assert by_pid[3020]["container"] == want and by_pid[3010]["container"] == want
    dev = next(d for d in doc["devices"] if d["bdf"] == fh.BDF0)
    assert {x["pid"]: x["container"] for x in dev["holder_containers"]}[3020] == want
    busy = [f for f in doc["findings"] if f["check"] == "device-holders"]
    assert busy and all("in pod serving/llama-0, container vllm" in f["message"] for f in busy)

    ps = json.loads(cli("--root", str(h.root), "ps", "--json").stdout)
    assert {p["pid"]: p["container"] for p in ps["processes"]}[3021] == want
    devs = json.loads(cli("--root", str(h.root), "devices", "--json").stdout)
    assert all(x["container"] == want for d in devs["devices"] for x in d["holder_containers"])

    table = cli("--root", str(h.root), "ps").stdout
    assert "POD/CONTAINER" in table and "serving/llama-0/vllm" in table
    table = cli("--root", str(h.root), "devices").stdout
    assert "3010, 3020 (serving/llama-0/vllm)" in table
    table = cli("--root", str(h.root), "doctor").stdout
    assert "serving/llama-0/vllm" in table and "in pod serving/llama-0, container vllm" in table


def test_host_processes_have_no_container_and_no_column(tmp_path):
    h = fh.healthy_host(tmp_path / "host")
    h._write("proc/3020/cgroup", "0::/user.slice/user-1000.slice/session-4.scope\n")
    doc = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    assert all(p["container"] is None for p in doc["processes"])
    assert "POD/CONTAINER" not in cli("--root", str(h.root), "ps").stdout


def _holder_samples(text: str) -> list[tuple[dict[str, str], float]]:
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return [(s.labels, s.value) for s in fams["xpuctl_device_container_holder_processes"].samples]


def test_prometheus_holder_labels(tmp_path):
    h = served_in_pod(tmp_path / "host")
    h.add_process(7100, 1, ["/usr/bin/python3", "train.py"], fds={5: "/dev/dri/renderD128"},
                  fdinfo={5: fh.xe_fdinfo(40, fh.BDF0, [fh.GiB])})  # on the host, no container
    text = cli("--root", str(h.root), "doctor", "--format", "prometheus").stdout
    mine = sorted((s for s in _holder_samples(text) if s[0]["device"] == fh.BDF0),
                  key=lambda s: s[0]["pod"])
    assert mine == [
        ({"device": fh.BDF0, "runtime": "", "namespace": "", "pod": "", "container": ""}, 1.0),
        ({"device": fh.BDF0, "runtime": "containerd", "namespace": "serving", "pod": "llama-0",
          "container": "vllm"}, 2.0),  # the engine and worker 0
    ]
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    total = [s.value for s in fams["xpuctl_device_holder_processes"].samples
             if s.labels["device"] == fh.BDF0]
    assert total == [3.0]


def test_docker_holder_named_in_the_finding(tmp_path):
    """A non-vLLM holder in a plain docker container (cgroup v1, cgroupfs driver: /docker/<id>)
    named by docker's config.v2.json `Name`."""
    h = fh.clean_host(tmp_path / "host")
    h.add_process(7100, 1, ["/usr/bin/python3", "train.py"], fds={5: "/dev/dri/renderD128"},
                  fdinfo={5: fh.xe_fdinfo(40, fh.BDF0, [2 * fh.GiB])})
    h._write("proc/7100/cgroup", f"12:pids:/docker/{DOCKER_ID}\n1:name=systemd:/docker/{DOCKER_ID}\n")
    h._write(f"var/lib/docker/containers/{DOCKER_ID}/config.v2.json",
             json.dumps({"ID": DOCKER_ID, "Name": "/trainer", "Config": {"Env": ["SECRET=x"]}}))
    doc = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    p = next(p for p in doc["processes"] if p["pid"] == 7100)
    assert p["container"] == {"runtime": "docker", "id": DOCKER_ID, "name": "trainer", "pod": None,
                              "namespace": None}
    held = [f["message"] for f in doc["findings"] if f["check"] == "device-holders"]
    assert any("pid 7100 (/usr/bin/python3 train.py) in container trainer (docker)" in m for m in held)


def test_crio_names_from_its_labels_annotation(tmp_path):
    """CRI-O: cgroup `crio-<id>.scope`; the bundle under containers/storage's
    overlay-containers/<id>/userdata/config.json, kubelet's labels in io.kubernetes.cri-o.Labels."""
    h = fh.clean_host(tmp_path / "host")
    h.add_process(7200, 1, ["/usr/bin/python3", "-m", "worker"], fds={5: "/dev/dri/renderD128"},
                  fdinfo={5: fh.xe_fdinfo(41, fh.BDF0, [fh.GiB])})
    h._write("proc/7200/cgroup", f"0::{systemd_pod(POD_UID)}/crio-{CRIO_ID}.scope\n")
    labels = {"io.kubernetes.container.name": "embed", "io.kubernetes.pod.name": "embedder-7d9",
              "io.kubernetes.pod.namespace": "rag", "io.kubernetes.pod.uid": POD_UID}
    h._write(f"run/containers/storage/overlay-containers/{CRIO_ID}/userdata/config.json",
             json.dumps({"annotations": {"io.kubernetes.cri-o.Labels": json.dumps(labels),
                                         "io.kubernetes.cri-o.ContainerType": "container"}}))
    doc = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    p = next(p for p in doc["processes"] if p["pid"] == 7200)
    assert p["container"] == {"runtime": "cri-o", "id": CRIO_ID, "name": "embed", "pod": "embedder-7d9",
                              "namespace": "rag"}


def test_pod_logs_answer_when_no_runtime_state_does(tmp_path):
    """cgroupfs driver, runtime unknown, no readable state: kubelet's /var/log/pods directory
    of the pod's uid names the pod, and its one container directory the container."""
    h = fh.clean_host(tmp_path / "host")
    h.add_process(7300, 1, ["/usr/bin/python3", "x.py"], fds={5: "/dev/dri/renderD128"},
                  fdinfo={5: fh.xe_fdinfo(42, fh.BDF0, [fh.GiB])})
    h._write("proc/7300/cgroup", f"6:memory:/kubepods/burstable/pod{BETZ_UID}/{BETZ_ID}\n")
    h._write(f"var/log/pods/default_hostname-lb-edge-64df67bd8b-xmzhv_{BETZ_UID}/hostname/0.log", "")
    h._write(f"var/log/pods/kube-system_other_{CTR_POD_UID}/c/0.log", "")
    doc = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    p = next(p for p in doc["processes"] if p["pid"] == 7300)
    assert p["container"] == {"runtime": None, "id": BETZ_ID, "name": "hostname",
                              "pod": "hostname-lb-edge-64df67bd8b-xmzhv", "namespace": "default"}


def test_unreadable_or_oversized_state_keeps_the_id(tmp_path):
    h = fh.clean_host(tmp_path / "host")
    h.add_process(7400, 1, ["/usr/bin/python3", "x.py"], fds={5: "/dev/dri/renderD128"},
                  fdinfo={5: fh.xe_fdinfo(43, fh.BDF0, [fh.GiB])})
    h._write("proc/7400/cgroup", f"0::/system.slice/docker-{DOCKER_ID}.scope\n")
    h._write(f"var/lib/docker/containers/{DOCKER_ID}/config.v2.json", b" " * (2 << 20) + b"{}")
    doc = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    p = next(p for p in doc["processes"] if p["pid"] == 7400)
    assert p["container"] == {"runtime": "docker", "id": DOCKER_ID, "name": None, "pod": None,
                              "namespace": None}
    assert any(f"container {DOCKER_ID[:12]} (docker)" in f["message"] for f in doc["findings"])


HOSTILE = 'llama"0\n\x1b[31mred\\'


def test_hostile_names_are_escaped(tmp_path):
    bundle = json.loads(json.dumps(CONTAINERD_BUNDLE))
    bundle["annotations"]["io.kubernetes.cri.sandbox-name"] = HOSTILE
    bundle["annotations"]["io.kubernetes.cri.container-name"] = "v\x07llm"
    h = fh.healthy_host(tmp_path / "host")
    containerd_pod(h, [3020], bundle)
    doc = json.loads(cli("--root", str(h.root), "doctor", "--json").stdout)
    assert next(p for p in doc["processes"] if p["pid"] == 3020)["container"]["pod"] == HOSTILE
    for args in (("doctor",), ("ps",), ("devices",)):
        out = cli("--root", str(h.root), *args).stdout
        assert "\x1b" not in out and "\x07" not in out
    text = cli("--root", str(h.root), "doctor", "--format", "prometheus").stdout
    assert "\x1b" not in text
    pods = [s[0]["pod"] for s in _holder_samples(text) if s[0]["pod"]]
    assert len(pods) == 1 and pods[0].startswith('llama"0\n') and pods[0].endswith("red\\")


def test_snapshot_round_trip_keeps_only_the_annotations(tmp_path, pinned_now):
    h = served_in_pod(tmp_path / "host")
    archive = take(h.root, tmp_path / "snap.tar.gz")
    assert_same_as_live(h.root, archive)
    with tarfile.open(archive) as tf:
        names = tf.getnames()
        kept = [n for n in names if n.endswith(f"{CTR_ID}/config.json")]
        assert len(kept) == 1
        data = json.load(io.BytesIO(tf.extractfile(kept[0]).read()))  # type: ignore[union-attr]
        cgroups = [n for n in names if n.endswith("/proc/3020/cgroup")]
        assert cgroups
    assert set(data) == {"annotations"}
    assert data["annotations"]["io.kubernetes.cri.sandbox-name"] == "llama-0"
    assert "secret-token" not in json.dumps(data) and "io.kubernetes.cri.sandbox-id" not in data["annotations"]
    back = json.loads(cli("doctor", "--json", "--from", str(archive)).stdout)
    assert next(p for p in back["processes"] if p["pid"] == 3020)["container"]["pod"] == "llama-0"


def test_snapshot_keeps_only_dockers_name(tmp_path, pinned_now):
    h = fh.clean_host(tmp_path / "host")
    h.add_process(7100, 1, ["/usr/bin/python3", "train.py"], fds={5: "/dev/dri/renderD128"},
                  fdinfo={5: fh.xe_fdinfo(40, fh.BDF0, [2 * fh.GiB])})
    h._write("proc/7100/cgroup", f"1:name=systemd:/docker/{DOCKER_ID}\n")
    h._write(f"var/lib/docker/containers/{DOCKER_ID}/config.v2.json",
             json.dumps({"Name": "/trainer", "Config": {"Env": ["SECRET=x"], "Labels": {"a": "b"}}}))
    archive = take(h.root, tmp_path / "snap.tar.gz")
    assert_same_as_live(h.root, archive)
    with tarfile.open(archive) as tf:
        member = next(n for n in tf.getnames() if n.endswith("config.v2.json"))
        assert json.load(tf.extractfile(member)) == {"Name": "/trainer"}  # type: ignore[arg-type]


def test_a_container_is_never_a_reason_to_signal(tmp_path):
    """reset's plan for a host whose holder is in a pod is the plan without the pod."""
    plain = fh.clean_host(tmp_path / "plain")
    boxed = fh.clean_host(tmp_path / "boxed")
    for h in (plain, boxed):
        h.add_process(7100, 1, ["/usr/bin/python3", "train.py"], fds={5: "/dev/dri/renderD128"},
                      fdinfo={5: fh.xe_fdinfo(40, fh.BDF0, [2 * fh.GiB])})
    containerd_pod(boxed, [7100])
    plans = []
    for h in (plain, boxed):
        res = cli("--root", str(h.root), "reset", "--dry-run", "--json")
        plans.append(json.loads(res.stdout)["plan"])
    assert plans[0]["holders"] == plans[1]["holders"] and plans[0]["orphan_pids"] == plans[1]["orphan_pids"]
    assert all(not x["stop"] for x in plans[1]["holders"])
