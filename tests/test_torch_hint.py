"""One torch install hint, the right one (issue 32 §6): torch's XPU build comes from
PyTorch's own wheel index (PyTorch's "Getting Started on Intel GPU" notes), never PyPI's
torch (`pip install torch`, or an extra naming it: the CUDA build on Linux x86_64). The
probes say it from one constant (`TORCH_XPU_INSTALL`); the docs, README and pyproject say the
same command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from xpuctl.probes.children.common import TORCH_XPU_INSTALL

REPO = Path(__file__).resolve().parent.parent
NO_TORCH = Path(__file__).parent / "standins" / "no_torch"
INSTALL = re.compile(r"pip3? install [^\n`'\")]*\btorch\b[^\n`'\")]*")


def _texts() -> dict[Path, str]:
    files = [*REPO.glob("xpuctl/**/*.py"), *REPO.glob("docs/*.md"), REPO / "README.md",
             REPO / "pyproject.toml", *REPO.glob("deploy/**/*.md"), *REPO.glob("deploy/**/*.yaml")]
    return {f: f.read_text() for f in files}


def test_the_constant_is_pytorchs_xpu_index():
    assert TORCH_XPU_INSTALL == "pip install torch --index-url https://download.pytorch.org/whl/xpu"


def test_every_torch_install_hint_is_the_xpu_index():
    texts = _texts()
    found = {(f, m.strip()) for f, text in texts.items() for m in INSTALL.findall(text)}
    assert found, "no hint found: the pattern is wrong"
    # PyPI's bare `pip install torch` is named only as what not to do, beside the right one
    wrong = {(str(f.relative_to(REPO)), m) for f, m in found if m != TORCH_XPU_INSTALL
             and not (m == "pip install torch" and TORCH_XPU_INSTALL in texts[f])}
    assert not wrong, wrong
    assert not any("xpuctl[torch]" in t or "xpuctl[xpu]" in t for t in texts.values())


def test_the_probes_say_it_when_torch_is_missing():
    env = {**os.environ, "PYTHONPATH": str(NO_TORCH)}
    out = subprocess.run([sys.executable, "-m", "xpuctl.probes.children.torch_xpu"], env=env,
                         capture_output=True, text=True, timeout=120)
    reason = json.loads(out.stdout.strip().splitlines()[-1])["reason"]
    assert reason == f"torch is not installed (its XPU build: {TORCH_XPU_INSTALL})"
