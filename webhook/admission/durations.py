"""Durations in policy YAML: ``30s``, ``15m``, ``1h30m``, ``2d``, or a plain number of seconds."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
DURATION_PATTERN = r"^((\d+(\.\d+)?)(ms|s|m|h|d))+$"
DURATION_HINT = "a duration like 30s, 15m or 2h"
"""How errors describe what a duration looks like (never with the regular expression)."""
MAX_DURATION = 100 * 365 * 86400.0
"""The longest duration a policy may name (100 years, in seconds): longer ones overflow date arithmetic."""


def parse_duration(value: str | float) -> float:
    """Seconds in ``value`` (``"90s"``, ``"15m"``, ``"1h30m"``, ``45``); raises ValueError when malformed,
    negative or longer than ``MAX_DURATION``."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not {DURATION_HINT}")
    if isinstance(value, int | float):
        if not 0 <= value <= MAX_DURATION:
            raise ValueError(f"duration must be from 0 to {MAX_DURATION:.0f} seconds (100 years): {value!r}")
        return float(value)
    text = value.strip()
    pos = 0
    total = 0.0
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ValueError(f"{value!r} is not {DURATION_HINT} (or 1h30m, 500ms)")
    if not total <= MAX_DURATION:
        raise ValueError(f"duration must be at most 100 years: {value!r}")
    return total


def format_duration(seconds: float) -> str:
    """Render seconds compactly for messages: ``90`` -> ``1m30s``, ``3600`` -> ``1h``."""
    if seconds < 1:
        return f"{max(seconds, 0.0):.1f}s"
    s = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    return "".join(parts)
