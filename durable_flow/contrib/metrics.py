"""Prometheus metrics for the whole fleet, served by any web process.

Counters and histograms are counted at the event, by whichever process saw it (a worker that
recorded a step's result, the web process that refused a start), and kept in the database
(`durable_flow.store.metric_counts`: one row per process and series, written in batches, summed
at the scrape). Gauges (runs by status, queue depths and limits, the transport's backlog,
workers, schedules) are read from the database and the admission backend at scrape time. So one scrape of
any web process gives the fleet's figures, however many worker processes run.

Mount it with `path("metrics/", durable_flow.contrib.metrics.metrics_view)`. A staff session or
`Authorization: Bearer <DURABLE_FLOW["METRICS"]["TOKEN"]>` may read it; anyone else gets 401
(anonymous) or 403 (logged in, not staff). A scraper asking for OpenMetrics
(`Accept: application/openmetrics-text`) gets it; any other gets the Prometheus text format.
"""

from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from durable_flow.config.settings import get_settings
from durable_flow.observe import metrics, queues, runs, schedules, start_control

WORKER_HORIZON = timedelta(hours=1)
"""A crashed worker reads `worker_up 0` this long after its last heartbeat, then drops out; a
gracefully stopped one drops out at once."""

#: The counters `store.metric_counts` keeps: name (without `_total`), help, labels.
COUNTERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("durable_flow_runs_finished", "Runs that finished, by workflow and final status.", ("workflow", "status")),
    (
        "durable_flow_step_attempts",
        "Step attempts that ended, by step and outcome (completed, failed, cancelled).",
        ("step", "outcome"),
    ),
    ("durable_flow_step_retries", "Failed step attempts followed by another attempt (a retry).", ("step",)),
    ("durable_flow_starts_refused", "Starts a quota refused, by workflow.", ("workflow",)),
    (
        "durable_flow_start_timeouts",
        "Step calls that gave up waiting for admission (their start timeout), by queue and outcome (failed, skipped).",
        ("queue", "outcome"),
    ),
    ("durable_flow_events_received", "Events recorded (a repeated id counts once), by name.", ("event",)),
    (
        "durable_flow_event_starts",
        "Runs events started, by workflow and what the start came to (started, gated, refused, invalid).",
        ("workflow", "action"),
    ),
    ("durable_flow_runs_purged", "Finished runs retention deleted, by workflow.", ("workflow",)),
    (
        "durable_flow_rows_purged",
        "Rows retention deleted, by table (runs, checkpoints, attempts, signals, tasks, event_deliveries, events).",
        ("table",),
    ),
    (
        "durable_flow_schedule_ticks",
        "Schedule ticks by workflow and outcome: started, gated (debounce or singleton), refused (the start "
        "quota), invalid, or skipped (a missed tick the catch-up policy dropped).",
        ("workflow", "outcome"),
    ),
)
#: The histograms `store.metric_counts` keeps: name, help, labels.
HISTOGRAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "durable_flow_admission_wait_seconds",
        "A step attempt's wait from asking to its admission through a named queue (a retry: from its backoff's end).",
        ("queue",),
    ),
    (
        "durable_flow_schedule_to_start_seconds",
        "A step attempt's wait from its dispatch to a worker starting it.",
        ("queue",),
    ),
    ("durable_flow_step_duration_seconds", "A step attempt's run time, from its call to its return.", ("step",)),
)


class DurableFlowCollector(Collector):
    """Reads the counters, runs, queues, backlog and heartbeats on every `collect()`."""

    def __init__(self, now: Any = timezone.now) -> None:
        self._now = now

    def collect(self) -> Iterator[Metric]:
        now = self._now()
        counted = metrics.counted()
        yield from self._counters(counted)
        yield from self._histograms(counted)
        yield self._runs()
        yield from self._queues()
        yield self._admissions()
        yield self._start_outcomes()
        yield self._backlog()
        yield from self._workers(now)
        yield from self._schedules(now)

    @staticmethod
    def _counters(counted: dict[str, dict[metrics.Labels, float]]) -> Iterator[Metric]:
        for name, documentation, labels in COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=list(labels))
            for series, value in sorted(counted.get(f"{name}_total", {}).items()):
                family.add_metric(_values(series, labels), value)
            yield family

    @staticmethod
    def _histograms(counted: dict[str, dict[metrics.Labels, float]]) -> Iterator[Metric]:
        for name, documentation, labels in HISTOGRAMS:
            family = HistogramMetricFamily(name, documentation, labels=list(labels))
            bounds = [*map(metrics.bound_label, metrics.HISTOGRAMS[name]), "+Inf"]
            per_bucket: dict[metrics.Labels, dict[str, float]] = defaultdict(dict)
            for series, value in counted.get(f"{name}_bucket", {}).items():
                own = tuple(pair for pair in series if pair[0] != "le")
                per_bucket[own][dict(series)["le"]] = value
            sums = counted.get(f"{name}_sum", {})
            for series, count in sorted(counted.get(f"{name}_count", {}).items()):
                running, buckets = 0.0, []
                for bound in bounds:
                    running += per_bucket[series].get(bound, 0.0)
                    buckets.append((bound, running))
                buckets[-1] = ("+Inf", count)  # every observation: the count, whatever the bounds were
                family.add_metric(_values(series, labels), buckets, sums.get(series, 0.0))
            yield family

    @staticmethod
    def _runs() -> Metric:
        family = GaugeMetricFamily(
            "durable_flow_runs", "Workflow runs by workflow and status, now.", labels=["workflow", "status"]
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
        concurrency = GaugeMetricFamily(
            "durable_flow_queue_concurrency_limit_slots", "A queue's concurrency cap, in slots.", labels=["queue"]
        )
        rate = GaugeMetricFamily(
            "durable_flow_queue_rate_limit_admissions",
            "A queue's rate limit: admissions allowed per rate period.",
            labels=["queue"],
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
                concurrency.add_metric([name], queue["concurrency"])
            if queue["rate_limit"]:
                rate.add_metric([name], queue["rate_limit"]["limit"])
                period.add_metric([name], queue["rate_limit"]["period_ms"] / 1000)
        yield from (waiting, in_flight, concurrency, rate, period)

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
    def _backlog() -> Metric:
        family = GaugeMetricFamily(
            "durable_flow_tasks_unclaimed",
            "Tasks (turns and steps) sent to the transport that no worker has claimed yet.",
            labels=["transport"],
        )
        transport, count = metrics.backlog()
        if count is not None:
            family.add_metric([transport], count)
        return family

    @staticmethod
    def _workers(now: datetime) -> Iterator[Metric]:
        slots = GaugeMetricFamily(
            "durable_flow_worker_slots",
            "A live worker's slots: state=busy (executing) or idle.",
            labels=["worker", "state"],
        )
        up = GaugeMetricFamily(
            "durable_flow_worker_up",
            "1 while the worker's heartbeat is fresh; 0 once it is silent (a crash). A worker that "
            "stopped gracefully has no series.",
            labels=["worker"],
        )
        for beat, alive in metrics.reported_workers(now - WORKER_HORIZON, now):
            up.add_metric([beat.worker_id], 1 if alive else 0)
            if alive:
                busy = beat.in_flight
                slots.add_metric([beat.worker_id, "busy"], busy)
                slots.add_metric([beat.worker_id, "idle"], max(0, beat.live_limit - busy))
        yield from (slots, up)

    @staticmethod
    def _schedules(now: datetime) -> Iterator[Metric]:
        """Each stored schedule: paused or not, and (while a poller should start it) the seconds
        to its next tick and how long that tick is overdue: a lag that grows means no poller
        runs, the alert to set."""
        paused = GaugeMetricFamily(
            "durable_flow_schedule_paused", "1 while a schedule is paused, else 0.", labels=["workflow"]
        )
        until = GaugeMetricFamily(
            "durable_flow_schedule_next_tick_seconds",
            "Seconds until a schedule's next tick (negative once it is due and not started yet); "
            "no series while paused or no longer declared.",
            labels=["workflow"],
        )
        lag = GaugeMetricFamily(
            "durable_flow_schedule_lag_seconds",
            "How long a schedule's next tick is overdue (0 until it is due): it grows while no poller runs. "
            "No series while paused or no longer declared.",
            labels=["workflow"],
        )
        for view in schedules.schedules():
            paused.add_metric([view.workflow], 1 if view.paused else 0)
            overdue = view.lag_s(now)
            if overdue is not None:
                until.add_metric([view.workflow], (view.next_tick_at - now).total_seconds())
                lag.add_metric([view.workflow], overdue)
        yield from (paused, until, lag)


def _values(series: metrics.Labels, names: tuple[str, ...]) -> list[str]:
    """A stored series' label values in the family's order ("" for one it lacks)."""
    given = dict(series)
    return [given.get(name, "") for name in names]


def render_metrics(accept: str = "") -> tuple[bytes, str]:
    """One scrape, in the format `accept` (an HTTP Accept header) asks for: OpenMetrics when it
    names `application/openmetrics-text`, else the Prometheus text format. Returns the body and
    its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DurableFlowCollector())
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def flush_after_request(**_: object) -> None:
    """`request_finished` receiver: a web process writes what its requests counted (a start a
    quota refused, a run cancelled, runs an in-process transport ran) at each request's end."""
    metrics.flush_own()


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
    body, content_type = render_metrics(request.headers.get("Accept", ""))
    return HttpResponse(body, content_type=content_type)
