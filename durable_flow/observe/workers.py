"""Workers as the dashboard, the admin, the metrics and the health checks read them, from their
heartbeats (`WorkerHeartbeat`): alive by the one rule of `store.queries.live_workers`, with the
`HEARTBEAT["TTL_S"]` of the settings."""

from __future__ import annotations

import socket
from datetime import datetime
from typing import Any

from django.utils import timezone

from durable_flow.config.settings import get_settings
from durable_flow.models import WorkerHeartbeat, dead_worker_cutoff
from durable_flow.store import queries

#: Worker cards the dashboard shows at most (the latest heard from).
MAX_CARDS = 50
#: Steps listed on a card at most.
MAX_RUNNING = 20


def _cutoff(now: datetime | None = None) -> datetime:
    return dead_worker_cutoff(get_settings().heartbeat_ttl_s, now or timezone.now())


def is_alive(beat: WorkerHeartbeat, now: datetime | None = None) -> bool:
    """Whether the worker of a heartbeat already read is alive now."""
    return queries.is_alive(beat, _cutoff(now))


def heartbeats_since(since: datetime, now: datetime | None = None) -> list[tuple[WorkerHeartbeat, bool]]:
    """Every worker, alive or dead, heard from since `since` (older records are no longer
    shown), with whether it is alive."""
    cutoff = _cutoff(now)
    return [(beat, queries.is_alive(beat, cutoff)) for beat in WorkerHeartbeat.objects.filter(last_seen__gte=since)]


def live_workers_on(host: str | None = None) -> list[str]:
    """The ids of the workers on `host` (default: this one) whose heartbeat is live."""
    workers = queries.live_workers(_cutoff()).filter(host=host or socket.gethostname())
    return list(workers.values_list("worker_id", flat=True))


def worker_cards(now: datetime | None = None) -> list[dict[str, Any]]:
    """One card per worker heartbeat in a stable order: live ones first, each group by start
    time, so cards keep their places from one heartbeat to the next."""
    now = now or timezone.now()
    cutoff = _cutoff(now)
    cards = []
    for beat in WorkerHeartbeat.objects.order_by("-last_seen")[:MAX_CARDS]:
        alive = queries.is_alive(beat, cutoff)
        cards.append(
            {
                "worker_id": beat.worker_id,
                "host": beat.host,
                "pid": beat.pid,
                "alive": alive,
                "state": "alive" if alive else ("stopped" if beat.stopped_at else "dead"),
                "crashed": not alive and beat.stopped_at is None,
                "transport": beat.transport,
                "mode": beat.mode,
                "live_limit": beat.live_limit,
                "in_flight": beat.in_flight,
                "rss_mb": round(beat.rss_bytes / 1_048_576, 1),
                "cpu_percent": beat.cpu_percent,
                "throughput": beat.throughput,
                "p95_ms": round(beat.p95_ms, 1) if beat.p95_ms is not None else None,
                "tasks_done": beat.tasks_done,
                "running": [_running_step(item) for item in beat.running[:MAX_RUNNING]],
                "last_adjustment": beat.last_adjustment_reason,
                "last_seen": beat.last_seen.isoformat(),
                "silent_s": round((now - beat.last_seen).total_seconds(), 1),
                "started_at": beat.started_at.isoformat(),
            }
        )
    cards.sort(key=lambda c: (not c["alive"], c["started_at"], c["worker_id"]))
    return cards


def _running_step(item: str) -> dict[str, str]:
    """`run_id/key/attempt` → its parts."""
    run_id, key, attempt = queries.parse_running(item)
    return {"run_id": run_id, "key": key, "attempt": attempt}
