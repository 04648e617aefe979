"""Whether a Ray node can give vLLM its Intel GPUs (`doctor --ray`): facts in, findings out.

Read in Ray's source (2.60, the modules `ray._private.accelerators` and its `intel_gpu`): the
"GPU" resource goes to the Intel manager only when `import dpctl` works in the node's Python and
dpctl's `SyclContext("level_zero:gpu")` counts a device; otherwise (on an Intel-only node) to
the NVIDIA manager (Ray #66167), so a vLLM run on Ray (`ray_device_key="GPU"`) never gets a
card. The Intel manager names the node's accelerator type `Intel-GPU-<model>` (a resource
`accelerator_type:Intel-GPU-...`) and sets `ZE_AFFINITY_MASK` for each XPU worker (Ray PR
#64440) unless `RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK` is set (vLLM PR #58079 sets it and
masks its workers itself); older Ray also set `ONEAPI_DEVICE_SELECTOR` (its own NOSET
variable). Those variables in the raylet's environment reach every worker of the node.

A node answers its own part (`xpuctl.node`: dpctl imported in a child of the node's Python,
the variables); the resources are Ray's view of the node (`ray.nodes()`, in the caller's
child); the Intel GPUs are the node's doctor's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from xpuctl.core.model import Finding

#: the variables of a node's environment that decide which cards Ray's workers see
MASK_VARS = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR",
             "RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK",
             "RAY_EXPERIMENTAL_NOSET_ONEAPI_DEVICE_SELECTOR")
INTEL_TYPE = "accelerator_type:Intel-GPU"
CHECK = "ray-gpus"


class RayNodeFacts(NamedTuple):
    intel_gpus: int  # Intel GPUs the node's doctor sees
    python: str | None  # the node's Python (its raylet's workers')
    dpctl: bool | None  # `import dpctl` works there (None: it did not answer)
    dpctl_error: str | None  # why not: the import's last word
    gpu_resource: float | None  # Ray's "GPU" total for the node (None: none declared)
    accelerator_type: str | None  # the node's `accelerator_type:...` resource, without prefix
    env: dict[str, str | None]  # MASK_VARS in the node's environment

    @property
    def gpu_is_intel(self) -> bool:
        """Ray's "GPU" resource here is the Intel manager's."""
        return bool(self.gpu_resource) and (self.accelerator_type or "").startswith("Intel-GPU")


def facts_of(resources: Any, ray_env: Any, document: dict[str, Any]) -> RayNodeFacts | None:
    """The facts of one node's answer, or None when the node did not send its part."""
    if not isinstance(ray_env, dict):
        return None
    res = resources if isinstance(resources, dict) else {}
    gpu = res.get("GPU")
    types = sorted(str(k).split(":", 1)[1] for k in res if str(k).startswith("accelerator_type:"))
    devices = document.get("devices") or []
    given = ray_env.get("env")
    env: dict[str, Any] = given if isinstance(given, dict) else {}
    dpctl = ray_env.get("dpctl")
    return RayNodeFacts(
        intel_gpus=sum(1 for d in devices if isinstance(d, dict) and d.get("intel")),
        python=str(ray_env["python"]) if ray_env.get("python") else None,
        dpctl=dpctl if isinstance(dpctl, bool) else None,
        dpctl_error=str(ray_env["dpctl_error"]) if ray_env.get("dpctl_error") else None,
        gpu_resource=float(gpu) if isinstance(gpu, (int, float)) else None,
        accelerator_type=types[0] if types else None,
        env={k: (str(env[k]) if env.get(k) is not None else None) for k in MASK_VARS},
    )


def _masks(f: RayNodeFacts) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in f.env.items() if v is not None) or "none set"
    noset = f.env.get("RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK") not in (None, "", "0")
    who = ("Ray leaves ZE_AFFINITY_MASK to the workers (RAY_EXPERIMENTAL_NOSET_ZE_AFFINITY_MASK, "
           "as vLLM PR #58079 sets it)" if noset else
           "Ray sets ZE_AFFINITY_MASK for each XPU worker (Ray PR #64440)")
    return f"{who}; the node's environment: {shown}"


def findings(f: RayNodeFacts | None) -> list[Finding]:
    """What the facts say about vLLM on Ray on this node (nothing on a node without Intel
    GPUs: there is no card to give). Warnings: the node's own cards are fine, it is Ray's
    configuration that keeps them from a vLLM run on Ray."""
    if f is None or f.intel_gpus == 0:
        return []
    gpu = "none" if f.gpu_resource is None else f"{f.gpu_resource:g}"
    py = f.python or "the node's Python"
    out = []
    if f.dpctl is False:
        why = f" ({f.dpctl_error})" if f.dpctl_error else ""
        out.append(Finding(
            CHECK, "warn",
            f"{f.intel_gpus} Intel GPU(s) here, but `import dpctl` fails in {py}{why}: Ray hands "
            f'its "GPU" resource ({gpu} here) to its NVIDIA manager (Ray #66167), so a vLLM run '
            "on Ray never gets one of these cards",
            f"install dpctl into {py} (the Python of this node's Ray), then restart Ray on the "
            "node (`ray stop`, `ray start ...`)"))
    elif not f.gpu_is_intel:
        kind = f"accelerator type {f.accelerator_type}" if f.accelerator_type else "no Intel type"
        out.append(Finding(
            CHECK, "warn",
            f'{f.intel_gpus} Intel GPU(s) here, but Ray\'s "GPU" resource is {gpu} with {kind}: '
            "it is not the Intel manager's, so a vLLM run on Ray gets none of these cards"
            + ("" if f.dpctl else " (whether dpctl imports here is unknown: it did not answer)"),
            "restart Ray on the node once `python -c \"import dpctl; print(dpctl.SyclContext("
            "'level_zero:gpu').device_count)\"` counts the cards in its Python (the GPU driver, "
            "the render group, ZE_AFFINITY_MASK in Ray's environment)"))
    elif f.gpu_resource is not None and f.gpu_resource < f.intel_gpus:
        out.append(Finding(
            CHECK, "warn",
            f'Ray offers {gpu} "GPU" of the node\'s {f.intel_gpus} Intel GPU(s) '
            f"({f.accelerator_type})",
            "`ray start --num-gpus`, or ZE_AFFINITY_MASK in Ray's environment, hides the others"))
    out.append(Finding(CHECK, "info", _masks(f)))
    return out

