"""torch.distributed of the collective stand-in: a real TCP rendezvous (rank 0 listens on
MASTER_ADDR:MASTER_PORT, the others connect), an all_reduce that sums, per-device hangs and
crashes (scenario.py)."""

import os
import socket
import struct
import sys
import time

import scenario

import torch

_state = {}


def is_xccl_available():
    return bool(scenario.conf().get("xccl", True)) and torch._parse(torch.__version__) >= (2, 8)


def _device():
    return torch.xpu._state["current"]


def init_process_group(backend, init_method="env://", rank=None, world_size=None, **_):
    if backend == "xccl" and not is_xccl_available():
        raise RuntimeError("Invalid backend: 'xccl'")
    if backend == "ccl" and "oneccl_bindings_for_pytorch" not in sys.modules:
        raise RuntimeError("Invalid backend: 'ccl'")
    assert init_method == "env://"
    scenario.at("init", _device(), world_size)
    scenario.make_files(rank)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(world_size)
        peers = [srv.accept()[0] for _ in range(world_size - 1)]
        srv.close()
    else:
        while True:
            try:
                s = socket.create_connection((addr, port))
                break
            except ConnectionRefusedError:
                time.sleep(0.02)
        peers = [s]
    _state["group"] = (rank, world_size, peers)


def _recv(s):
    data = b""
    while len(data) < 8:
        chunk = s.recv(8 - len(data))
        if not chunk:
            raise RuntimeError("peer closed the connection")
        data += chunk
    return struct.unpack("d", data)[0]


def all_reduce(t):
    rank, world, peers = _state["group"]
    scenario.at("all_reduce", _device(), world)
    if rank == 0:
        total = t.value + sum(_recv(p) for p in peers)
        for p in peers:
            p.sendall(struct.pack("d", total))
    else:
        peers[0].sendall(struct.pack("d", t.value))
        total = _recv(peers[0])
    t.value = total


def destroy_process_group():
    _, world, peers = _state["group"]
    scenario.at("destroy", _device(), world)
    for p in peers:
        p.close()
    _state.pop("group")
