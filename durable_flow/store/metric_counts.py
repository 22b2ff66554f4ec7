"""The Prometheus counters and histograms, counted at the event and kept in the database.

A scrape of any web process must show what every worker did, so counts cannot live in process
memory only; and the hot path (a step's result, a turn) must not pay a statement per count, nor
have every worker thread update one shared row. So:

- At the event, `count()` and `observe()` add to this process's in-memory buffer, once the
  current transaction commits (`transaction.on_commit`: a turn that rolls back counts nothing).
  No statement.
- `flush()` writes the buffer in one batched upsert into `MetricCount` rows keyed
  (process, sample, labels): each process adds to its own rows only, so processes never contend
  on a row. A worker flushes on its heartbeat and at a graceful stop, the poller on its
  maintenance pass and at stop, a web process at the end of each request that counted something
  and before a scrape reads the rows.
- A crash loses what the process counted since its last flush: at most one heartbeat interval's
  worth on a worker (an undercount, never a double count). A flush that fails (the database is
  down) keeps its counts in the buffer for the next one.
- A histogram observation adds 1 to the one bucket it falls in (bucket rows are per bucket, not
  cumulative: one row per observation instead of one per bound), to `_count`, and the value to
  `_sum`; the reader cumulates.
- `retire()` folds the rows of processes silent for `RETIRE_AFTER` into one `process="retired"`
  row per series, in one transaction, so the table does not grow with every restart of a
  process named by its pid and the totals stay monotonic.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from functools import cache, partial

from django.db import connection, transaction
from django.utils import timezone

from durable_flow.models import MetricCount
from durable_flow.store.statements import prepared

logger = logging.getLogger(__name__)

#: The process row that holds the counts of processes long gone.
RETIRED = "retired"
#: A process whose rows were not flushed for this long is folded into `RETIRED`.
RETIRE_AFTER = timedelta(hours=6)
#: Rows per upsert statement (5 parameters each, under SQLite's variable limit).
FLUSH_CHUNK = 150

Labels = tuple[tuple[str, str], ...]

# -- the series -------------------------------------------------------------------------------
# Counters: the sample name (with `_total`) and the labels each is counted by.
RUNS_FINISHED = "durable_flow_runs_finished_total"  # workflow, status
STEP_ATTEMPTS = "durable_flow_step_attempts_total"  # step, outcome
STEP_RETRIES = "durable_flow_step_retries_total"  # step
STARTS_REFUSED = "durable_flow_starts_refused_total"  # workflow
START_TIMEOUTS = "durable_flow_start_timeouts_total"  # queue, outcome
EVENTS_RECEIVED = "durable_flow_events_received_total"  # event
EVENT_STARTS = "durable_flow_event_starts_total"  # workflow, action
SCHEDULE_TICKS = "durable_flow_schedule_ticks_total"  # workflow, outcome

#: Histograms: name → bucket upper bounds (seconds). Waits under flow control run from
#: milliseconds to the length of a rate window, hence bounds well past 15 s.
WAIT_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 30, 60, 300, 900, 3600)
DURATION_BOUNDS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 30, 60, 300, 900)
ADMISSION_WAIT = "durable_flow_admission_wait_seconds"  # queue
SCHEDULE_TO_START = "durable_flow_schedule_to_start_seconds"  # queue
STEP_DURATION = "durable_flow_step_duration_seconds"  # step, outcome
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    ADMISSION_WAIT: WAIT_BOUNDS,
    SCHEDULE_TO_START: WAIT_BOUNDS,
    STEP_DURATION: DURATION_BOUNDS,
}


def bound_label(bound: float) -> str:
    """A bucket's `le` as Prometheus writes it: `0.5`, `1.0`, `+Inf`."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


# -- this process -----------------------------------------------------------------------------
_lock = threading.Lock()
_pending: defaultdict[tuple[str, Labels], float] = defaultdict(float)
_identity: str | None = None


def set_process(identity: str | None) -> None:
    """Name this process's rows (a worker's stable id); None: `host:pid`, read at each flush, so
    a forked child does not write under its parent's name."""
    global _identity
    _identity = identity


def process() -> str:
    return _identity or f"{socket.gethostname()}:{os.getpid()}"


def _labels(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted((name, str(value)) for name, value in labels.items()))


def _add(items: Iterable[tuple[str, Labels, float]]) -> None:
    with _lock:
        for metric, labels, amount in items:
            _pending[(metric, labels)] += amount


def count(metric: str, labels: Mapping[str, str], amount: float = 1) -> None:
    """Add `amount` to the counter `metric` (a `_total` name) once the current transaction
    commits (at once outside one). No statement: `flush()` writes it."""
    transaction.on_commit(partial(_add, [(metric, _labels(labels), amount)]), robust=True)


def observe(histogram: str, labels: Mapping[str, str], seconds: float) -> None:
    """Record one observation of `histogram` (one of `HISTOGRAMS`) once the transaction commits."""
    seconds = max(0.0, seconds)
    bounds = HISTOGRAMS[histogram]
    index = bisect_left(bounds, seconds)
    le = bound_label(bounds[index]) if index < len(bounds) else "+Inf"
    series = _labels(labels)
    items = [
        (f"{histogram}_bucket", _labels({**labels, "le": le}), 1.0),
        (f"{histogram}_count", series, 1.0),
        (f"{histogram}_sum", series, seconds),
    ]
    transaction.on_commit(partial(_add, items), robust=True)


def observe_span(histogram: str, labels: Mapping[str, str], begin: datetime | None, end: datetime | None) -> None:
    """`observe` the seconds from `begin` to `end`, when both are known."""
    if begin is not None and end is not None:
        observe(histogram, labels, (end - begin).total_seconds())


def pending() -> dict[tuple[str, Labels], float]:
    """What this process counted and has not written yet."""
    with _lock:
        return dict(_pending)


def discard() -> None:
    """Forget what is pending (a test starting on a fresh database)."""
    with _lock:
        _pending.clear()


def flush() -> int:
    """Write what this process counted since its last flush: one upsert per `FLUSH_CHUNK`
    series, adding to this process's rows. Returns the series written. If the write fails the
    counts go back to the buffer (the next flush retries them) and the error is raised."""
    with _lock:
        batch = dict(_pending)
        _pending.clear()
    if not batch:
        return 0
    try:
        _upsert(process(), sorted(batch.items()), timezone.now())
    except BaseException:
        _add((metric, labels, amount) for (metric, labels), amount in batch.items())
        raise
    return len(batch)


def flush_quietly(**_: object) -> None:
    """`flush()`, logging instead of raising (a request's end, a stop): the counts stay pending."""
    if not _pending:
        return
    try:
        flush()
    except Exception:
        logger.warning("could not write this process's metric counts; kept for the next flush", exc_info=True)


@cache
def _upsert_sql(vendor: str, rows: int) -> str:
    q = connection.ops.quote_name
    table = q(MetricCount._meta.db_table)
    values = ", ".join(["(%s, %s, %s, %s, %s)"] * rows)
    return (
        f"INSERT INTO {table} ({q('process')}, {q('metric')}, {q('labels')}, {q('value')}, {q('updated_at')}) "
        f"VALUES {values} ON CONFLICT ({q('process')}, {q('metric')}, {q('labels')}) DO UPDATE SET "
        f"{q('value')} = {table}.{q('value')} + EXCLUDED.{q('value')}, {q('updated_at')} = EXCLUDED.{q('updated_at')}"
    )


def _upsert(owner: str, rows: list[tuple[tuple[str, Labels], float]], now: datetime) -> None:
    stamp = prepared(MetricCount, "updated_at", now)
    with transaction.atomic(), connection.cursor() as cursor:
        for start in range(0, len(rows), FLUSH_CHUNK):
            chunk = rows[start : start + FLUSH_CHUNK]
            params: list[object] = []
            for (metric, labels), amount in chunk:
                params.extend((owner, metric, json.dumps(labels, separators=(",", ":")), amount, stamp))
            cursor.execute(_upsert_sql(connection.vendor, len(chunk)), params)


# -- reading ----------------------------------------------------------------------------------
def totals() -> dict[str, dict[Labels, float]]:
    """Every series' total over every process: `{sample name: {labels: value}}`."""
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    with connection.cursor() as cursor:
        q = connection.ops.quote_name
        cursor.execute(
            f"SELECT {q('metric')}, {q('labels')}, SUM({q('value')}) FROM {q(MetricCount._meta.db_table)} "
            f"GROUP BY {q('metric')}, {q('labels')}"
        )
        for metric, labels, value in cursor.fetchall():
            out[metric][tuple(tuple(pair) for pair in json.loads(labels))] = float(value)
    return dict(out)


# -- housekeeping ------------------------------------------------------------------------------
def retire(now: datetime | None = None, after: timedelta = RETIRE_AFTER) -> int:
    """Fold the rows not flushed for `after` into their series' `retired` row, in one
    transaction (the rows locked first, so a late flush of one waits and then writes a new
    row): the sums are unchanged, the table loses a dead process's rows. Returns rows folded."""
    cutoff = (now or timezone.now()) - after
    with transaction.atomic():
        stale = MetricCount.objects.select_for_update().filter(updated_at__lt=cutoff).exclude(process=RETIRED)
        rows = list(stale.values_list("pk", "metric", "labels", "value"))
        if not rows:
            return 0
        sums: defaultdict[tuple[str, str], float] = defaultdict(float)
        for _, metric, labels, value in rows:
            sums[(metric, labels)] += value
        folded = [((metric, _decoded(labels)), value) for (metric, labels), value in sorted(sums.items())]
        _upsert(RETIRED, folded, now or timezone.now())
        # The same rows: locked since they were read (on SQLite, the whole database is).
        MetricCount.objects.filter(updated_at__lt=cutoff).exclude(process=RETIRED).delete()
    return len(rows)


def _decoded(labels: str) -> Labels:
    return tuple((str(name), str(value)) for name, value in json.loads(labels))
