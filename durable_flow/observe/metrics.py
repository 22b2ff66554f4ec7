"""What the Prometheus endpoint reads beyond the pages' numbers: the counters and histograms every
process counted (`store.metric_counts`, summed over processes), the transport's backlog, and
the workers a scrape reports.

The figures are the fleet's, whoever scrapes: each process writes its counts to the database
(`MetricCount`), and this web process writes its own pending ones before reading.
"""

from __future__ import annotations

import logging
from datetime import datetime

from durable_flow.config.settings import get_settings
from durable_flow.engine import get_engine
from durable_flow.models import WorkerHeartbeat, dead_worker_cutoff
from durable_flow.store import metric_counts, queries
from durable_flow.store.metric_counts import HISTOGRAMS, Labels, bound_label

logger = logging.getLogger("durable_flow.contrib.metrics")

__all__ = ["HISTOGRAMS", "Labels", "backlog", "bound_label", "counted", "flush_own", "reported_workers"]


def flush_own(**_: object) -> None:
    """Write what this process counted and has not written yet (a request's end, a scrape);
    a failure is logged and the counts stay pending."""
    metric_counts.flush_quietly()


def counted() -> dict[str, dict[Labels, float]]:
    """Every counter and histogram sample, summed over every process: `{sample name: {labels:
    value}}` (histogram buckets per bucket, not cumulative). This process's pending counts are
    written first, so what it counted is in."""
    flush_own()
    return metric_counts.totals()


def backlog() -> tuple[str, int | None]:
    """The transport's name and its tasks sent but not claimed by a worker; None where the
    transport has no backlog (in-process) or cannot be read now (its broker is down)."""
    transport = get_engine().transport
    try:
        return transport.name, transport.backlog()
    except Exception:
        logger.warning("backlog() of the %r transport failed", transport.name, exc_info=True)
        return transport.name, None


def reported_workers(since: datetime, now: datetime) -> list[tuple[WorkerHeartbeat, bool]]:
    """The workers a scrape reports, with whether each is alive: every one heard from since
    `since` except those that stopped gracefully (their series end with them; a crashed one is
    reported dead until `since` passes its last beat)."""
    cutoff = dead_worker_cutoff(get_settings().heartbeat_ttl_s, now)
    beats = WorkerHeartbeat.objects.filter(last_seen__gte=since, stopped_at__isnull=True).order_by("worker_id")
    return [(beat, queries.is_alive(beat, cutoff)) for beat in beats]
