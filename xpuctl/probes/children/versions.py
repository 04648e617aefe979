"""The versions child: the installed versions of the Python packages of the stack, from
package metadata (importlib.metadata), with nothing imported. Run as
`python -m xpuctl.probes.children.versions NAME...`; prints one JSON line
(`xpuctl.parse.versions.parse_packages`)."""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any

from xpuctl.probes.children.common import run


def _versions() -> dict[str, Any]:
    found: dict[str, str | None] = {}
    for name in sys.argv[1:]:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return {"python": sys.version.split()[0], "packages": found}


if __name__ == "__main__":
    run(_versions, lambda why: {"python": sys.version.split()[0], "packages": {}, "error": why})
