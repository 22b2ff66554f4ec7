"""History for the dashboard's charts: the poller writes one `QueueSample` per queue (and one
`WorkerSample` per live worker) every `POLLER["SAMPLE_INTERVAL_S"]`, and prunes samples older
than `POLLER["SAMPLE_RETENTION_S"]`.

Gauges (waiting, in flight) come from the admission backend, the one place that knows them
under every backend; counts of what happened in the interval (admissions, completions,
failures for good) from the step checkpoints' timestamps, and failed attempts (each failure,
retried or not) from the attempt history (`StepAttempt`), since a checkpoint keeps only its
latest attempt and a failure that was retried would otherwise never show. Sample times are aligned to the interval, so
the counts cover `(at - interval, at]` exactly and two pollers write the same rows (the second
copy is dropped by the unique constraint) instead of double counting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count, Min

from durable_flow.models import QueueSample, StepCheckpoint, StepStatus, WorkerSample, dead_worker_cutoff
from durable_flow.store import sampling as sampling_store


def aligned(now: datetime, interval_s: float) -> datetime:
    """The latest interval boundary at or before `now` (boundaries are multiples of the
    interval since the epoch, so every process agrees on them)."""
    seconds = now.timestamp()
    return datetime.fromtimestamp(seconds - seconds % interval_s, tz=UTC)


#: Parked calls a queue's count reads at most: past it, the count says "at least this many"
#: (`Parked.capped`), so a line of 100,000 calls costs a page, a live tick or a sample what a
#: line of 10,000 does. The `db` backend's line is counted up to the same cap; `redis` and
#: `local` report their whole line (their count reads none of it).
PARKED_COUNT_CAP = 10_000


@dataclass(frozen=True, slots=True)
class Parked:
    """A queue's parked calls: how many (`capped`: the count stopped at its cap, there may be
    more) and when the oldest asked (None when none waits)."""

    n: int
    oldest: datetime | None
    capped: bool = False


NOT_PARKED = Parked(0, None)


def parked_calls(queues: Iterable[str], cap: int | None = PARKED_COUNT_CAP) -> dict[str, Parked]:
    """Per queue of `queues` with parked calls: the step calls parked waiting for admission,
    counted up to `cap` (None: all), and when the oldest asked. Both read the queue's line
    (`df_checkpoint_queue_line`, in arrival order) index-only: the oldest is its first entry,
    and the count stops at the cap."""
    found = {}
    for queue in queues:
        line = StepCheckpoint.objects.filter(queue=queue, status=StepStatus.WAITING).order_by("created_at")
        entries = line.values("created_at")  # a column of the index: only the index is read
        read = (entries[:cap] if cap else entries).aggregate(n=Count("*"), oldest=Min("created_at"))
        if read["n"]:
            found[queue] = Parked(read["n"], read["oldest"], capped=cap is not None and read["n"] >= cap)
    return found


def waiting_now(admission: Any, queue: str, parked: int) -> int:
    """Calls waiting on `queue`: the backend's line, or the parked checkpoints when more (a parked
    call the backend lost, e.g. with a crashed process, waits until the poller re-offers it)."""
    waiting = admission.waiting(queue, limit=PARKED_COUNT_CAP)
    return parked if waiting is None else max(waiting, parked)


def take_samples(engine: Any, now: datetime | None = None) -> datetime:
    """Write the samples of the interval that ended last; return its end (`at`). The database's
    figures come in one statement for every queue and the samples go in one more (two on
    SQLite), so a pass costs the same few round trips whatever the number of queues."""
    settings = engine.settings
    interval = settings.sample_interval_s
    at = aligned(now or engine.now(), interval)
    figures = sampling_store.queue_figures(at - timedelta(seconds=interval), at, PARKED_COUNT_CAP)
    admission = engine.admission
    rows = []
    for name in [*sorted(figures.parked), ""]:
        numbers = figures.counts.get(name, {})
        if name:
            waiting = waiting_now(admission, name, figures.parked[name])
            in_flight = admission.in_flight(name)
        else:
            waiting, in_flight = 0, figures.ungated_in_flight
        rows.append(
            (
                name,
                max(0, waiting or 0),
                max(0, in_flight or 0),
                numbers.get("admissions", 0),
                numbers.get("completions", 0),
                numbers.get("failures", 0),
                numbers.get("failed_attempts", 0),
            )
        )
    sampling_store.write_samples(at, interval, rows, dead_worker_cutoff(settings.heartbeat_ttl_s, now))
    return at


def prune_samples(retention_s: float, now: datetime) -> int:
    """Delete samples older than the retention; return how many rows went."""
    cutoff = now - timedelta(seconds=retention_s)
    queues, _ = QueueSample.objects.filter(at__lt=cutoff).delete()
    workers, _ = WorkerSample.objects.filter(at__lt=cutoff).delete()
    return queues + workers


class Sampler:
    """Decides when the poller samples: once per aligned interval, and prunes along the way."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._last: datetime | None = None

    def maybe_sample(self) -> bool:
        """Sample if a new interval boundary has passed since the last sample; True if it did."""
        settings = self.engine.settings
        now = self.engine.now()
        boundary = aligned(now, settings.sample_interval_s)
        if self._last is not None and boundary <= self._last:
            return False
        self._last = take_samples(self.engine, now)
        prune_samples(settings.sample_retention_s, now)
        return True
