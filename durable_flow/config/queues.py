"""Flow-control queue configuration: one frozen value object, validated once.

A queue is declared in `settings.DURABLE_FLOW["QUEUES"]` or with `register_queue(...)`; both
build the same `QueueConfig`. Invalid values raise `InvalidQueueConfig` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from durable_flow.config.limits import QUEUE_NAME_LENGTH
from durable_flow.config.validation import (
    MAX_COUNT,
    MAX_DURATION_MS,
    number_problem,
    start_timeout_outcome_problem,
    start_timeout_problem,
)
from durable_flow.exceptions import InvalidQueueConfig, InvalidStartTimeout

Algorithm = Literal["fixed", "sliding"]
Fairness = Literal["fifo", "key"]
Order = Literal["fifo", "lifo"]
Per = Literal["global", "key"]
OnStartTimeout = Literal["fail", "skip"]


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most `limit` admissions per `period_ms`, counted in a fixed or a sliding window."""

    limit: int
    period_ms: int
    algorithm: Algorithm = "fixed"


@dataclass(frozen=True, slots=True)
class Throttle:
    """GCRA: starts spaced `period_ms / limit` apart, up to `burst` at once; it delays, never
    drops. `per="key"` gives every fairness key its own stored timestamp (TAT)."""

    limit: int
    period_ms: int
    burst: int = 1
    per: Per = "global"

    @property
    def interval_ms(self) -> float:
        """The spacing between starts once the burst is spent."""
        return self.period_ms / self.limit

    @property
    def tolerance_ms(self) -> float:
        """How far ahead of now the TAT may run and still admit: what makes a burst."""
        return (self.burst - 1) * (self.period_ms / self.limit)


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """A named cap that `ctx.step(..., queue=name)` calls opt into."""

    name: str
    concurrency: int | None = None
    rate_limit: RateLimit | None = None
    retry_ms: int = 1000
    fairness: Fairness = "fifo"
    order: Order = "fifo"
    key_rate_limit: RateLimit | None = None
    throttle: Throttle | None = None
    #: How long a call may wait in this queue's line before it gives up (seconds; None: for as
    #: long as it takes), unless the call gives its own `start_timeout`; and what it then does.
    #: Engine policy: the backends decide admission without it.
    start_timeout_s: float | None = None
    on_start_timeout: OnStartTimeout = "fail"

    @property
    def keyed(self) -> bool:
        """Whether a per-key window or a throttle applies (`durable_flow.admission.rules.keyed`)."""
        return self.key_rate_limit is not None or self.throttle is not None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form persisted on `FlowQueue.config` and shown in the admin."""
        return asdict(self)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "queue") -> QueueConfig:
        """Parse and validate a settings dict; `where` prefixes error messages."""
        if not isinstance(raw, Mapping):
            raise InvalidQueueConfig(f"{where}: expected a dict, got {type(raw).__name__}")
        known = {
            "name",
            "concurrency",
            "rate_limit",
            "retry_ms",
            "fairness",
            "order",
            "throttle",
            "start_timeout_s",
            "on_start_timeout",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidQueueConfig(f"{where}: unknown option(s) {', '.join(unknown)}")
        return cls.build(
            name=raw.get("name"),  # type: ignore[arg-type]
            concurrency=raw.get("concurrency"),
            rate_limit=raw.get("rate_limit"),
            throttle=raw.get("throttle"),
            retry_ms=raw.get("retry_ms", 1000),
            fairness=raw.get("fairness", "fifo"),
            order=raw.get("order", "fifo"),
            where=where,
            start_timeout_s=raw.get("start_timeout_s"),
            on_start_timeout=raw.get("on_start_timeout", "fail"),
        )

    @classmethod
    def build(
        cls,
        *,
        name: str,
        concurrency: int | None = None,
        rate_limit: RateLimit | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        retry_ms: int = 1000,
        fairness: str = "fifo",
        order: str = "fifo",
        where: str = "queue",
        key_rate_limit: RateLimit | None = None,
        throttle: Throttle | Mapping[str, Any] | None = None,
        start_timeout_s: float | None = None,
        on_start_timeout: str = "fail",
    ) -> QueueConfig:
        """Validate keyword options (the `register_queue` form). `rate_limit` is one window or
        a list of a global and a per-key one (`"per": "key"`). A bad `start_timeout_s` or
        `on_start_timeout` is an `InvalidStartTimeout` (its own `manage.py check` id)."""
        longest = QUEUE_NAME_LENGTH
        if not isinstance(name, str) or not name.strip() or len(name) > longest or "\x00" in name:
            raise InvalidQueueConfig(f"{where}.name: a non-empty string of at most {longest} characters is required")
        where = f"{where} {name!r}"
        if concurrency is not None:
            _check_count(concurrency, f"{where}.concurrency", "(or omitted)")
        rate_limit, per_key = _rate_limits(rate_limit, f"{where}.rate_limit")
        if per_key is not None and key_rate_limit is not None:
            raise InvalidQueueConfig(f"{where}.rate_limit: a per-key window is given twice")
        key_rate_limit = key_rate_limit or per_key
        if isinstance(throttle, Mapping):
            throttle = _throttle(throttle, f"{where}.throttle")
        elif throttle is not None and not isinstance(throttle, Throttle):
            raise InvalidQueueConfig(f"{where}.throttle: expected a dict with limit, period_ms and burst")
        _check_duration_ms(retry_ms, f"{where}.retry_ms")
        if fairness not in ("fifo", "key"):
            raise InvalidQueueConfig(f"{where}.fairness: must be 'fifo' or 'key', got {fairness!r}")
        if order not in ("fifo", "lifo"):
            raise InvalidQueueConfig(f"{where}.order: must be 'fifo' or 'lifo', got {order!r}")
        if start_timeout_s is not None and (problem := start_timeout_problem(start_timeout_s, seconds_only=True)):
            raise InvalidStartTimeout(f"{where}.start_timeout_s: {problem} (or omitted)")
        if problem := start_timeout_outcome_problem(on_start_timeout):
            raise InvalidStartTimeout(f"{where}.on_start_timeout: {problem}")
        return cls(
            name=name,
            concurrency=concurrency,
            rate_limit=rate_limit,
            retry_ms=retry_ms,
            fairness=fairness,  # type: ignore[arg-type]
            order=order,  # type: ignore[arg-type]
            key_rate_limit=key_rate_limit,
            throttle=throttle,
            start_timeout_s=None if start_timeout_s is None else float(start_timeout_s),
            on_start_timeout=on_start_timeout,  # type: ignore[arg-type]
        )


def _check_count(value: object, what: str, note: str = "") -> None:
    """A count (concurrency, limit, burst): an int from 1 to what every backend stores."""
    problem = number_problem(value, minimum=1, maximum=MAX_COUNT, integer=True)
    if problem:
        raise InvalidQueueConfig(f"{what}: {problem}{f' {note}' if note else ''}")


def _check_duration_ms(value: object, what: str) -> None:
    """A duration in whole milliseconds, from 1 to ten years."""
    problem = number_problem(value, minimum=1, maximum=MAX_DURATION_MS, integer=True, unit="milliseconds")
    if problem:
        raise InvalidQueueConfig(f"{what}: {problem}")


def _rate_limits(raw: object, where: str) -> tuple[RateLimit | None, RateLimit | None]:
    """(global window, per-key window) from one window, a `RateLimit`, or a list of both."""
    if raw is None or isinstance(raw, RateLimit):
        return raw, None
    if isinstance(raw, Mapping):
        entries: list[tuple[str, Any]] = [(where, raw)]
    elif isinstance(raw, Sequence) and not isinstance(raw, str) and 1 <= len(raw) <= 2:
        entries = [(f"{where}[{i}]", entry) for i, entry in enumerate(raw)]
    else:
        raise InvalidQueueConfig(f"{where}: expected a dict with limit and period_ms, or a list of two")
    windows: dict[str, RateLimit] = {}
    for at, entry in entries:
        if isinstance(entry, Mapping) and entry.get("per", "global") not in ("global", "key"):
            raise InvalidQueueConfig(f"{at}.per: must be 'global' or 'key', got {entry.get('per')!r}")
        per = entry.get("per", "global") if isinstance(entry, Mapping) else "global"
        if per in windows:
            raise InvalidQueueConfig(f"{at}: at most one {per} window (give one global and one per-key)")
        windows[per] = _rate_limit(entry, at)
    return windows.get("global"), windows.get("key")


def resized_windows(current: QueueConfig, new: object) -> tuple[RateLimit | None, RateLimit | None]:
    """(global, per-key) windows after `update_queue(rate_limit=new)`: None removes both, a list
    replaces both, one window replaces only its own kind (so resizing the global window from
    the dashboard keeps a per-key one)."""
    if new is None:
        return None, None
    rate, per_key = _rate_limits(new, f"queue {current.name!r}.rate_limit")
    if isinstance(new, Sequence) and not isinstance(new, str):
        return rate, per_key
    return (current.rate_limit, per_key) if per_key is not None else (rate, current.key_rate_limit)


def _throttle(raw: Mapping[str, Any], where: str) -> Throttle:
    unknown = sorted(set(raw) - {"limit", "period_ms", "burst", "per"})
    if unknown:
        raise InvalidQueueConfig(f"{where}: unknown option(s) {', '.join(unknown)}")
    limit, period_ms, burst = raw.get("limit"), raw.get("period_ms"), raw.get("burst", 1)
    per = raw.get("per", "global")
    _check_limit_and_period(limit, period_ms, where)
    _check_count(burst, f"{where}.burst")
    if per not in ("global", "key"):
        raise InvalidQueueConfig(f"{where}.per: must be 'global' or 'key', got {per!r}")
    return Throttle(limit=limit, period_ms=period_ms, burst=burst, per=per)  # type: ignore[arg-type]


def _check_limit_and_period(limit: object, period_ms: object, where: str) -> None:
    _check_count(limit, f"{where}.limit")
    _check_duration_ms(period_ms, f"{where}.period_ms")


def _rate_limit(raw: Mapping[str, Any], where: str) -> RateLimit:
    if not isinstance(raw, Mapping):
        raise InvalidQueueConfig(f"{where}: expected a dict with limit and period_ms")
    unknown = sorted(set(raw) - {"limit", "period_ms", "algorithm", "per"})
    if unknown:
        raise InvalidQueueConfig(f"{where}: unknown option(s) {', '.join(unknown)}")
    limit, period_ms = raw.get("limit"), raw.get("period_ms")
    algorithm = raw.get("algorithm", "fixed")
    _check_limit_and_period(limit, period_ms, where)
    if algorithm not in ("fixed", "sliding"):
        raise InvalidQueueConfig(f"{where}.algorithm: must be 'fixed' or 'sliding', got {algorithm!r}")
    return RateLimit(limit=limit, period_ms=period_ms, algorithm=algorithm)  # type: ignore[arg-type]


def queue_from_dict(data: Mapping[str, Any]) -> QueueConfig:
    """Rebuild a config from its `as_dict()` form (as stored on `FlowQueue`)."""
    data = dict(data)
    rate, per_key, throttle = data.pop("rate_limit", None), data.pop("key_rate_limit", None), data.pop("throttle", None)
    return QueueConfig.build(
        rate_limit=RateLimit(**rate) if rate else None,
        key_rate_limit=RateLimit(**per_key) if per_key else None,
        throttle=Throttle(**throttle) if throttle else None,
        **data,
    )
