"""How the pages write times, rates and shares (Jinja filters)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

_UNITS = (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0))


def ago(seconds: float | None) -> str:
    """`3d 4h`, `12m 5s`, `40s`, `0.4s`: two units at most."""
    if seconds is None:
        return "-"
    if abs(seconds) < 10:
        return f"{seconds:.1f}s"
    sign, left = ("-" if seconds < 0 else ""), abs(seconds)
    parts: list[str] = []
    for unit, size in _UNITS:
        if left >= size or parts:
            n = int(left // size)
            parts.append(f"{n}{unit}")
            left -= n * size
        if len(parts) == 2:
            break
    return sign + " ".join(parts)


def when(value: datetime | None) -> str:
    """UTC, to the second: `2026-12-01 10:22:03Z`."""
    if value is None:
        return "-"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def clock(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(timezone.utc).strftime("%H:%M:%S")


def rate(per_second: float | None) -> str:
    if per_second is None:
        return "-"
    if per_second >= 100:
        return f"{per_second:,.0f}/s"
    if per_second >= 1:
        return f"{per_second:.1f}/s"
    return f"{per_second * 60:.1f}/min"


def pct(part: float, whole: float) -> float:
    """`part` as a percentage of `whole` (0 for an empty whole), to two decimals: an SVG width."""
    return round(100.0 * part / whole, 2) if whole > 0 else 0.0


def number(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def as_json(value: Any) -> str:
    """A child's arguments as the failures table shows them."""
    return json.dumps(value, default=repr, ensure_ascii=False)


FILTERS = {"ago": ago, "when": when, "clock": clock, "rate": rate, "number": number, "as_json": as_json}
