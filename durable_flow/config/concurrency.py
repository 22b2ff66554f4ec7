"""`TRANSPORT["CONCURRENCY"]`, validated once: a number of threads, `"adaptive"`, or a dict
`{"mode": "adaptive", "min": 1, "max": 32, "start": 1, "tick_ms": 2000, "ram_ceiling_pct": 85,
"cpu_ceiling_pct": None}`.

The transports carry the value and check it when they are built (`manage.py check` and the
`rq` transport's constructor); the worker runtime (`durable_flow.runtime.controllers`) turns the
parsed value into a controller. Both read this one parser.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from durable_flow.config.options import Option, number, one_of, optional, parse_options

#: The most threads one worker process runs tasks on.
MAX_CONCURRENCY = 1024
#: The slowest control loop: a tick at most once a minute (a longer one adapts to nothing).
MAX_TICK_MS = 60_000
DEFAULT_SETTING = 'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]'
_THREADS = number(1, MAX_CONCURRENCY, integer=True)
_PERCENT = number(0, 100, above_minimum=True, unit="percent")
#: The fields of an adaptive spec dict.
ADAPTIVE_OPTIONS = {
    "mode": Option('"adaptive" (a dict without it is not an adaptive spec).', one_of("adaptive")),
    "min": Option("The fewest threads (default 1).", _THREADS),
    "max": Option("The most threads (default 32, or min if higher); at least min.", _THREADS),
    "start": Option("The threads at start (default min); within [min, max].", _THREADS),
    "tick_ms": Option(
        "The control loop's period (default 2000 ms).", number(10, MAX_TICK_MS, integer=True, unit="milliseconds")
    ),
    "ram_ceiling_pct": Option("The memory use above which the limit shrinks (default 85).", _PERCENT),
    "cpu_ceiling_pct": Option("The CPU use above which the limit shrinks (default None: none).", optional(_PERCENT)),
}


@dataclass(frozen=True, slots=True)
class AdaptiveSpec:
    """The bounds of an adaptive worker's live limit and its control loop."""

    min_limit: int = 1
    max_limit: int = 32
    start: int = 1
    tick_ms: int = 2000
    ram_ceiling_pct: float = 85.0
    cpu_ceiling_pct: float | None = None


def parse_worker_concurrency(spec: object, setting: str = DEFAULT_SETTING) -> int | AdaptiveSpec:
    """A fixed thread count or an `AdaptiveSpec`; `ImproperlyConfigured` names the setting."""
    if spec == "adaptive" or (isinstance(spec, Mapping) and spec.get("mode") == "adaptive"):
        return _adaptive(spec if isinstance(spec, Mapping) else {}, setting)
    problem = _THREADS(spec)
    if problem:
        raise ImproperlyConfigured(f"{setting}: {problem} (or 'adaptive', or an adaptive spec dict)")
    return int(spec)  # type: ignore[call-overload]  # an int, checked above


def _adaptive(options: Mapping[str, Any], setting: str) -> AdaptiveSpec:
    given = parse_options(ADAPTIVE_OPTIONS, options, setting)
    min_limit = given.get("min", 1)
    max_limit = given.get("max", max(32, min_limit))
    start = given.get("start", min_limit)
    # The rules across fields, once each field is within its own bounds.
    if max_limit < min_limit:
        raise ImproperlyConfigured(f'{setting}["max"]: must be ≥ min ({min_limit}), got {max_limit}')
    if not min_limit <= start <= max_limit:
        raise ImproperlyConfigured(f'{setting}["start"]: must be within [min, max] = [{min_limit}, {max_limit}]')
    cpu = given.get("cpu_ceiling_pct")
    return AdaptiveSpec(
        min_limit=min_limit,
        max_limit=max_limit,
        start=start,
        tick_ms=given.get("tick_ms", 2000),
        ram_ceiling_pct=float(given.get("ram_ceiling_pct", 85.0)),
        cpu_ceiling_pct=None if cpu is None else float(cpu),
    )
