"""Quantities as people read them: sizes, ages, a command cut to a width. Pure, no imports.

A leaf: the checks write sizes into their messages with it, and every renderer shows them
with it, so a size reads the same in a finding, a table and a plain line.
"""

from __future__ import annotations


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // (size // 60 if unit != 'd' else 3600)}" + (
                "h" if unit == "d" else ("m" if unit == "h" else "s")
            )
    return f"{s}s"


def shorten(text: str, width: int = 60) -> str:
    """`text`, cut to `width` characters with an ellipsis when longer."""
    return text if len(text) <= width else text[: width - 1] + "…"
