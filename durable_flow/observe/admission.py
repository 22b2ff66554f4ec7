"""What the admission backend knows, as the pages and the metrics read it: a queue's slots, line
and window; the busiest keys of its per-key window and of its throttle; the busiest keys of each
step-concurrency constraint.

The backend (`get_engine().admission`) is the one place that holds these numbers under every
backend (`local`, `db`, `redis`); these functions are the read model's only way to it, so the
dashboard, the admin and the metrics endpoint ask it the same questions the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.admission.rules.keyed import throttle_standing
from durable_flow.config.queues import Throttle
from durable_flow.config.settings import get_settings
from durable_flow.engine import get_engine
from durable_flow.observe.constraint_usage import constraint_rows
from durable_flow.observe.sampling import waiting_now

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class QueueUsage:
    """A queue's numbers in the admission backend now (None: the backend cannot tell)."""

    in_flight: int | None
    waiting: int | None
    window_used: int | None


def queue_usage(queue: str, parked: int = 0) -> QueueUsage:
    """Slots held, calls waiting and step starts in the rate window of `queue`. `parked`: the
    calls parked on it by the checkpoints, which `waiting` never reports fewer than (a parked call
    the backend lost waits until the poller re-offers it)."""
    admission = get_engine().admission
    return QueueUsage(
        in_flight=admission.in_flight(queue),
        waiting=waiting_now(admission, queue, parked),
        window_used=admission.window_usage(queue),
    )


def fleet_in_flight(queues: Iterable[str], recorded: Mapping[str, int]) -> dict[str, int]:
    """Slots held per queue across every process. The backend's figure where it is shared (`db`,
    `redis`); `recorded` (the checkpoints holding a slot) under `local`, which counts per process,
    so this web process's figure would say nothing of the workers', and for a queue whose
    backend does not answer: a scrape must answer."""
    admission = get_engine().admission
    shared = not isinstance(admission, LocalAdmissionBackend)
    held = {}
    for queue in queues:
        held[queue] = recorded.get(queue, 0)
        if shared:
            try:
                value = admission.in_flight(queue)
            except Exception:  # an unreachable backend falls back to the rows
                logger.warning("admission backend in_flight(%r) failed", queue, exc_info=True)
            else:
                held[queue] = held[queue] if value is None else value
    return held


def key_windows(queue: str, rate: Mapping[str, Any] | None, top: int = 10) -> list[dict[str, Any]] | None:
    """The busiest keys of a per-key window: step starts in each key's current window against
    its limit (None without a per-key window, or when the backend cannot tell)."""
    usage = get_engine().admission.key_window_usage(queue, top) if rate else None
    if usage is None or rate is None:
        return None
    return [{"key": key, "used": used, "pct": min(100, round(100 * used / rate["limit"]))} for key, used in usage]


def throttle_buckets(queue: str, throttle: Mapping[str, Any] | None, top: int = 10) -> list[dict[str, Any]] | None:
    """The throttle's busiest buckets: how far each one's start TAT runs ahead of now, the
    starts it may make at once and when its next start conforms (None without a throttle, or
    when the backend cannot tell)."""
    usage = get_engine().admission.throttle_usage(queue, top) if throttle else None
    if usage is None or throttle is None:
        return None
    config = Throttle(**throttle)
    rows = []
    for bucket, ahead_ms in usage:
        free_now, next_in_ms = throttle_standing(config, ahead_ms)
        rows.append({"key": bucket, "ahead_s": ahead_ms / 1000, "free_now": free_now, "next_in_s": next_in_ms / 1000})
    return rows


def step_concurrency(top: int = 10) -> list[dict[str, Any]]:
    """The declared step-concurrency constraints with their `top` busiest keys, under this
    deployment's environment (`constraint_usage.constraint_rows`): the admin's queue list and
    the dashboard's queues page."""
    return constraint_rows(get_engine().admission, get_settings().environment, top)
