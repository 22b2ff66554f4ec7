"""What an event (`durable_flow.definitions.events`) persists: the event, and what it did to runs."""

from __future__ import annotations

from django.db import models

from durable_flow.config.limits import EVENT_ID_LENGTH, EVENT_NAME_LENGTH, RUN_ID_LENGTH, WORKFLOW_NAME_LENGTH
from durable_flow.models.runs import BoundedJSONField


class Event(models.Model):
    """One event `send_event` recorded, once per `id` (the sender's idempotency key).

    `pending` until every run it starts, resumes or cancels has been dealt with
    (`durable_flow.runtime.events`): the sender's process delivers it right after the commit
    that records it, and the poller finishes a delivery a dead process left pending."""

    id = models.CharField(primary_key=True, max_length=EVENT_ID_LENGTH)
    name = models.CharField(max_length=EVENT_NAME_LENGTH)
    data = BoundedJSONField(default=dict)
    received_at = models.DateTimeField(help_text="When it was recorded: its `ts`.")
    pending = models.BooleanField(default=True, help_text="Its delivery to runs is not finished yet.")
    delivered_at = models.DateTimeField(null=True, blank=True, help_text="When its delivery finished.")

    class Meta:
        ordering = ["-received_at"]
        indexes = [
            # A wait's look-back at its first turn: this name's events since the wait began.
            models.Index(fields=["name", "received_at"], name="df_event_name_received"),
            models.Index(fields=["-received_at"], name="df_event_received"),
            # The poller's sweep: only pending events are in it (most are delivered within the second).
            models.Index(fields=["received_at"], name="df_event_pending", condition=models.Q(pending=True)),
        ]

    def __str__(self) -> str:
        return f"{self.name} {self.id}"


class EventAction(models.TextChoices):
    """What an event did to one run."""

    STARTED = "started", "started"
    #: Debounce folded the start into a pending run, or a singleton found its run in progress.
    GATED = "gated", "gated by debounce or singleton"
    #: The workflow's start quota was full: the start is not retried.
    REFUSED = "refused", "refused by the start quota"
    #: The start was refused as invalid (a key failed on the event): logged, not retried.
    INVALID = "invalid", "invalid start"
    RESUMED = "resumed", "resumed a wait"
    CANCELLED = "cancelled", "cancelled"


#: The actions of a trigger's start: one of them per (event, workflow).
START_ACTIONS = (EventAction.STARTED, EventAction.GATED, EventAction.REFUSED, EventAction.INVALID)


class EventDelivery(models.Model):
    """A run an event started (or whose start it tried), resumed or cancelled. A trigger's start
    and its row are written in one transaction, and at most one start row exists per (event,
    workflow), so a delivery repeated after a crash starts nothing twice."""

    event = models.ForeignKey(Event, on_delete=models.CASCADE, related_name="deliveries", db_index=False)
    action = models.CharField(max_length=10, choices=EventAction.choices)
    workflow = models.CharField(max_length=WORKFLOW_NAME_LENGTH)
    run_id = models.CharField(max_length=RUN_ID_LENGTH)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["event_id", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["event", "workflow"],
                name="df_event_delivery_start",
                condition=models.Q(action__in=[a.value for a in START_ACTIONS]),
            ),
            models.UniqueConstraint(fields=["event", "run_id", "action"], name="df_event_delivery_run"),
        ]
        indexes = [models.Index(fields=["run_id"], name="df_event_delivery_run_id")]

    def __str__(self) -> str:
        return f"{self.event_id} {self.action} {self.run_id}"
