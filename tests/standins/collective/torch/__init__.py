"""Stand-in torch for the collective check: `__version__`, `ones` (a tensor that adds and
sums: one device's check computes on it), `torch.xpu` (set_device, synchronize) and
`torch.distributed` (a real rendezvous on MASTER_ADDR/MASTER_PORT over TCP,
an all_reduce that sums across ranks). Hang and crash modes per device: see scenario.py.
The API shapes are the public ones (torch.distributed.init_process_group(backend,
init_method="env://", rank, world_size), all_reduce(tensor) in place, destroy_process_group();
torch.xpu.set_device(i), device_count(), is_available(), synchronize())."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import scenario

__version__ = scenario.conf().get("version", "2.9.0+xpu")


class Tensor:
    """`value` is every element's (ones, sums of ones); `n` the element count."""

    def __init__(self, value, device, n=1):
        self.value = float(value)
        self.device = device
        self.n = n

    def item(self):
        return self.value

    def __add__(self, other):
        scenario.at("compute", _index(self.device), 1)
        return Tensor(self.value + other.value, self.device, self.n)

    def sum(self):
        return Tensor(self.value * self.n, self.device)


def _index(device):
    return int(str(device).split(":")[1]) if str(device).startswith("xpu:") else None


def ones(n, device="cpu"):
    i = _index(device)
    if i is not None:
        if i >= xpu.device_count():
            raise RuntimeError(f"Invalid device index {i}")
        scenario.allocated(i)
    return Tensor(1.0, device, n)


def _parse(v):
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


from torch import distributed, xpu  # noqa: E402, F401 (torch.xpu and torch.distributed are attributes of torch)
