"""History for the dashboard's charts: per-queue and per-worker samples the poller writes."""

from __future__ import annotations

from django.db import models


class QueueSample(models.Model):
    """A queue's numbers over one sampling interval, written by the poller for the dashboard's
    charts: gauges at the interval's end, counts of what happened during it.

    `queue=""` holds the steps that name no queue, so the sum over every row of an interval is
    the whole system. `at` is aligned to `POLLER["SAMPLE_INTERVAL_S"]`, so several pollers write
    one row per queue and interval (the unique constraint drops the others' copies).
    """

    queue = models.CharField(max_length=100, blank=True)
    at = models.DateTimeField(help_text="The end of the interval.")
    interval_s = models.FloatField()
    waiting = models.PositiveIntegerField(default=0, help_text="Calls waiting for admission at `at`.")
    in_flight = models.PositiveIntegerField(default=0, help_text="Slots held (steps executing) at `at`.")
    admissions = models.PositiveIntegerField(default=0, help_text="Steps dispatched through the queue.")
    completions = models.PositiveIntegerField(default=0, help_text="Steps that completed.")
    failures = models.PositiveIntegerField(default=0, help_text="Steps that failed for good.")
    failed_attempts = models.PositiveIntegerField(
        default=0, help_text="Step attempts that failed, retried or not (from the attempt history)."
    )

    class Meta:
        ordering = ["queue", "at"]
        constraints = [models.UniqueConstraint(fields=["queue", "at"], name="df_queue_sample_at")]
        indexes = [models.Index(fields=["at"], name="df_queue_sample_time")]

    def __str__(self) -> str:
        return f"{self.queue or '(no queue)'} @ {self.at:%H:%M:%S}"


class WorkerSample(models.Model):
    """A live worker's heartbeat numbers at one sampling instant, for the workers' sparklines."""

    worker_id = models.CharField(max_length=200)
    at = models.DateTimeField()
    live_limit = models.PositiveIntegerField(default=0)
    in_flight = models.PositiveIntegerField(default=0)
    throughput = models.FloatField(default=0.0)

    class Meta:
        ordering = ["worker_id", "at"]
        constraints = [models.UniqueConstraint(fields=["worker_id", "at"], name="df_worker_sample_at")]
        indexes = [models.Index(fields=["at"], name="df_worker_sample_time")]
