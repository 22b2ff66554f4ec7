"""Prometheus metrics, computed at scrape time from the database and the admission backend.

Nothing is counted in process memory: every worker, poller and web process writes its state to
the database (runs, checkpoints, heartbeats) or to the admission backend, so one scrape of any
web process gives the fleet's figures, however many worker processes run (the approach of
django-rq's `contrib/prometheus.py`).

Mount it with `path("metrics/", durable_flow.contrib.metrics.metrics_view)`. A staff session or
`Authorization: Bearer <DURABLE_FLOW["METRICS"]["TOKEN"]>` may read it; anyone else gets 401
(anonymous) or 403 (logged in, not staff).
"""

from __future__ import annotations

import hmac
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import get_engine
from durable_flow.models import FlowQueue, StepCheckpoint, StepKind, StepStatus, dead_worker_cutoff
from durable_flow.store import queries
from durable_flow.store.counters import decisions, start_outcomes

logger = logging.getLogger(__name__)

WAIT_BUCKETS_S: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 15, 30, 60, 300, 900, 3600)
"""Queue waits under flow control run from milliseconds to the length of a rate window, hence
buckets well past 15 s."""
DURATION_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 30, 60, 300, 900)
WORKER_HORIZON = timedelta(hours=1)
"""Heartbeats older than this are no longer reported at all, so dead workers do not pile up."""
MAX_SAMPLED_STEPS = 50_000


def bucketize(values: Iterable[float], bounds: Sequence[float]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative `(le, count)` buckets ending in `+Inf`, and the sum, for a gauge histogram."""
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    for value in values:
        total += value
        for index, bound in enumerate(bounds):
            if value <= bound:
                counts[index] += 1
                break
        else:
            counts[-1] += 1
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        running += count
        buckets.append((bound, running))
    return buckets, total


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (end - start).total_seconds())


def _admission_backend() -> Any:

    return get_engine().admission


class DurableFlowCollector(Collector):
    """Reads runs, queues, checkpoints and heartbeats on every `collect()`."""

    def __init__(self, now: Any = timezone.now) -> None:
        self._now = now

    def collect(self) -> Iterator[Metric]:
        now = self._now()
        settings = get_settings()
        window = timedelta(seconds=settings.metrics_window_s)
        yield self._runs()
        yield from self._queues()
        yield self._admissions()
        yield self._start_outcomes()
        yield self._queue_wait(now - window)
        yield self._step_duration(now - window)
        yield from self._workers(now, settings.heartbeat_ttl_s)

    @staticmethod
    def _runs() -> Metric:
        family = GaugeMetricFamily(
            "durable_flow_runs", "Workflow runs by workflow and status.", labels=["workflow", "status"]
        )
        for workflow, status, count in queries.run_counts_by_workflow():
            family.add_metric([workflow, status], count)
        return family

    @staticmethod
    def _queues() -> Iterator[Metric]:
        waiting = GaugeMetricFamily(
            "durable_flow_queue_waiting", "Step calls parked waiting for admission.", labels=["queue"]
        )
        in_flight = GaugeMetricFamily(
            "durable_flow_queue_in_flight", "Slots held (admitted, result not landed).", labels=["queue"]
        )
        limit = GaugeMetricFamily(
            "durable_flow_queue_limit",
            "A queue's configured limits: kind=concurrency (slots), kind=rate (admissions per rate period).",
            labels=["queue", "kind"],
        )
        period = GaugeMetricFamily(
            "durable_flow_queue_rate_period_seconds", "The period of a queue's rate limit.", labels=["queue"]
        )
        parked = queries.waiting_by_queue()
        holding = queries.slots_held_by_queue()
        backend = _admission_backend()
        # The `local` backend counts per process: this web process's figure says nothing of the
        # workers', so the checkpoints (the fleet-wide truth) answer instead.

        shared = not isinstance(backend, LocalAdmissionBackend) and hasattr(backend, "in_flight")
        for queue in FlowQueue.objects.all():
            config = queue.config or {}
            waiting.add_metric([queue.name], parked.get(queue.name, 0))
            held = holding.get(queue.name, 0)
            if shared:
                try:
                    held = backend.in_flight(queue.name)
                except Exception:  # a scrape must answer: an unreachable backend falls back to the rows
                    logger.warning("metrics: admission backend in_flight(%r) failed", queue.name, exc_info=True)
            in_flight.add_metric([queue.name], held)
            if config.get("concurrency"):
                limit.add_metric([queue.name, "concurrency"], config["concurrency"])
            rate = config.get("rate_limit")
            if rate:
                limit.add_metric([queue.name, "rate"], rate["limit"])
                period.add_metric([queue.name], rate["period_ms"] / 1000)
        yield from (waiting, in_flight, limit, period)

    @staticmethod
    def _admissions() -> Metric:
        """Step attempts per named queue and decision, ever: `admitted` (a direct admission or a
        grant to a waiter) and `parked` (joined the waiting line). The persisted `QueueCounter`
        rows, which every process adds to; 0 for a registered queue that saw nothing yet."""

        family = CounterMetricFamily(
            "durable_flow_admissions",
            "Step attempts through a named queue: decision=admitted (a direct admission or a grant to a "
            "waiter), decision=parked (waited in the queue's line first; such an attempt counts under both).",
            labels=["queue", "decision"],
        )
        counts = {name: {"admitted": 0, "parked": 0} for name in FlowQueue.objects.values_list("name", flat=True)}
        counts.update(decisions())
        for queue, by_decision in sorted(counts.items()):
            for decision in ("admitted", "parked"):
                family.add_metric([queue, decision], by_decision[decision])
        return family

    @staticmethod
    def _start_outcomes() -> Metric:
        """Starts debounce or singleton handled without a new run of their own (`debounced`,
        `skipped`) or by cancelling the key's run (`replaced`): the persisted `StartCounter` rows."""

        family = CounterMetricFamily(
            "durable_flow_start_outcomes",
            "Starts folded into a debounced run, skipped by a singleton, or replacing its run.",
            labels=["workflow", "outcome"],
        )
        for (workflow, outcome), count in sorted(start_outcomes().items()):
            family.add_metric([workflow, outcome], count)
        return family

    @staticmethod
    def _queue_wait(since: datetime) -> Metric:
        rows = StepCheckpoint.objects.filter(kind=StepKind.STEP, dispatched_at__gte=since).values_list(
            "queue", "created_at", "dispatched_at"
        )
        return _histogram(
            "durable_flow_queue_wait_seconds",
            "Time from a step call to its (latest) dispatch, for steps dispatched within METRICS.WINDOW_S.",
            "queue",
            rows,
            WAIT_BUCKETS_S,
        )

    @staticmethod
    def _step_duration(since: datetime) -> Metric:
        rows = StepCheckpoint.objects.filter(
            kind=StepKind.STEP, finished_at__gte=since, status__in=[StepStatus.COMPLETED, StepStatus.FAILED]
        ).values_list("name", "dispatched_at", "finished_at")
        return _histogram(
            "durable_flow_step_duration_seconds",
            "Time from a step's last dispatch to its result, for steps settled within METRICS.WINDOW_S.",
            "step",
            rows,
            DURATION_BUCKETS_S,
        )

    @staticmethod
    def _workers(now: datetime, ttl_s: float) -> Iterator[Metric]:
        slots = GaugeMetricFamily(
            "durable_flow_worker_slots",
            "A live worker's slots: state=busy (executing) or idle.",
            labels=["worker", "state"],
        )
        up = GaugeMetricFamily(
            "durable_flow_worker_up", "1 while the worker's heartbeat is fresh, else 0.", labels=["worker"]
        )
        cutoff = dead_worker_cutoff(ttl_s, now)
        for beat in queries.workers_seen_since(now - WORKER_HORIZON):
            alive = queries.is_alive(beat, cutoff)
            up.add_metric([beat.worker_id], 1 if alive else 0)
            if alive:
                busy = beat.in_flight
                slots.add_metric([beat.worker_id, "busy"], busy)
                slots.add_metric([beat.worker_id, "idle"], max(0, beat.live_limit - busy))
        yield from (slots, up)


def render_metrics() -> bytes:
    """One scrape in Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DurableFlowCollector())
    return generate_latest(registry)


def _bearer_ok(request: HttpRequest, token: str | None) -> bool:
    if not token:
        return False
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The scrape endpoint: staff session or bearer token; 401 anonymous, 403 non-staff."""
    token = get_settings().metrics_token
    user = getattr(request, "user", None)
    if not _bearer_ok(request, token):
        if user is None or not user.is_authenticated:
            response = HttpResponse("authentication required\n", status=401, content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="durable_flow metrics"'
            return response
        if not user.is_staff:
            return HttpResponse("staff only\n", status=403, content_type="text/plain")
    return HttpResponse(render_metrics(), content_type=CONTENT_TYPE_LATEST)


def _histogram(
    name: str, documentation: str, label: str, rows: QuerySet[Any], bounds: Sequence[float]
) -> GaugeHistogramMetricFamily:
    """A gauge histogram of the seconds between each row's two datetimes, per label value
    (at most `MAX_SAMPLED_STEPS` rows are read)."""
    by_label: dict[str, list[float]] = defaultdict(list)
    for value, begin, end in rows.order_by()[:MAX_SAMPLED_STEPS]:
        seconds = _seconds(begin, end)
        if seconds is not None:
            by_label[value].append(seconds)
    family = GaugeHistogramMetricFamily(name, documentation, labels=[label])
    for value, samples in sorted(by_label.items()):
        buckets, total = bucketize(samples, bounds)
        family.add_metric([value], buckets, total)
    return family
