"""Template filters for the dashboard pages: durations and pretty JSON."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django import template
from django.utils import timezone

from durable_flow.config.validation import TooDeep
from durable_flow.observe.waits import ms_clock, when

register = template.Library()


@register.filter
def duration(seconds: float | None) -> str:
    """1 ms precision below a second, then 12.3 s, 4 m 05 s, 2 h 03 m."""
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} m {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} m"


@register.simple_tag
def server_ms() -> int:
    """The server's time now, in ms since the epoch: the page's clock for what live.js counts
    to now (`data-server-ms`), so a browser whose clock is off still counts from the server's."""
    return int(timezone.now().timestamp() * 1000)


@register.filter
def ms_time(value: datetime | None) -> str:
    """A time to the millisecond (UTC), e.g. 08:14:03.127."""
    if value is None:
        return "—"
    return ms_clock(value)


@register.filter
def at_when(value: datetime | None) -> str:
    """A time to the millisecond (UTC), with its date when it is not today's."""
    return when(value)


@register.filter
def pretty_json(value: Any) -> str:
    """Indented JSON; a value stored too deeply nested to read shows as its placeholder text."""
    if isinstance(value, TooDeep):
        return str(value)
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@register.filter
def period(ms: int | None) -> str:
    """A rate window in human units: 10000 → "10 s", 60000 → "1 min", 3600000 → "1 h"."""
    if not ms:
        return "—"
    for unit, size in (("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms} ms"
