"""Stand-in for torch: `__version__`, and `torch.xpu` from 2.5 on (before that IPEX adds it).

torch.xpu honours ZE_AFFINITY_MASK (plain indices) and lists devices in PCI order only with
ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 (otherwise in the scenario's `driver_order`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import scenario

_conf = scenario.section("torch")
scenario.delay(_conf)
if _conf.get("garbage"):
    sys.stdout.write("Segmentation fault?\x00\xff{not json\n")
    sys.stdout.flush()
    os._exit(3)
__version__ = _conf.get("version", "2.13.0+xpu")


def _make_xpu():
    from torch import _xpu

    return _xpu


def _parse(v):
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


if _parse(__version__) >= (2, 5):
    xpu = _make_xpu()
