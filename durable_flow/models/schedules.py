"""What a schedule (`durable_flow.definitions.schedules`) persists: where its ticks stand."""

from __future__ import annotations

from django.db import models

from durable_flow.config.limits import RUN_ID_LENGTH, WORKFLOW_NAME_LENGTH


class ScheduleOutcome(models.TextChoices):
    """What the last tick's start came to."""

    STARTED = "started", "started"
    #: Debounce folded it into a pending run, or a singleton found its run in progress.
    GATED = "gated", "gated by debounce or singleton"
    #: The workflow's start quota was full: the tick is not retried.
    REFUSED = "refused", "refused by the start quota"
    #: The start was refused as invalid (its start key, its input): logged, not retried.
    INVALID = "invalid", "invalid start"
    #: Every missed tick was dropped (`catch_up="skip"`).
    SKIPPED = "skipped", "missed ticks skipped"


class Schedule(models.Model):
    """One declared schedule's ticks, shared by every poller. `next_tick_at` is advanced by a
    compare-and-set on its old value in the transaction that starts the tick's runs
    (`durable_flow.store.schedules.claim`), so of several pollers one starts each tick.
    `cron` and `timezone` are those the next tick was computed from: a changed declaration
    computes it again."""

    workflow = models.CharField(primary_key=True, max_length=WORKFLOW_NAME_LENGTH)
    cron = models.CharField(max_length=200)
    timezone = models.CharField(max_length=100)
    next_tick_at = models.DateTimeField(help_text="The next tick a poller will start (UTC).")
    last_tick_at = models.DateTimeField(null=True, blank=True, help_text="The last tick started or dropped.")
    last_run_id = models.CharField(max_length=RUN_ID_LENGTH, blank=True, default="")
    last_outcome = models.CharField(max_length=20, choices=ScheduleOutcome.choices, blank=True, default="")
    last_refused_tick_at = models.DateTimeField(
        null=True, blank=True, help_text="The last tick whose start was refused (its quota was full, or invalid)."
    )
    last_refusal = models.CharField(
        max_length=20,
        choices=ScheduleOutcome.choices,
        blank=True,
        default="",
        help_text="Why that tick's start was refused: refused (the start quota) or invalid.",
    )
    paused = models.BooleanField(
        default=False, help_text="A paused schedule starts nothing; resuming skips the ticks of the pause."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["workflow"]

    def __str__(self) -> str:
        return self.workflow
