"""The charts' history, read from the samples the poller writes (`sampling.py`): per queue and
per worker over the last hour, the system's totals, and whether failures are rising.

Every live tick would otherwise re-read an hour of samples; the last read is kept until a
newer sample exists (one cheap `max(id)` query per tick).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Max

from durable_flow.models import QueueSample, WorkerSample
from durable_flow.store.sampling import QUEUE_SAMPLE_COLUMNS

SPAN = timedelta(hours=1)
SPARK_POINTS = 60


@dataclass(frozen=True, slots=True)
class Sample:
    at: datetime
    interval_s: float
    waiting: int
    in_flight: int
    admissions: int
    completions: int
    failures: int
    failed_attempts: int

    def per_min(self, count: int) -> float:
        return round(count * 60 / self.interval_s, 2)


@dataclass(frozen=True)
class History:
    """The last hour of samples, per queue (`""`: steps on no queue), oldest first."""

    queues: dict[str, list[Sample]]
    workers: dict[str, list[tuple[int, int, float]]]

    def totals(self) -> list[Sample]:
        """All queues summed per sample time: the system's throughput, failures and backlog."""
        by_time: dict[datetime, list[Sample]] = defaultdict(list)
        for samples in self.queues.values():
            for sample in samples:
                by_time[sample.at].append(sample)
        return [
            Sample(
                at=at,
                interval_s=group[0].interval_s,
                waiting=sum(s.waiting for s in group),
                in_flight=sum(s.in_flight for s in group),
                admissions=sum(s.admissions for s in group),
                completions=sum(s.completions for s in group),
                failures=sum(s.failures for s in group),
                failed_attempts=sum(s.failed_attempts for s in group),
            )
            for at, group in sorted(by_time.items())
        ]


_lock = threading.Lock()
_cached: tuple[tuple[int | None, int | None, datetime], History] | None = None


def history(now: datetime) -> History:
    """The last hour's samples; re-read only when the poller has written new ones (or a
    minute has passed, so samples leave the window)."""
    global _cached
    marks = (QueueSample.objects.aggregate(m=Max("id"))["m"], WorkerSample.objects.aggregate(m=Max("id"))["m"])
    with _lock:
        if _cached is not None:
            (queue_mark, worker_mark, read_at), value = _cached
            if (queue_mark, worker_mark) == marks and now - read_at < timedelta(minutes=1):
                return value
    since = now - SPAN
    queues: dict[str, list[Sample]] = defaultdict(list)
    for row in QueueSample.objects.filter(at__gt=since).order_by("at").values_list(*QUEUE_SAMPLE_COLUMNS):
        queues[row[0]].append(Sample(*row[1:]))
    workers: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for worker_id, limit, busy, rate in (
        WorkerSample.objects.filter(at__gt=since)
        .order_by("at")
        .values_list("worker_id", "live_limit", "in_flight", "throughput")
    ):
        workers[worker_id].append((limit, busy, rate))
    value = History(queues=dict(queues), workers={w: points[-SPARK_POINTS:] for w, points in workers.items()})
    with _lock:
        _cached = (marks[0], marks[1], now), value
    return value


def failures_rising(totals: list[Sample], now: datetime, window: timedelta = timedelta(minutes=5)) -> int | None:
    """Failures in the last `window` when they are at least 3 and more than in the window
    before it; else None."""
    recent = sum(s.failures for s in totals if s.at > now - window)
    before = sum(s.failures for s in totals if now - 2 * window < s.at <= now - window)
    return recent if recent >= 3 and recent > before else None


def last_poller_sample() -> datetime | None:
    """When a poller last sampled (the end of the interval it wrote): a looping poller writes a
    `queue=""` sample every interval, whatever the queues (the poller's health check)."""
    return QueueSample.objects.filter(queue="").order_by("-at").values_list("at", flat=True).first()
