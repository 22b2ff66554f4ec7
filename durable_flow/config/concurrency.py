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

from durable_flow.config.validation import number_problem

#: The most threads one worker process runs tasks on.
MAX_CONCURRENCY = 1024
#: The slowest control loop: a tick at most once a minute (a longer one adapts to nothing).
MAX_TICK_MS = 60_000
ADAPTIVE_FIELDS = ("mode", "min", "max", "start", "tick_ms", "ram_ceiling_pct", "cpu_ceiling_pct")
DEFAULT_SETTING = 'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]'


@dataclass(frozen=True, slots=True)
class AdaptiveSpec:
    """The bounds of an adaptive worker's live limit and its control loop."""

    min_limit: int = 1
    max_limit: int = 32
    start: int = 1
    tick_ms: int = 2000
    ram_ceiling_pct: float = 85.0
    cpu_ceiling_pct: float | None = None


def parse_concurrency(spec: object, setting: str = DEFAULT_SETTING) -> int | AdaptiveSpec:
    """A fixed thread count or an `AdaptiveSpec`; `ImproperlyConfigured` names the setting."""
    if spec == "adaptive" or (isinstance(spec, Mapping) and spec.get("mode") == "adaptive"):
        return _adaptive(spec if isinstance(spec, Mapping) else {}, setting)
    problem = number_problem(spec, minimum=1, maximum=MAX_CONCURRENCY, integer=True)
    if problem:
        raise ImproperlyConfigured(f"{setting}: {problem} (or 'adaptive', or an adaptive spec dict)")
    return int(spec)  # type: ignore[call-overload]  # an int, checked above


def _adaptive(options: Mapping[str, Any], setting: str) -> AdaptiveSpec:
    unknown = sorted(set(options) - set(ADAPTIVE_FIELDS))
    if unknown:
        raise ImproperlyConfigured(
            f"{setting}: unknown adaptive field(s) {', '.join(unknown)} (known: {', '.join(ADAPTIVE_FIELDS)})"
        )
    if options.get("mode", "adaptive") != "adaptive":
        raise ImproperlyConfigured(f'{setting}["mode"]: must be "adaptive", got {options.get("mode")!r}')

    def checked(name: str, default: float | None, **bounds: Any) -> Any:
        value = options.get(name, default)
        problem = number_problem(value, **bounds)
        if problem:
            raise ImproperlyConfigured(f'{setting}["{name}"]: {problem}')
        return value

    def integer(name: str, default: int, low: int, high: int, unit: str = "") -> int:
        return int(checked(name, default, minimum=low, maximum=high, integer=True, unit=unit))

    def percent(name: str, default: float | None) -> float | None:
        if options.get(name, default) is None and default is None:
            return None
        return float(checked(name, default, minimum=0, maximum=100, above_minimum=True, unit="percent"))

    min_limit = integer("min", 1, 1, MAX_CONCURRENCY)
    max_limit = integer("max", max(32, min_limit), 1, MAX_CONCURRENCY)
    if max_limit < min_limit:
        raise ImproperlyConfigured(f'{setting}["max"]: must be ≥ min ({min_limit}), got {max_limit}')
    start = integer("start", min_limit, 1, MAX_CONCURRENCY)
    if not min_limit <= start <= max_limit:
        raise ImproperlyConfigured(f'{setting}["start"]: must be within [min, max] = [{min_limit}, {max_limit}]')
    tick_ms = integer("tick_ms", 2000, 10, MAX_TICK_MS, unit="milliseconds")
    ram = percent("ram_ceiling_pct", 85.0)
    assert ram is not None
    return AdaptiveSpec(
        min_limit=min_limit,
        max_limit=max_limit,
        start=start,
        tick_ms=tick_ms,
        ram_ceiling_pct=ram,
        cpu_ceiling_pct=percent("cpu_ceiling_pct", None),
    )
