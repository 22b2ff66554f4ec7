"""The `db` backend's per-key windows and throttle: `durable_flow.admission.rules.keyed` stated
over rows, inside the transaction that holds the queue row's lock (see `backend`).

- per-key windows: `AdmissionKeyMark(queue, fairness_key, kind, at_ms)`, kind "g" per grant and
  "s" per step start, deleted as soon as they fall out of their window (a range delete on the
  `(queue, kind, at_ms)` index at every decision), so after one period an idle key has no row;
- throttle: `AdmissionKeyTat(queue, kind, bucket, tat)`, one row per bucket (a fairness key, or
  "" for a queue-wide throttle), deleted once its TAT is past (then it is as good as new).

Which keys are blocked is one grouped query over the keys active in the last period (not over
the waiters), and a grant excludes their waiters from its ranked scan.
"""

from __future__ import annotations

from django.db.models import Count

from durable_flow.admission.rules import keyed
from durable_flow.admission.rules.keyed import (
    GLOBAL_BUCKET,
    bucket,
    gcra_retry_at,
    gcra_take,
    key_window_start,
    later,
    start_lead_ms,
)
from durable_flow.admission.rules.windows import key_start_window, window_retry_at
from durable_flow.config.queues import QueueConfig
from durable_flow.models import AdmissionKeyMark, AdmissionKeyTat, AdmissionSlot, AdmissionWaiter

GRANT, START = "g", "s"


def prune(config: QueueConfig, now: int) -> None:
    """Delete marks outside their window and TATs already past (both invisible to answers)."""
    for kind, rate in ((GRANT, config.key_rate_limit), (START, key_start_window(config))):
        if rate is not None:
            marks = AdmissionKeyMark.objects.filter(queue=config.name, kind=kind)
            marks.filter(at_ms__lt=key_window_start(rate, now)).delete()
    if config.throttle is not None:
        AdmissionKeyTat.objects.filter(queue=config.name, tat__lte=now).delete()


def _marks(config: QueueConfig, kind: str, key: str) -> list[int]:
    rows = AdmissionKeyMark.objects.filter(queue=config.name, kind=kind, fairness_key=key)
    return list(rows.order_by("at_ms").values_list("at_ms", flat=True))


def _tat(config: QueueConfig, kind: str, name: str) -> float | None:
    return (
        AdmissionKeyTat.objects.filter(queue=config.name, kind=kind, bucket=name).values_list("tat", flat=True).first()
    )


def throttle_blocks_all(config: QueueConfig, now: int) -> int | None:
    """`keyed.throttle_blocks_all`: a queue-wide throttle's next conforming instant, or None."""
    throttle = config.throttle
    if throttle is None or throttle.per == "key":
        return None
    grants = gcra_retry_at(throttle, _tat(config, GRANT, GLOBAL_BUCKET), now)
    return later(grants, gcra_retry_at(throttle, _tat(config, START, GLOBAL_BUCKET), now, start_lead_ms(throttle)))


def key_blocked_until(config: QueueConfig, key: str, now: int) -> int | None:
    """`keyed.key_blocked_until` for one key."""
    until = None
    if config.key_rate_limit is not None and (start_rate := key_start_window(config)) is not None:
        until = keyed.key_window_retry_at(config.key_rate_limit, _marks(config, GRANT, key), now)
        until = later(until, keyed.key_window_retry_at(start_rate, _marks(config, START, key), now))
    throttle = config.throttle
    if throttle is not None and throttle.per == "key":
        until = later(until, gcra_retry_at(throttle, _tat(config, GRANT, key), now))
        until = later(until, gcra_retry_at(throttle, _tat(config, START, key), now, start_lead_ms(throttle)))
    return until


def blocked_keys(config: QueueConfig, now: int) -> set[str]:
    """Every key its own limits block now (pruning first), in a few set-wise queries: over the
    keys active in the last period (those with marks or a future TAT), never the waiting line,
    and with no query per key (when each reopens is asked only for keys that wait)."""
    prune(config, now)
    blocked: set[str] = set()
    for kind, rate in ((GRANT, config.key_rate_limit), (START, key_start_window(config))):
        if rate is not None:
            full = (
                AdmissionKeyMark.objects.filter(queue=config.name, kind=kind, at_ms__gte=key_window_start(rate, now))
                .values("fairness_key")
                .annotate(n=Count("id"))
                .filter(n__gte=rate.limit)
            )
            blocked.update(row["fairness_key"] for row in full)
    throttle = config.throttle
    if throttle is not None and throttle.per == "key":
        # The SQL filter is a hair wider than the rule (floats); `gcra_retry_at` decides exactly.
        lead = {GRANT: 0.0, START: start_lead_ms(throttle)}
        ahead = AdmissionKeyTat.objects.filter(queue=config.name, tat__gt=now + throttle.tolerance_ms - 1e-3)
        for name, kind, tat in ahead.values_list("bucket", "kind", "tat"):
            if gcra_retry_at(throttle, tat, now, lead[kind]) is not None:
                blocked.add(name)
    return blocked


def reopens_at(config: QueueConfig, marks: list[int], now: int, blocked: set[str]) -> int | None:
    """`policy.window_reopens_at`: when waiters held back by a window or throttle alone may
    next be granted."""
    rate = config.rate_limit
    if rate is None and not config.keyed:
        return None
    if not AdmissionWaiter.objects.filter(queue=config.name).exists():
        return None
    if config.concurrency is not None:
        if AdmissionSlot.objects.filter(queue=config.name).count() >= config.concurrency:
            return None  # a release grants them
    if rate is not None and (at := window_retry_at(rate, marks, now)) is not None:
        return at
    if not config.keyed:
        return None
    if (at := throttle_blocks_all(config, now)) is not None:
        return at
    waiting = AdmissionWaiter.objects.filter(queue=config.name, fairness_key__in=list(blocked))
    keys = set(waiting.values_list("fairness_key", flat=True).distinct())
    return min((until for key in keys if (until := key_blocked_until(config, key, now)) is not None), default=None)


def key_free(config: QueueConfig, key: str, now: int) -> bool:
    """Whether neither a queue-wide throttle nor the key's own limits hold a call of `key`."""
    prune(config, now)
    return throttle_blocks_all(config, now) is None and key_blocked_until(config, key, now) is None


def recheck(config: QueueConfig, key: str, now: int, blocked: set[str]) -> None:
    """After a grant of `key`: add it to `blocked` if that grant spent its limits."""
    if key_blocked_until(config, key, now) is not None:
        blocked.add(key)


def blocked_until(config: QueueConfig, key: str, now: int) -> int | None:
    """`policy.keyed_block`: when a queue-wide throttle or the key's own limits let it through."""
    return throttle_blocks_all(config, now) or key_blocked_until(config, key, now)


def take(config: QueueConfig, key: str, now: int) -> None:
    """Count a grant of `key` in its window and its throttle bucket."""
    if config.key_rate_limit is not None:
        AdmissionKeyMark.objects.create(queue=config.name, kind=GRANT, fairness_key=key, at_ms=now)
    if config.throttle is not None:
        _advance(config, GRANT, bucket(config.throttle, key), now)


def _advance(config: QueueConfig, kind: str, name: str, now: int) -> None:
    assert config.throttle is not None
    tat = gcra_take(config.throttle, _tat(config, kind, name), now)
    AdmissionKeyTat.objects.update_or_create(queue=config.name, kind=kind, bucket=name, defaults={"tat": tat})


def start_wait(config: QueueConfig, key: str, now: int) -> int:
    """`keyed.start_wait`: the latest reopening instant of the key's
    start window and throttle bucket (epoch ms), or 0 when both have room (pruning first)."""
    prune(config, now)
    start_rate = key_start_window(config)
    latest = 0
    if start_rate is not None:
        latest = keyed.key_window_retry_at(start_rate, _marks(config, START, key), now) or 0
    throttle = config.throttle
    if throttle is not None:
        latest = max(latest, gcra_retry_at(throttle, _tat(config, START, bucket(throttle, key)), now) or 0)
    return latest


def count_start(config: QueueConfig, key: str, now: int) -> None:
    """Count a step start of `key` (every limit agreed)."""
    if key_start_window(config) is not None:
        AdmissionKeyMark.objects.create(queue=config.name, kind=START, fairness_key=key, at_ms=now)
    if config.throttle is not None:
        _advance(config, START, bucket(config.throttle, key), now)


def usage(config: QueueConfig, now: int, limit: int) -> list[tuple[str, int]] | None:
    """The busiest keys of the per-key window: (key, starts in its window), most first."""
    rate = key_start_window(config)
    if rate is None:
        return None
    rows = (
        AdmissionKeyMark.objects.filter(queue=config.name, kind=START, at_ms__gte=key_window_start(rate, now))
        .values("fairness_key")
        .annotate(n=Count("id"))
        .order_by("-n", "fairness_key")[:limit]
    )
    return [(row["fairness_key"], row["n"]) for row in rows]


def throttle_usage(config: QueueConfig, now: int, limit: int) -> list[tuple[str, float]] | None:
    """The throttle's start-side buckets furthest ahead of `now` (the `(queue, kind, tat)` index)."""
    if config.throttle is None:
        return None
    rows = AdmissionKeyTat.objects.filter(queue=config.name, kind=START, tat__gt=now).order_by("-tat", "bucket")
    return [(name, tat - now) for name, tat in rows.values_list("bucket", "tat")[:limit]]


def rows(queue: str) -> int:
    """Per-key rows held for `queue` (the idle-key bench counts them)."""
    return AdmissionKeyMark.objects.filter(queue=queue).count() + AdmissionKeyTat.objects.filter(queue=queue).count()
