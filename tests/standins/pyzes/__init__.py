"""Stand-in for pyzes 0.1.3: same names, ctypes structures filled through pointers, int
ze_result_t codes. The loader is opened at import from the same hard-coded path (OSError when
missing); a scenario may point `loader` at a library that exists to pretend it is installed."""

import os
import sys
from ctypes import CDLL, Structure, c_char, c_int32, c_ubyte, c_uint32, c_uint64, c_void_p

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import scenario

_conf = scenario.section("pyzes")
gpuLib = CDLL(_conf.get("loader", "/usr/lib/x86_64-linux-gnu/libze_loader.so.1"))

ZE_RESULT_SUCCESS = 0
ZE_RESULT_ERROR_DEVICE_LOST = 0x70000001
ZE_RESULT_ERROR_DEVICE_REQUIRES_RESET = 0x70000006
ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS = 0x70010000
ZE_RESULT_ERROR_UNSUPPORTED_FEATURE = 0x78000003
ZE_RESULT_ERROR_INVALID_SIZE = 0x78000008
ZE_RESULT_ERROR_INVALID_ARGUMENT = 0x78000004
ZE_RESULT_ERROR_UNINITIALIZED = 0x78000001
ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x1
ZES_STRUCTURE_TYPE_PCI_PROPERTIES = 0x2
ZES_STRUCTURE_TYPE_MEM_PROPERTIES = 0xB
ZES_STRUCTURE_TYPE_PROCESS_STATE = 0x16
ZES_STRUCTURE_TYPE_MEM_STATE = 0x1E
ZES_MEM_LOC_SYSTEM = 0
ZES_MEM_LOC_DEVICE = 1
ZE_MAX_DEVICE_NAME = 256
ZES_STRING_PROPERTY_SIZE = 64


class zes_driver_handle_t(c_void_p):
    pass


class zes_device_handle_t(c_void_p):
    pass


class zes_mem_handle_t(c_void_p):
    pass


class ze_device_properties_t(Structure):
    _fields_ = [("stype", c_int32), ("pNext", c_void_p), ("type", c_int32), ("vendorId", c_uint32),
                ("deviceId", c_uint32), ("flags", c_uint32), ("subdeviceId", c_uint32),
                ("coreClockRate", c_uint32), ("maxMemAllocSize", c_uint64),
                ("uuid", c_ubyte * 16), ("name", c_char * ZE_MAX_DEVICE_NAME)]


class zes_device_properties_t(Structure):
    _fields_ = [("stype", c_int32), ("pNext", c_void_p), ("core", ze_device_properties_t),
                ("numSubdevices", c_uint32), ("serialNumber", c_char * ZES_STRING_PROPERTY_SIZE),
                ("boardNumber", c_char * ZES_STRING_PROPERTY_SIZE),
                ("brandName", c_char * ZES_STRING_PROPERTY_SIZE),
                ("modelName", c_char * ZES_STRING_PROPERTY_SIZE),
                ("vendorName", c_char * ZES_STRING_PROPERTY_SIZE),
                ("driverVersion", c_char * ZES_STRING_PROPERTY_SIZE)]


class zes_process_state_t(Structure):
    _fields_ = [("stype", c_int32), ("pNext", c_void_p), ("processId", c_uint32),
                ("memSize", c_uint64), ("sharedSize", c_uint64), ("engines", c_uint32)]


class zes_pci_address_t(Structure):
    _fields_ = [("domain", c_uint32), ("bus", c_uint32), ("device", c_uint32), ("function", c_uint32)]


class zes_pci_properties_t(Structure):
    _fields_ = [("stype", c_int32), ("pNext", c_void_p), ("address", zes_pci_address_t),
                ("maxSpeed", c_int32 * 4), ("haveBandwidthCounters", c_ubyte),
                ("havePacketCounters", c_ubyte), ("haveReplayCounters", c_ubyte)]


class zes_mem_properties_t(Structure):
    _fields_ = [("stype", c_int32), ("pNext", c_void_p), ("type", c_int32), ("onSubdevice", c_ubyte),
                ("subdeviceId", c_uint32), ("location", c_int32), ("physicalSize", c_uint64),
                ("busWidth", c_int32), ("numChannels", c_int32)]


class zes_mem_state_t(Structure):
    _fields_ = [("stype", c_int32), ("pNext", c_void_p), ("health", c_int32), ("free", c_uint64),
                ("size", c_uint64)]


_initialised = False
_DEVICES = _conf.get("devices", [])


def _target(p):
    """What byref(x) / pointer(x) / an array points at."""
    if p is None:
        return None
    return getattr(p, "_obj", None) if hasattr(p, "_obj") else getattr(p, "contents", p)


def _handle(h):
    v = h.value if hasattr(h, "value") else h
    return int(v or 0)


def _fill(pCount, out, items, make):
    count = _target(pCount)
    if out is None or count.value == 0:
        count.value = len(items)
        return ZE_RESULT_SUCCESS
    arr = _target(out)
    n = min(count.value, len(items))
    for i in range(n):
        arr[i] = make(items[i])
    count.value = n
    return ZE_RESULT_SUCCESS


def _device(h):
    i = _handle(h) - 0x1000
    if not 0 <= i < len(_DEVICES):
        return None
    return _DEVICES[i]


def _lost(dev):
    return ZE_RESULT_ERROR_DEVICE_LOST if dev.get("lost") == "lost" else ZE_RESULT_ERROR_DEVICE_REQUIRES_RESET


def zesInit(flags):
    global _initialised  # noqa: PLW0603 (the stand-in keeps zesInit state as Level Zero does)
    scenario.delay(_conf)  # a Level Zero init that hangs
    rc = _conf.get("init_rc", 0)
    _initialised = rc == 0
    return rc


def zesDriverGet(pCount, phDrivers):
    if not _initialised:
        return ZE_RESULT_ERROR_UNINITIALIZED
    return _fill(pCount, phDrivers, [1], lambda _: zes_driver_handle_t(0x10))


def zesDeviceGet(hDriver, pCount, phDevices):
    if _handle(hDriver) != 0x10:
        return ZE_RESULT_ERROR_INVALID_ARGUMENT
    return _fill(pCount, phDevices, list(range(len(_DEVICES))), lambda i: zes_device_handle_t(0x1000 + i))


def zesDevicePciGetProperties(hDevice, pProperties):
    dev = _device(hDevice)
    if dev is None:
        return ZE_RESULT_ERROR_INVALID_ARGUMENT
    if dev.get("lost") and dev.get("pci_lost"):
        return _lost(dev)  # (NEO reads the PCI address from sysfs: a lost device still has one)
    props = _target(pProperties)
    if props.stype != ZES_STRUCTURE_TYPE_PCI_PROPERTIES:
        return ZE_RESULT_ERROR_INVALID_ARGUMENT
    dom, bus, rest = dev["bdf"].split(":")
    slot, fn = rest.split(".")
    props.address.domain, props.address.bus = int(dom, 16), int(bus, 16)
    props.address.device, props.address.function = int(slot, 16), int(fn, 16)
    return ZE_RESULT_SUCCESS


def zesDeviceGetProperties(hDevice, pProperties):
    dev = _device(hDevice)
    if dev is None:
        return ZE_RESULT_ERROR_INVALID_ARGUMENT
    if dev.get("lost"):
        return _lost(dev)
    props = _target(pProperties)
    props.core.name = dev.get("name", "Intel(R) Graphics").encode()
    props.modelName = dev.get("name", "Intel(R) Graphics").encode()[:63]
    return ZE_RESULT_SUCCESS


def zesDeviceEnumMemoryModules(hDevice, pCount, phMemory):
    dev = _device(hDevice)
    if dev is None:
        return ZE_RESULT_ERROR_INVALID_ARGUMENT
    idx = _handle(hDevice) - 0x1000
    mods = list(range(len(dev.get("memory", []))))
    return _fill(pCount, phMemory, mods, lambda m: zes_mem_handle_t(0x2000 + idx * 16 + m))


def _module(h):
    v = _handle(h) - 0x2000
    return _DEVICES[v // 16], _DEVICES[v // 16]["memory"][v % 16]


def zesMemoryGetProperties(hMemory, pProperties):
    dev, mod = _module(hMemory)
    if dev.get("lost"):
        return _lost(dev)
    props = _target(pProperties)
    props.location = mod.get("location", ZES_MEM_LOC_DEVICE)
    props.physicalSize = mod["size"]
    return ZE_RESULT_SUCCESS


def zesMemoryGetState(hMemory, pState):
    dev, mod = _module(hMemory)
    if dev.get("lost"):
        return _lost(dev)
    state = _target(pState)
    if state.stype != ZES_STRUCTURE_TYPE_MEM_STATE:
        return ZE_RESULT_ERROR_INVALID_ARGUMENT
    state.size, state.free = mod["size"], mod["free"]
    return ZE_RESULT_SUCCESS


def zesDeviceProcessesGetState(hDevice, pCount, pProcesses):
    dev = _device(hDevice)
    if dev is None:
        return ZE_RESULT_ERROR_INVALID_ARGUMENT
    if dev.get("lost"):
        return _lost(dev)
    procs = dev.get("processes", [])
    if procs == "unsupported":
        return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    if procs == "permissions":
        return ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS
    count = _target(pCount)
    if pProcesses is None or count.value == 0:
        count.value = len(procs)
        return ZE_RESULT_SUCCESS
    if count.value < len(procs):
        count.value = len(procs)
        return ZE_RESULT_ERROR_INVALID_SIZE
    arr = _target(pProcesses)
    for i, p in enumerate(procs):
        if arr[i].stype != ZES_STRUCTURE_TYPE_PROCESS_STATE:
            return ZE_RESULT_ERROR_INVALID_ARGUMENT
        arr[i].processId, arr[i].memSize, arr[i].sharedSize = p["pid"], p["mem"], p.get("shared", 0)
    count.value = len(procs)
    return ZE_RESULT_SUCCESS


# the health extension (Level Zero 1.18, EXT_DeviceHealth): zesDeviceGetHealthStatusExt(hDevice,
# &health), health a zes_device_health_status_ext_t (OK 0, WARNING 1, CRITICAL 2, FAILED 3); a
# device's "health" in the scenario: one of those names, or "unsupported"; none: no health
ZES_DEVICE_HEALTH_STATUS_EXT_OK = 0
ZES_DEVICE_HEALTH_STATUS_EXT_WARNING = 1
ZES_DEVICE_HEALTH_STATUS_EXT_CRITICAL = 2
ZES_DEVICE_HEALTH_STATUS_EXT_FAILED = 3
_HEALTH = {"OK": 0, "WARNING": 1, "CRITICAL": 2, "FAILED": 3}


def zesDeviceGetHealthStatusExt(hDevice, pHealth):
    dev = _device(hDevice)
    if dev is None:
        return ZE_RESULT_ERROR_INVALID_ARGUMENT
    said = dev.get("health")
    if said is None or said == "unsupported":
        return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
    _target(pHealth).value = _HEALTH[said]  # kept across resets: a lost device still answers
    return ZE_RESULT_SUCCESS
