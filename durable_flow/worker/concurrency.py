"""How many tasks a worker runs at once: a fixed number, or an adaptive control loop.

`TRANSPORT["CONCURRENCY"]` is a number, `"adaptive"`, or a dict
`{"mode": "adaptive", "min": 1, "max": 32, "start": 1, "tick_ms": 2000,
"ram_ceiling_pct": 85, "cpu_ceiling_pct": None}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from django.core.exceptions import ImproperlyConfigured

from durable_flow.validation import number_problem


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


MAX_CONCURRENCY = 1024
"""Most threads one worker may run: each holds a database connection, and a typo such as
`10**30` should fail `manage.py check`, not the thread pool at worker start."""


def build_controller(spec: object, setting: str = 'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]') -> ConcurrencyController:
    """Parse a CONCURRENCY setting into its controller; `ImproperlyConfigured` names the setting."""
    if spec == "adaptive" or (isinstance(spec, Mapping) and spec.get("mode") == "adaptive"):
        from durable_flow.worker.adaptive import AdaptiveConcurrency

        options: Mapping[str, Any] = spec if isinstance(spec, Mapping) else {}
        return AdaptiveConcurrency.from_spec(options, setting=setting)
    problem = number_problem(spec, minimum=1, maximum=MAX_CONCURRENCY, integer=True)
    if problem:
        raise ImproperlyConfigured(f"{setting}: {problem} (or 'adaptive', or an adaptive spec dict)")
    return FixedConcurrency(spec)  # type: ignore[arg-type]  # an int, checked above
