"""vLLM on Ray: ask a Ray cluster from a child Python that has ray, never from xpuctl itself.

`bridge` (this process) picks the Python and the address and runs `child` (that Python) with
a hard deadline; `child` talks to Ray and answers with one JSON document. `actors` ties Ray
actor processes to their vLLM run from Ray's state; `cluster` runs `node` (doctor, ps or devices) on every
node of a cluster as a Ray task; `launch` and `teardown` serve `serve` and `shutdown`.
"""
