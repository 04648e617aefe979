"""Shared by the stand-ins: the scenario a test wrote (JSON at $XPUCTL_STANDIN), and hangs.

Not the real libraries: each stand-in reproduces the documented API shape and failure of one
GPU stack (see tests/test_deep.py), driven by the scenario's section for it.
"""

import json
import os
import subprocess
import sys
import time


def section(name):
    path = os.environ.get("XPUCTL_STANDIN")
    if not path:
        return {}
    with open(path) as f:
        data = json.load(f)
    seen = data.get("record_env")
    if seen:  # what the probe's environment held, for the test to check
        with open(f"{seen}.{name}", "w") as f:
            json.dump(dict(os.environ), f)
    return data.get(name) or {}


def delay(conf):
    """`sleep`: answer late; `hang`: never answer, with a grandchild in the same group."""
    if conf.get("sleep"):
        time.sleep(conf["sleep"])
    if conf.get("hang"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if conf.get("pidfile"):
            with open(conf["pidfile"], "w") as f:
                f.write(f"{os.getpid()} {child.pid}\n")
        time.sleep(600)
