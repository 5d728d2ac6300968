"""Duration phrases used everywhere in the config: ``30s``, ``5m``, ``4w3d2h1m``, ``500ms`` or a
plain number of seconds."""

from __future__ import annotations

import math
import re
from datetime import timedelta

_UNITS = {
    "w": 7 * 86400.0,
    "d": 86400.0,
    "h": 3600.0,
    "m": 60.0,
    "s": 1.0,
    "ms": 0.001,
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|w|d|h|m|s)")  # "5.s" and ".5s" as Go reads them
# A capital M is a month in some tools (humantime's "1M", ISO 8601's P1M) and a minute here: a
# retention of "1M" meant as a month would delete after a minute, so it is refused, not guessed.
_CAPITAL_M = re.compile(r"\dM(?![sS])")
# Larger than any retention anyone means and still far inside timedelta's range.
MAX_SECONDS = 100 * 365 * 86400


def parse_duration(value: object) -> timedelta:
    """Parse a non-negative duration; raise ``ValueError`` with a readable message otherwise."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ValueError("expected a duration like '30s', '5m', '7d' or a number of seconds")
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        if _CAPITAL_M.search(value):
            raise ValueError(f"invalid duration {value!r}: 'M' reads as a month in some tools and a minute "
                             "in others: write 'm' for minutes, or days ('30d') for about a month")
        if not text:
            raise ValueError("empty duration")
        try:
            seconds = float(text)
        except ValueError:
            seconds = _parse_phrase(text.removeprefix("+"), value)
    else:
        raise ValueError("expected a duration like '30s', '5m', '7d' or a number of seconds")
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"invalid duration {value!r}")
    if seconds < 0:
        raise ValueError(f"duration must not be negative, got {value!r}")
    if seconds > MAX_SECONDS:
        raise ValueError(f"duration {value!r} is too large (at most 100 years)")
    return timedelta(seconds=seconds)


def _parse_phrase(text: str, original: object) -> float:
    pos = 0
    total = 0.0
    seen: set[str] = set()
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        unit = match.group(2)
        if unit in seen:
            raise ValueError(f"unit {unit!r} repeated in duration {original!r}")
        seen.add(unit)
        total += float(match.group(1)) * _UNITS[unit]
        pos = match.end()
    if pos != len(text) or not seen:
        raise ValueError(
            f"invalid duration {original!r}: use forms like '30s', '5m', '1h', '7d', '4w3d2h1m' "
            "or a number of seconds"
        )
    return total


def format_duration(td: timedelta | None) -> str:
    """Render a duration back into the compact phrase form (``-1`` for "forever")."""
    if td is None:
        return "-1"
    total = td.total_seconds()
    if td.microseconds:  # milliseconds, with the microseconds as decimals ("0.4ms", not "0ms")
        whole, micros = divmod(td // timedelta(microseconds=1), 1000)
        return f"{whole}.{micros:03d}".rstrip("0").rstrip(".") + "ms"
    total = int(total)
    if total == 0:
        return "0s"
    out = []
    for unit in ("w", "d", "h", "m", "s"):
        size = int(_UNITS[unit])
        if total >= size:
            out.append(f"{total // size}{unit}")
            total %= size
    return "".join(out)
