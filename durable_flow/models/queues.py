"""Queues as every process sees them, their persisted counters, and refused starts."""

from __future__ import annotations

from django.db import models

from durable_flow.config.limits import QUEUE_NAME_LENGTH, QUOTA_KEY_LENGTH, WORKFLOW_NAME_LENGTH


class FlowQueue(models.Model):
    """A registered flow-control queue, persisted so every process and the admin see it."""

    name = models.CharField(primary_key=True, max_length=QUEUE_NAME_LENGTH)
    config = models.JSONField()
    paused = models.BooleanField(
        default=False, help_text="A paused queue admits nothing; its waiters keep waiting until it is resumed."
    )
    # Counters of the `db` admission backend, advanced under this row's lock.
    next_arrival = models.BigIntegerField(default=0)
    next_serve = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class QueueCounter(models.Model):
    """Monotonic per-queue counters for Prometheus (`durable_flow_admissions_total`), shared by
    every process. Advanced after each admitting transaction commits (`durable_flow.store.counters`),
    in a row of its own, so it never contends with the `db` backend's lock on `FlowQueue`."""

    queue = models.CharField(primary_key=True, max_length=100)
    admissions = models.BigIntegerField(default=0, help_text="Step attempts admitted through the queue, ever.")
    parked = models.BigIntegerField(default=0, help_text="Step attempts that waited in the queue's line, ever.")

    class Meta:
        ordering = ["queue"]

    def __str__(self) -> str:
        return self.queue


class QuotaRefusal(models.Model):
    """Starts a quota refused, counted per key and minute (for the dashboard and the admin)."""

    key = models.CharField(max_length=200)
    minute = models.DateTimeField()
    refusals = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["key", "minute"], name="df_refusal_key_minute")]
        indexes = [models.Index(fields=["minute"], name="df_refusal_minute")]


class StartRefusal(models.Model):
    """One start a quota refused: which workflow, under which key, when, and the count it was
    refused at (`active` runs of the key against its `limit`). Written once per refusal
    (`durable_flow.store.quotas.record_refusal`); the poller deletes rows older than
    `POLLER["REFUSAL_RETENTION_S"]`."""

    workflow = models.CharField(max_length=WORKFLOW_NAME_LENGTH)
    key = models.CharField(max_length=QUOTA_KEY_LENGTH)
    at = models.DateTimeField()
    active = models.PositiveIntegerField(help_text="Runs of the key occupying a slot when the start was refused.")
    limit = models.PositiveIntegerField(help_text="The key's limit for that start.")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["at"], name="df_srefusal_at"),
            models.Index(fields=["workflow", "at"], name="df_srefusal_workflow_at"),
            models.Index(fields=["key", "at"], name="df_srefusal_key_at"),
        ]

    def __str__(self) -> str:
        return f"{self.workflow} {self.key} {self.at:%Y-%m-%d %H:%M:%S}"
