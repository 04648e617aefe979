"""docs/try-without-a-gpu.md runs as written (issue 32 §6), so that it cannot rot.

Every ```sh block of the page not marked `<!-- not run by the tests ... -->` (the install and
the real vLLM, which download) is run one command at a time, in order, from the top of the
repository, with this interpreter's directory first on PATH (`python`, `xpuctl`). A command
exits 0 unless its comment says `exit N`. What the page fixes is changed only where this
machine needs it: its directory (`/tmp/xpuctl-try`, a fresh one) and its ports (8000, 8001,
free ones). `export` lines set the environment of the commands after them. Every process
carries the rig's token, so whatever a failure leaves is reaped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from proctools import free_port

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "try-without-a-gpu.md"
SKIP = "<!-- not run by the tests"


def blocks(text: str) -> list[list[str]]:
    """The commands of each ```sh block not marked to skip (continuations joined)."""
    out = []
    for m in re.finditer(r"(?P<before>[^\n]*)\n```sh\n(?P<body>.*?)\n```", text, re.S):
        if m.group("before").startswith(SKIP):
            continue
        lines, joined = [], ""
        for line in m.group("body").splitlines():
            joined += line[:-1] + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                if joined.strip() and not joined.lstrip().startswith("#"):
                    lines.append(joined.strip())
                joined = ""
        out.append(lines)
    return out


def expected_exit(command: str) -> int:
    m = re.search(r"#.*\bexit (\d+)\b", command)
    return int(m.group(1)) if m else 0


def test_the_page_is_linked_from_the_readme():
    assert "(docs/try-without-a-gpu.md)" in (REPO / "README.md").read_text()
    assert [len(b) for b in blocks(PAGE.read_text())] == [8, 9, 2]  # what this test runs


def test_the_pages_commands_run(rig):
    try_dir = tempfile.mkdtemp(prefix="xt", dir="/tmp")  # short: unix socket paths
    swap = {"/tmp/xpuctl-try": try_dir, "8000": str(free_port()), "8001": str(free_port())}
    env = {k: v for k, v in rig.env().items()
           if k not in ("XPUCTL_ROOT", "XPUCTL_STATE_DIR", "COLUMNS")}
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"
    said = []
    try:
        for block in blocks(PAGE.read_text()):
            for command in block:
                for old, new in swap.items():
                    command = re.sub(rf"(?<![\w/]){re.escape(old)}(?![\w])", new, command)
                if command.startswith("export "):
                    for pair in shlex.split(command[len("export "):].split("#")[0]):
                        key, _, value = pair.partition("=")
                        env[key] = value
                    continue
                p = subprocess.run(["bash", "-c", command], env=env, cwd=REPO, text=True,
                                   capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
                said.append(f"$ {command}\n{p.stdout}{p.stderr}")
                assert "Traceback" not in p.stdout + p.stderr, said[-1]
                assert p.returncode == expected_exit(command), "\n".join(said)
        text = "\n".join(said)
        assert "FAIL orphans" in text  # the fake host's orphans, as the page says
        assert "xpuctl: next step: " in text  # the hung start's one next command
    finally:
        stop = {**env, "XPUCTL_ROOT": f"{try_dir}/standin", "XPUCTL_STATE_DIR": f"{try_dir}/state"}
        for name in (f"vllm-{swap['8000']}", f"vllm-{swap['8001']}"):
            subprocess.run(["bash", "-c", f"xpuctl shutdown {name}"], env=stop, cwd=REPO,
                           capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
        shutil.rmtree(try_dir, ignore_errors=True)
    rig.assert_clean()
