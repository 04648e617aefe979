"""A stand-in for vLLM run as a library (issue 29 §1): a script that called `LLM(...)`.

vLLM's engine and workers keep the titles vLLM gives them (`VLLM::EngineCore`,
`VLLM::Worker_TP<r>`, set with setproctitle as vLLM's `set_process_title` does) under a
parent that is no API server: the script itself, which lives on while they work.

    python embedded_vllm.py script DIR ENGINE_NODE WORKER_NODE...

`script` starts `engine` in its own session and group (a child keeps both), which opens
ENGINE_NODE (`-`: none) and starts one `worker` per WORKER_NODE (`-`: it holds none); each
opens its node and sleeps. Each process writes its pid to DIR/<name>.pid once it holds what it
should. The caller's environment is passed on (SPT_NOENV=1 keeps it readable under the new
titles, so the test's reaper token stays visible). Importable without pytest; stdlib and
setproctitle only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _hold(node: str) -> int | None:
    return os.open(node, os.O_RDWR) if node != "-" else None


def _done(directory: str, name: str) -> None:
    tmp = os.path.join(directory, f".{name}.pid")
    with open(tmp, "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(tmp, os.path.join(directory, f"{name}.pid"))


def main(argv: list[str]) -> None:
    role, directory, *nodes = argv
    me = [sys.executable, os.path.abspath(__file__)]
    if role == "script":
        subprocess.Popen([*me, "engine", directory, *nodes])
        _done(directory, "script")
    elif role == "engine":
        import setproctitle

        setproctitle.setproctitle("VLLM::EngineCore")
        _hold(nodes[0])
        for rank, node in enumerate(nodes[1:]):
            subprocess.Popen([*me, f"worker{rank}", directory, node])
        _done(directory, "engine")
    else:
        import setproctitle

        setproctitle.setproctitle(f"VLLM::Worker_TP{role[len('worker'):]}")
        _hold(nodes[0])
        _done(directory, role)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
