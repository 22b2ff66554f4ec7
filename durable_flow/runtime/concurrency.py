"""How many tasks a worker runs at once: the controller protocol, what it reports, and the
fixed limit. The adaptive control loop is in `adaptive`; `controllers` parses the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Adjustment:
    """One move of the live limit, with the reason shown on the worker's card."""

    at_ms: int
    old_limit: int
    new_limit: int
    reason: str


@dataclass(frozen=True, slots=True)
class ResourceSample:
    """What the control loop sees at a tick: the process's memory and CPU use."""

    ram_pct: float
    cpu_pct: float
    in_flight: int


class ConcurrencyController(Protocol):
    """Owns the live limit of a worker."""

    mode: str
    limit: int
    max_limit: int
    tick_ms: int
    last_adjustment: Adjustment | None

    def record(self, latency_ms: float, ok: bool, kind: str = "") -> None:
        """A task finished after `latency_ms`; `ok` is False for an error or a stall; `kind`
        ("turn", "step") tells apart work whose latencies are not comparable."""

    def tick(self, now_ms: int, sample: ResourceSample) -> Adjustment | None:
        """Decide the next limit; return the adjustment if it moved."""


class FixedConcurrency:
    """A limit that never moves."""

    mode = "fixed"
    tick_ms = 2000

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.max_limit = limit
        self.last_adjustment: Adjustment | None = None

    def record(self, latency_ms: float, ok: bool, kind: str = "") -> None:
        return None

    def tick(self, now_ms: int, sample: ResourceSample) -> Adjustment | None:
        return None


"""Most threads one worker may run: each holds a database connection, and a typo such as
`10**30` should fail `manage.py check`, not the thread pool at worker start."""
