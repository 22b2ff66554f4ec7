"""What the dashboard shows, computed from the database (the only source of truth)."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, Min
from django.utils import timezone

from durable_flow.conf import get_settings
from durable_flow.models import (
    AdmissionMark,
    AdmissionSlot,
    FlowQueue,
    RunStatus,
    StepCheckpoint,
    StepStatus,
    WorkerHeartbeat,
    WorkflowRun,
)
from durable_flow.worker.heartbeat import dead_worker_cutoff


def queue_rows() -> list[dict[str, Any]]:
    """One row per registered queue: waiting, in flight vs cap, window use vs limit."""
    now = timezone.now()
    now_ms = int(now.timestamp() * 1000)
    waiting = dict(
        StepCheckpoint.objects.filter(status=StepStatus.WAITING)
        .values_list("queue")
        .annotate(n=Count("id"))
        .values_list("queue", "n")
    )
    oldest = dict(
        StepCheckpoint.objects.filter(status=StepStatus.WAITING)
        .values_list("queue")
        .annotate(first=Min("created_at"))
        .values_list("queue", "first")
    )
    in_flight = dict(
        StepCheckpoint.objects.filter(status=StepStatus.DISPATCHED, holds_slot=True)
        .values_list("queue")
        .annotate(n=Count("id"))
        .values_list("queue", "n")
    )
    rows = []
    for queue in FlowQueue.objects.all():
        config = queue.config
        rate = config.get("rate_limit") or None
        window_used = None
        if rate:
            window_used = AdmissionMark.objects.filter(queue=queue.name, at_ms__gt=now_ms - rate["period_ms"]).count()
        first = oldest.get(queue.name)
        rows.append(
            {
                "name": queue.name,
                "waiting": waiting.get(queue.name, 0),
                "in_flight": in_flight.get(queue.name, 0),
                "slots": AdmissionSlot.objects.filter(queue=queue.name).count(),
                "concurrency": config.get("concurrency"),
                "rate_limit": rate,
                "window_used": window_used,
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
                "alive": beat.stopped_at is None and beat.last_seen >= cutoff,
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


def run_counts() -> dict[str, int]:
    counts = dict(WorkflowRun.objects.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    return {status: counts.get(status, 0) for status in RunStatus.values}


def snapshot() -> dict[str, Any]:
    return {"queues": queue_rows(), "workers": worker_cards(), "runs": run_counts(), "at": timezone.now().isoformat()}
