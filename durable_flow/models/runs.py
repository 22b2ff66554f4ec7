"""Runs and what they record: the run row, its step checkpoints, signals and step attempts."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import models

from durable_flow.config.limits import (
    FAIRNESS_KEY_LENGTH,
    QUEUE_NAME_LENGTH,
    QUOTA_KEY_LENGTH,
    RUN_ID_LENGTH,
    SIGNAL_NAME_LENGTH,
    STEP_NAME_LENGTH,
    VERSION_LENGTH,
    WORKFLOW_NAME_LENGTH,
    ticket_text,
)
from durable_flow.config.validation import TOO_DEEP, bounded_depth
from durable_flow.definitions.serialization import nested_too_deep
from durable_flow.exceptions import InvalidInput


def new_run_id() -> str:
    """A random run id; callers may pass their own to make `start` idempotent."""
    return uuid.uuid4().hex


class BoundedJSONField(models.JSONField):
    """A `JSONField` that reads a value nested deeper than `MAX_JSON_DEPTH` (stored before the
    limit existed, or written by hand) as the placeholder `TOO_DEEP`. A deep enough value does
    not decode at all (`RecursionError`), and would fail every query that loads its row: the
    run list, the run's pages, the worker's turn, which would then be delivered again forever.

    The column is a plain JSON column: migrations see a `JSONField` (`deconstruct`), so a field
    changed to this class alters nothing in the database.
    """

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if isinstance(value, str) and nested_too_deep(value):
            try:
                return bounded_depth(super().from_db_value(value, expression, connection), self.name)
            except (RecursionError, InvalidInput):
                return TOO_DEEP
        return super().from_db_value(value, expression, connection)

    def deconstruct(self) -> Any:
        name, _, args, kwargs = super().deconstruct()
        return name, "django.db.models.JSONField", args, kwargs


class RunStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    # Started with `debounce`: waits (durably, `wake_at`) for its period to pass with no new start.
    DEBOUNCED = "debounced", "Debounced"
    RUNNING = "running", "Running"
    SUSPENDED = "suspended", "Suspended"
    CANCELLING = "cancelling", "Cancelling"
    CANCELLED = "cancelled", "Cancelled"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"


TERMINAL_RUN_STATUSES = (RunStatus.CANCELLED, RunStatus.COMPLETED, RunStatus.FAILED)
#: Runs a turn may wake: suspended (waiting on a timer, signal or step) or running.
WAKEABLE = (RunStatus.SUSPENDED, RunStatus.RUNNING)


class WorkflowRun(models.Model):
    """One execution of a workflow; replayed turn by turn from its checkpoints."""

    id = models.CharField(primary_key=True, max_length=RUN_ID_LENGTH, default=new_run_id)
    workflow = models.CharField(max_length=WORKFLOW_NAME_LENGTH)
    version = models.CharField(max_length=VERSION_LENGTH, default="1")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING)
    input = BoundedJSONField(default=None, null=True)
    output = BoundedJSONField(default=None, null=True, blank=True)
    error = models.JSONField(default=None, null=True, blank=True)
    wake_at = models.DateTimeField(null=True, blank=True, help_text="When the poller next wakes this run.")
    tags = models.JSONField(default=list, blank=True)
    # Indexed below only where set (`df_run_parent`): most runs have no parent.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children", db_index=False
    )
    parent_step_key = models.CharField(max_length=100, blank=True, default="")
    concurrency_key = models.CharField(
        max_length=QUOTA_KEY_LENGTH, null=True, blank=True, default=None, help_text="The start quota this run draws on."
    )
    concurrency_limit = models.IntegerField(
        null=True, blank=True, help_text="The start quota's limit for its key when this run started."
    )
    step_concurrency = models.JSONField(
        default=list,
        blank=True,
        help_text="The step-concurrency constraints evaluated when the run started: [{resource, limit}].",
    )
    turns = models.PositiveIntegerField(default=0, help_text="How many times the workflow function was replayed.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    rerun_of = models.CharField(
        max_length=200, blank=True, default="", help_text="The run this one re-runs (same workflow and input)."
    )
    start_key = models.CharField(
        max_length=200, null=True, blank=True, default=None, help_text="The debounce or singleton key of its start."
    )
    debounce_until = models.DateTimeField(
        null=True, blank=True, help_text="The latest a debounced run can be pushed back to (`max_wait`)."
    )

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("cancel_workflowrun", "Can cancel runs"),
            ("retry_workflowrun", "Can retry failed or cancelled runs"),
            ("signal_workflowrun", "Can send signals to runs"),
            ("start_workflowrun", "Can start runs"),
        ]
        indexes = [
            # The poller's query: due suspended runs, oldest first. Its cost follows the due
            # rows, not every parked run.
            models.Index(fields=["status", "wake_at"], name="df_run_status_wake"),
            models.Index(fields=["workflow", "status"], name="df_run_workflow_status"),
            models.Index(fields=["-created_at"], name="df_run_created"),
            # A start quota's check: one COUNT(*) of a key's runs in the counted statuses.
            # Partial, as are the two after it: a run without the key (most runs) is in none of
            # them, so its every status change skips them (an UPDATE of an indexed column
            # inserts an entry in each index the new row version is in).
            models.Index(
                fields=["concurrency_key", "status"],
                name="df_run_quota_status",
                condition=models.Q(concurrency_key__isnull=False),
            ),
            # Debounce and singleton: a start finds the key's pending or in-progress run by the key,
            # never by scanning every debounced run (wake_at is in it so it beats status+wake_at).
            models.Index(
                fields=["start_key", "status", "wake_at"],
                name="df_run_start_key_status",
                condition=models.Q(start_key__isnull=False),
            ),
            # A run's children (the admin, `on_delete=SET_NULL` when a parent is deleted).
            models.Index(fields=["parent"], name="df_run_parent", condition=models.Q(parent__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.workflow}:{self.id} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_RUN_STATUSES


class StepKind(models.TextChoices):
    STEP = "step", "Step"
    SLEEP = "sleep", "Sleep"
    CHILD = "child", "Child run"
    SIGNAL = "signal", "Signal wait"
    EVENT = "event", "Event wait"
    PATCH = "patch", "Patch marker"


class StepStatus(models.TextChoices):
    WAITING = "waiting", "Waiting for admission"
    DISPATCHED = "dispatched", "Dispatched"
    RETRYING = "retrying", "Waiting out backoff"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


class WaitCause(models.TextChoices):
    """Why a call is parked, as the engine recorded it when it parked the call (the first five
    are admission's answer; the others the call's own wait)."""

    CAP = "cap", "Queue's cap full"
    RATE = "rate", "Rate window full"
    KEY_RATE = "key_rate", "Key's own rate limit"
    KEY = "key", "Key's step-concurrency limit"
    PAUSED = "paused", "Queue paused"
    TURN = "turn", "Others ahead in line"
    SIGNAL = "signal", "Waiting for a signal"
    EVENT = "event", "Waiting for an event"
    SLEEP = "sleep", "Sleeping"
    BACKOFF = "backoff", "Retry backoff"


#: The causes admission gives: a queue wait's, kept on its attempt (`StepAttempt.waited`).
ADMISSION_CAUSES = frozenset({"cap", "rate", "key_rate", "key", "paused", "turn"})
#: How many characters of text a wait's detail keeps per value (names, keys).
WAIT_DETAIL_TEXT = 200


SETTLED_STEP_STATUSES = (StepStatus.COMPLETED, StepStatus.FAILED, StepStatus.CANCELLED)
#: Steps parked in a queue's line or waiting out a retry's backoff: no attempt is running.
PARKED_STEP_STATUSES = (StepStatus.WAITING, StepStatus.RETRYING)
PARKED = frozenset(PARKED_STEP_STATUSES)


class StepCheckpoint(models.Model):
    """The durable record of one call a workflow made: a step, a sleep, a child or a signal wait;
    or which side of a `ctx.patched` change the run took (a marker keyed `patch:<id>`).

    `key` is deterministic (the call's position in the workflow, `3` or `3.17` inside a fan),
    so a replay finds the same checkpoint for the same call.
    """

    # No index of its own: the unique (run, key) constraint's index leads with the run.
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="checkpoints", db_index=False)
    key = models.CharField(max_length=100)
    sequence = models.PositiveIntegerField(help_text="Order of creation within the run.")
    kind = models.CharField(max_length=8, choices=StepKind.choices, default=StepKind.STEP)
    name = models.CharField(max_length=STEP_NAME_LENGTH)
    status = models.CharField(max_length=12, choices=StepStatus.choices)
    input = BoundedJSONField(default=None, null=True)
    output = BoundedJSONField(default=None, null=True, blank=True)
    error = models.JSONField(default=None, null=True, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=1)
    queue = models.CharField(
        max_length=QUEUE_NAME_LENGTH, blank=True, default="", help_text="Flow-control queue holding its slot."
    )
    holds_slot = models.BooleanField(default=False)
    priority = models.IntegerField(default=0)
    fairness_key = models.CharField(max_length=FAIRNESS_KEY_LENGTH, blank=True, default="")
    group = models.CharField(max_length=100, blank=True, default="", help_text="Fan-out wave this call belongs to.")
    wake_at = models.DateTimeField(null=True, blank=True, help_text="Sleep end, backoff end or step deadline.")
    timeout_s = models.FloatField(null=True, blank=True, help_text="Per-call timeout, overriding the step's.")
    start_deadline = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When a call waiting for admission gives up (its start timeout), set as it joins the line.",
    )
    child_run_id = models.CharField(max_length=200, blank=True, default="")
    worker = models.CharField(max_length=200, blank=True, default="", help_text="Worker executing the attempt.")
    late_result = BoundedJSONField(default=None, null=True, blank=True)
    wait_cause = models.CharField(
        max_length=8,
        choices=WaitCause.choices,
        blank=True,
        default="",
        help_text="Why the call is parked now, recorded when it was parked; empty once it is admitted.",
    )
    wait_detail = models.JSONField(
        default=None,
        null=True,
        blank=True,
        help_text="The parked call's cause with its figures (limits, until when, key, signal names); "
        "after an admission, the queue wait its attempt had.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "sequence"]  # by the column: ordering by "run" would join the run table
        constraints = [models.UniqueConstraint(fields=["run", "key"], name="df_checkpoint_run_key")]
        indexes = [
            # A queue's line in arrival order: the parked calls' oldest and count (index-only,
            # the count capped), the flow view's first waiters, the keys at the front. It
            # replaces a plain `(queue, status)` index: the same entries, 8 bytes wider.
            models.Index(fields=["queue", "status", "created_at"], name="df_checkpoint_queue_line"),
            models.Index(fields=["status", "dispatched_at"], name="df_checkpoint_status_disp"),
            # The metrics' exact count of each queue's line (`durable_flow_queue_waiting`): only
            # parked calls are in it, one small entry each (the queue's name, deduplicated), so
            # counting a line of 100,000 reads a tenth of the pages the line's own index holds.
            models.Index(fields=["queue"], name="df_checkpoint_waiting", condition=models.Q(status="waiting")),
            # "Waiting because of X": only parked calls are in it, so a call admitted at once
            # (most) never writes an entry.
            models.Index(
                fields=["wait_cause", "run"], name="df_checkpoint_wait_cause", condition=~models.Q(wait_cause="")
            ),
            # Calls settled in a time window (the poller's samples, the flow view's last seconds,
            # the metrics): one entry per settled call, written when it settles.
            models.Index(
                fields=["status", "finished_at"],
                name="df_checkpoint_settled",
                condition=models.Q(finished_at__isnull=False),
            ),
            # `ctx.wait_for_event`'s waits by event name: an event reads only the waits for its
            # name, and a wait leaves the index when it settles.
            models.Index(
                fields=["name", "dispatched_at"],
                name="df_checkpoint_event_wait",
                condition=models.Q(kind="event", status="dispatched"),
            ),
            # `ctx.patched` markers by change (`manage.py durable_patches`): only markers are in it.
            models.Index(fields=["name", "run"], name="df_checkpoint_patch", condition=models.Q(kind="patch")),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}/{self.key} {self.name} ({self.status})"

    @property
    def ticket(self) -> str:
        """The admission ticket: who holds (or waits for) a queue slot."""
        return ticket_text(self.run_id, self.key)


class Signal(models.Model):
    """A named message to a run. Kept until a `wait_for_signal` consumes it, so none is lost."""

    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="signals")
    name = models.CharField(max_length=SIGNAL_NAME_LENGTH)
    payload = BoundedJSONField(default=None, null=True)
    consumed_by = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["run", "name", "consumed_by"], name="df_signal_lookup")]


class AttemptStatus(models.TextChoices):
    RUNNING = "running", "Running"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


class StepAttempt(models.Model):
    """One attempt of a step, kept when later attempts follow: a step that failed twice and
    then succeeded has three rows, each with its times, worker and error.

    The checkpoint holds only the latest attempt's state (what replay needs); these rows are
    the history people read (the dashboard's timeline, the admin). A row is written when a
    worker starts executing the attempt and completed when its result is recorded, so an
    attempt still `running` after a later one exists was lost with its worker.
    """

    # Neither foreign key has an index of its own: the unique (checkpoint, attempt) constraint's
    # index and `df_attempt_run_started` lead with them. Every index costs each insert.
    checkpoint = models.ForeignKey(StepCheckpoint, on_delete=models.CASCADE, related_name="attempts", db_index=False)
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="step_attempts", db_index=False)
    attempt = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=AttemptStatus.choices, default=AttemptStatus.RUNNING)
    worker = models.CharField(max_length=200, blank=True, default="")
    dispatched_at = models.DateTimeField(null=True, blank=True, help_text="Admitted and sent to the transport.")
    started_at = models.DateTimeField(null=True, blank=True, help_text="A worker began executing it.")
    finished_at = models.DateTimeField(null=True, blank=True)
    retry_at = models.DateTimeField(null=True, blank=True, help_text="End of the backoff after this failure.")
    error = models.JSONField(default=None, null=True, blank=True)
    late = models.BooleanField(default=False, help_text="Answered after the step had moved on; ignored.")
    operator_retry_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When an operator retried the run after this attempt failed for good or was cancelled.",
    )
    waited = models.JSONField(
        default=None,
        null=True,
        blank=True,
        help_text="Why this attempt waited in its queue before it was admitted (the engine's record), if it did.",
    )

    class Meta:
        ordering = ["checkpoint_id", "attempt"]
        constraints = [models.UniqueConstraint(fields=["checkpoint", "attempt"], name="df_attempt_checkpoint_n")]
        indexes = [
            models.Index(fields=["run", "started_at"], name="df_attempt_run_started"),
            # Attempts that failed in a time window (the poller's samples): failed ones only.
            models.Index(
                fields=["finished_at"], name="df_attempt_failed_at", condition=models.Q(status=AttemptStatus.FAILED)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.checkpoint_id} attempt {self.attempt} ({self.status})"
