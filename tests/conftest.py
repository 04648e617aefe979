"""Shared fixtures: process reaping by token and stand-in roots live in proctools."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from proctools import proc_token, standin_root  # noqa: E402,F401
