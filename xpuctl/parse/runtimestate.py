"""Container runtimes' own state files -> a container's names (bytes in, `Names` out).

- An OCI bundle's `config.json` (containerd's task bundle, CRI-O's `userdata/config.json`):
  its `annotations`. containerd's CRI sets `io.kubernetes.cri.sandbox-name`,
  `io.kubernetes.cri.sandbox-namespace` and `io.kubernetes.cri.container-name` (containerd's
  CRI annotations, pkg/cri/annotations, internal/cri/annotations in 2.x). CRI-O's are read under kubelet's label keys
  `io.kubernetes.pod.name`, `io.kubernetes.pod.namespace`, `io.kubernetes.container.name`
  (kubelet pkg/kubelet/types/labels.go), either as annotations of their own or inside CRI-O's
  `io.kubernetes.cri-o.Labels` annotation, a JSON object of the pod's labels (cri-o pkg/annotations).
- docker's `config.v2.json`: `Name` (with docker's leading `/`), and under cri-dockerd the
  same kubelet keys in `Config.Labels`.

Only those keys are read; `reduce_*` keep only them, for a snapshot (nothing else of the
files: a bundle holds the container's whole environment).
"""

from __future__ import annotations

from typing import Any, NamedTuple

CRI_POD, CRI_NAMESPACE, CRI_CONTAINER = ("io.kubernetes.cri.sandbox-name",
                                         "io.kubernetes.cri.sandbox-namespace",
                                         "io.kubernetes.cri.container-name")
KUBE_POD, KUBE_NAMESPACE, KUBE_CONTAINER = ("io.kubernetes.pod.name",
                                            "io.kubernetes.pod.namespace",
                                            "io.kubernetes.container.name")
CRIO_LABELS = "io.kubernetes.cri-o.Labels"
_KUBE_KEYS = (KUBE_POD, KUBE_NAMESPACE, KUBE_CONTAINER)
_BUNDLE_KEYS = (CRI_POD, CRI_NAMESPACE, CRI_CONTAINER, *_KUBE_KEYS)


class Names(NamedTuple):
    """What a runtime's state names a container by (None: not said)."""

    name: str | None
    pod: str | None
    namespace: str | None


def _load(data: bytes) -> dict[str, Any] | None:
    # json is imported where a runtime's file is read: every doctor imports this module
    # before its reader starts, and few hosts have a container holding a device
    import json

    try:
        doc = json.loads(data.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _strings(obj: object, keys: tuple[str, ...]) -> dict[str, str]:
    if not isinstance(obj, dict):
        return {}
    return {k: v for k in keys if isinstance(v := obj.get(k), str) and v}


def _crio_labels(annotations: object) -> dict[str, str]:
    if not isinstance(annotations, dict) or not isinstance(annotations.get(CRIO_LABELS), str):
        return {}
    doc = _load(annotations[CRIO_LABELS].encode("utf-8", "surrogateescape"))
    return _strings(doc, _KUBE_KEYS)


def bundle_names(data: bytes) -> Names | None:
    """The names in an OCI bundle's config.json; None when it is not JSON or names nothing."""
    doc = _load(data)
    if doc is None:
        return None
    ann = doc.get("annotations")
    found = {**_crio_labels(ann), **_strings(ann, _BUNDLE_KEYS)}
    names = Names(found.get(CRI_CONTAINER) or found.get(KUBE_CONTAINER),
                  found.get(CRI_POD) or found.get(KUBE_POD),
                  found.get(CRI_NAMESPACE) or found.get(KUBE_NAMESPACE))
    return names if any(names) else None


def docker_names(data: bytes) -> Names | None:
    """The names in docker's config.v2.json; None when it is not JSON or names nothing."""
    doc = _load(data)
    if doc is None:
        return None
    name = doc.get("Name")
    name = name.lstrip("/") or None if isinstance(name, str) else None
    config = doc.get("Config")
    labels = _strings(config.get("Labels") if isinstance(config, dict) else None, _KUBE_KEYS)
    if labels.get(KUBE_CONTAINER):  # a kubelet container: its pod's names, not k8s_POD_...
        names = Names(labels.get(KUBE_CONTAINER), labels.get(KUBE_POD), labels.get(KUBE_NAMESPACE))
    else:
        names = Names(name, labels.get(KUBE_POD), labels.get(KUBE_NAMESPACE))
    return names if any(names) else None


def reduce_bundle(data: bytes) -> bytes:
    """A bundle's config.json as a snapshot keeps it: the annotations this module reads."""
    import json

    doc = _load(data)
    ann = doc.get("annotations") if doc is not None else None
    kept: dict[str, str] = _strings(ann, _BUNDLE_KEYS)
    labels = _crio_labels(ann)
    if labels:
        kept[CRIO_LABELS] = json.dumps(labels)
    return json.dumps({"annotations": kept}).encode()


def reduce_docker(data: bytes) -> bytes:
    """docker's config.v2.json as a snapshot keeps it: Name and the kubelet labels."""
    import json

    doc = _load(data) or {}
    config = doc.get("Config")
    out: dict[str, Any] = {}
    if isinstance(doc.get("Name"), str):
        out["Name"] = doc["Name"]
    labels = _strings(config.get("Labels") if isinstance(config, dict) else None, _KUBE_KEYS)
    if labels:
        out["Config"] = {"Labels": labels}
    return json.dumps(out).encode()
