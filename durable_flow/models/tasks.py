"""The `db` transport's work: one row per turn or step to run, claimed by workers."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class TaskKind(models.TextChoices):
    TURN = "turn", "Workflow turn"
    STEP = "step", "Step"


class Task(models.Model):
    """A job of the embedded `db` transport. Claimed with a lease; a dead worker's lease lapses
    and the task becomes claimable again."""

    kind = models.CharField(max_length=4, choices=TaskKind.choices)
    run_id = models.CharField(max_length=200)
    step_key = models.CharField(max_length=100, blank=True, default="")
    attempt = models.PositiveIntegerField(default=0)
    priority = models.IntegerField(default=0)
    available_at = models.DateTimeField()
    claimed_by = models.CharField(max_length=200, null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    #: How many times a worker claimed it: 1 on its first delivery, more once it was handed back,
    #: given up for a dead worker or taken after its lease lapsed (`engine/optimistic.py` runs a
    #: run's first step before writing anything only on a turn's first delivery).
    deliveries = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            # At most one queued (unclaimed) turn per run: a burst of results wakes it once.
            models.UniqueConstraint(
                fields=["run_id"], condition=Q(kind="turn", claimed_by__isnull=True), name="df_task_one_queued_turn"
            )
        ]
        # The claim's order: step tasks first ("step" < "turn"), then priority, then arrival.
        indexes = [models.Index(fields=["kind", "-priority", "id"], name="df_task_claim_order")]
