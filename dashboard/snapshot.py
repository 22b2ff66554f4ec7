"""What the dashboard shows: runs and workers from the database, queue numbers from the
admission backend (the one place that knows them under every backend)."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from durable_flow import queries, quotas
from durable_flow.conf import get_settings
from durable_flow.engine import get_engine
from durable_flow.models import FlowQueue, WorkerHeartbeat
from durable_flow.worker.heartbeat import dead_worker_cutoff


def queue_rows() -> list[dict[str, Any]]:
    """One row per registered queue: waiting, in flight vs cap, window use vs limit.

    The numbers come from the admission backend (`in_flight`, `waiting`, `window_usage`), which
    holds them under every backend (`local`, `db`, `redis`); the checkpoints only give the age of
    the oldest waiting call.
    """
    now = timezone.now()
    admission = get_engine().admission
    oldest = queries.oldest_waiting_by_queue()
    rows = []
    for queue in FlowQueue.objects.all():
        config = queue.config
        first = oldest.get(queue.name)
        in_flight = admission.in_flight(queue.name)
        rows.append(
            {
                "name": queue.name,
                "waiting": admission.waiting(queue.name),
                "in_flight": in_flight,
                "slots": in_flight,
                "concurrency": config.get("concurrency"),
                "rate_limit": config.get("rate_limit") or None,
                "window_used": admission.window_usage(queue.name),
                "oldest_wait_s": round((now - first).total_seconds(), 1) if first else None,
            }
        )
    return rows


def worker_cards() -> list[dict[str, Any]]:
    """One card per worker heartbeat, newest first, with alive/dead."""
    cutoff = dead_worker_cutoff(get_settings().heartbeat_ttl_s)
    cards = []
    for beat in WorkerHeartbeat.objects.all()[:50]:
        cards.append(
            {
                "worker_id": beat.worker_id,
                "host": beat.host,
                "pid": beat.pid,
                "alive": queries.is_alive(beat, cutoff),
                "transport": beat.transport,
                "mode": beat.mode,
                "live_limit": beat.live_limit,
                "in_flight": beat.in_flight,
                "rss_mb": round(beat.rss_bytes / 1_048_576, 1),
                "cpu_percent": beat.cpu_percent,
                "throughput": beat.throughput,
                "p95_ms": round(beat.p95_ms, 1) if beat.p95_ms is not None else None,
                "tasks_done": beat.tasks_done,
                "last_adjustment": beat.last_adjustment_reason,
                "last_seen": beat.last_seen.isoformat(),
            }
        )
    return cards


def snapshot() -> dict[str, Any]:
    return {
        "queues": queue_rows(),
        "workers": worker_cards(),
        "runs": queries.run_counts(),
        "quotas": quotas.usage(),
        "at": timezone.now().isoformat(),
    }
