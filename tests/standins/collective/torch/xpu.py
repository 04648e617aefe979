"""torch.xpu of the collective stand-in."""

import scenario

_state = {"current": None}


def is_available():
    return scenario.conf().get("devices", 2) > 0 and scenario.conf().get("available", True)


def device_count():
    n = scenario.conf().get("devices", 2)
    mask = __import__("os").environ.get("ZE_AFFINITY_MASK")
    return len([p for p in mask.split(",") if p.strip()]) if mask else n


def set_device(i):
    if i >= device_count():
        raise RuntimeError(f"Invalid device index {i}")
    _state["current"] = i


def synchronize():
    pass
