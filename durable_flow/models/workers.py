"""Worker heartbeats: each worker's live numbers, and when a heartbeat means a dead worker."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import models
from django.utils import timezone

from durable_flow.config.limits import (
    ADJUSTMENT_REASON_LENGTH,
)


class WorkerHeartbeat(models.Model):
    """A worker process's last report: its live concurrency and health, for the dashboard."""

    worker_id = models.CharField(primary_key=True, max_length=200)
    host = models.CharField(max_length=200)
    pid = models.IntegerField()
    transport = models.CharField(max_length=20)
    queues = models.JSONField(default=list)
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField(db_index=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    mode = models.CharField(max_length=10, default="fixed")
    live_limit = models.PositiveIntegerField(default=1)
    in_flight = models.PositiveIntegerField(default=0)
    rss_bytes = models.BigIntegerField(default=0)
    cpu_percent = models.FloatField(default=0.0)
    throughput = models.FloatField(default=0.0, help_text="Tasks finished per second over the last tick.")
    p95_ms = models.FloatField(null=True, blank=True)
    tasks_done = models.BigIntegerField(default=0)
    running = models.JSONField(default=list, blank=True, help_text="Step attempts executing: run_id/key/attempt.")
    last_adjustment_at = models.DateTimeField(null=True, blank=True)
    last_adjustment_reason = models.CharField(max_length=ADJUSTMENT_REASON_LENGTH, blank=True, default="")

    class Meta:
        ordering = ["-last_seen"]

    def __str__(self) -> str:
        return self.worker_id


def dead_worker_cutoff(ttl_s: float, now: datetime | None = None) -> datetime:
    """Heartbeats older than this belong to dead workers."""
    return (now or timezone.now()) - timedelta(seconds=ttl_s)
