"""Stand-in dpctl: what Ray 2.60's Intel GPU manager asks of it
(module ray._private.accelerators.intel_gpu): `SyclContext("level_zero:gpu").device_count` and
`SyclDevice("level_zero:gpu:0").name` (e.g. 'Intel(R) Data Center GPU Max 1550', which Ray
turns into the accelerator type Intel-GPU-Max-1550). DPCTL_STANDIN_GPUS: how many (default 2)."""

import os

_COUNT = int(os.environ.get("DPCTL_STANDIN_GPUS", "2"))


class SyclContext:
    def __init__(self, selector: str) -> None:
        if not selector.startswith("level_zero:gpu") or _COUNT == 0:
            raise ValueError(f"no device for {selector}")
        self.device_count = _COUNT


class SyclDevice:
    def __init__(self, selector: str) -> None:
        SyclContext(selector)
        self.name = "Intel(R) Data Center GPU Max 1550"
