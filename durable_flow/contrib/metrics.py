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
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from durable_flow.config.settings import get_settings
from durable_flow.observe import queues, runs, start_control, steps, workers

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
        yield from self._workers(now)

    @staticmethod
    def _runs() -> Metric:
        family = GaugeMetricFamily(
            "durable_flow_runs", "Workflow runs by workflow and status.", labels=["workflow", "status"]
        )
        for workflow, status, count in runs.counts_by_workflow():
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
        # Slots held across the fleet: under the `local` backend, which counts per process, the
        # checkpoints (the fleet-wide record) answer instead of this web process's figure.
        for queue in queues.gauges():
            name = queue["name"]
            waiting.add_metric([name], queue["waiting"])
            in_flight.add_metric([name], queue["in_flight"])
            if queue["concurrency"]:
                limit.add_metric([name, "concurrency"], queue["concurrency"])
            rate = queue["rate_limit"]
            if rate:
                limit.add_metric([name, "rate"], rate["limit"])
                period.add_metric([name], rate["period_ms"] / 1000)
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
        for queue, by_decision in sorted(queues.admission_counts().items()):
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
        for workflow, outcome, count in start_control.outcome_counts():
            family.add_metric([workflow, outcome], count)
        return family

    @staticmethod
    def _queue_wait(since: datetime) -> Metric:
        return _histogram(
            "durable_flow_queue_wait_seconds",
            "Time from a step call to its (latest) dispatch, for steps dispatched within METRICS.WINDOW_S.",
            "queue",
            steps.queue_waits(since, MAX_SAMPLED_STEPS),
            WAIT_BUCKETS_S,
        )

    @staticmethod
    def _step_duration(since: datetime) -> Metric:
        return _histogram(
            "durable_flow_step_duration_seconds",
            "Time from a step's last dispatch to its result, for steps settled within METRICS.WINDOW_S.",
            "step",
            steps.step_runs(since, MAX_SAMPLED_STEPS),
            DURATION_BUCKETS_S,
        )

    @staticmethod
    def _workers(now: datetime) -> Iterator[Metric]:
        slots = GaugeMetricFamily(
            "durable_flow_worker_slots",
            "A live worker's slots: state=busy (executing) or idle.",
            labels=["worker", "state"],
        )
        up = GaugeMetricFamily(
            "durable_flow_worker_up", "1 while the worker's heartbeat is fresh, else 0.", labels=["worker"]
        )
        for beat, alive in workers.heartbeats_since(now - WORKER_HORIZON, now):
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
    name: str,
    documentation: str,
    label: str,
    rows: Iterable[tuple[str, datetime | None, datetime | None]],
    bounds: Sequence[float],
) -> GaugeHistogramMetricFamily:
    """A gauge histogram of the seconds between each row's two datetimes, per label value."""
    by_label: dict[str, list[float]] = defaultdict(list)
    for value, begin, end in rows:
        seconds = _seconds(begin, end)
        if seconds is not None:
            by_label[value].append(seconds)
    family = GaugeHistogramMetricFamily(name, documentation, labels=[label])
    for value, samples in sorted(by_label.items()):
        buckets, total = bucketize(samples, bounds)
        family.add_metric([value], buckets, total)
    return family
