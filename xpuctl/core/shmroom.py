"""How much of /dev/shm a vLLM run needs: an estimate from vLLM's own MessageQueue sizes.

vLLM's multiproc executor (TP x PP > 1) allocates its shared-memory rings in /dev/shm: the
broadcast queue to the workers, VLLM_MQ_MAX_CHUNK_BYTES_MB (16) x 10 chunks, and one response
queue per worker at the 24 MiB default x 10 chunks (vLLM #50606: 160 + 2 x 240 = 640 MiB at
TP=2, whatever the variable says, until that PR). tmpfs allocates lazily, so a small /dev/shm
surfaced as a SIGBUS under load until vLLM #48879 made the start fail fast ("Insufficient
space in /dev/shm"). With one worker the engine runs it in-process: no rings. Pure.
"""

from __future__ import annotations

MIB = 1 << 20
CHUNKS = 10  # MessageQueue's max_chunks
DEFAULT_CHUNK_MB = 16  # VLLM_MQ_MAX_CHUNK_BYTES_MB
RESPONSE_CHUNK_MB = 24  # worker_response_mq's signature default (vLLM #50606)
CHUNK_VAR = "VLLM_MQ_MAX_CHUNK_BYTES_MB"


def needed_bytes(tp: int, pp: int = 1, env: dict[str, str] | None = None) -> int:
    """About how much /dev/shm vLLM's rings take for TP x PP workers (0 for one worker)."""
    workers = max(1, tp) * max(1, pp)
    if workers < 2:
        return 0
    raw = (env or {}).get(CHUNK_VAR, "").strip()
    chunk = int(raw) if raw.isascii() and raw.isdigit() and 0 < int(raw) <= 4096 else DEFAULT_CHUNK_MB
    return (chunk * CHUNKS + workers * RESPONSE_CHUNK_MB * CHUNKS) * MIB
