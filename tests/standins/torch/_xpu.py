"""torch.xpu of the stand-in (see torch/__init__.py)."""

import os
from types import SimpleNamespace

import scenario

_conf = scenario.section("torch")
_all = _conf.get("devices", [])


def _visible():
    order = list(range(len(_all)))
    if os.environ.get("ZE_ENABLE_PCI_ID_DEVICE_ORDER") != "1" and _conf.get("driver_order"):
        order = list(_conf["driver_order"])
    mask = os.environ.get("ZE_AFFINITY_MASK")
    if mask:
        order = [order[int(i)] for i in mask.split(",") if i.strip().isdigit() and int(i) < len(order)]
    return [_all[i] for i in order]


def is_available():
    return bool(_conf.get("available", True)) and bool(_visible())


def device_count():
    return len(_visible())


def get_device_properties(i):
    d = _visible()[i]
    return SimpleNamespace(name=d.get("name", "Intel(R) Graphics"), total_memory=d["total"],
                           driver_version=d.get("driver", "1.6.33276"), type="gpu")


def mem_get_info(i):
    d = _visible()[i]
    if d.get("lost"):
        raise RuntimeError("level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)")
    return d["free"], d["total"]
