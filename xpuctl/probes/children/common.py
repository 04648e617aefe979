"""What every deep probe child does last: one JSON line on stdout (ASCII, so no host text can
reach a terminal raw), written whole to the pipe the parent reads."""

from __future__ import annotations

import json
import os
from typing import Any


def emit(result: dict[str, Any]) -> None:
    data = ("\n" + json.dumps(result, ensure_ascii=True) + "\n").encode("ascii")
    while data:
        data = data[os.write(1, data):]
