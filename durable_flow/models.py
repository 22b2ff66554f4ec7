"""What durable_flow persists: runs, step checkpoints, signals, transport tasks, queues,
admission state and worker heartbeats. A run's state lives here, never only in memory."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import models
from django.db.models import Q

from durable_flow.exceptions import InvalidInput
from durable_flow.limits import (
    ADJUSTMENT_REASON_LENGTH,
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
from durable_flow.serialization import TOO_DEEP, nested_too_deep
from durable_flow.validation import bounded_depth


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


class StepStatus(models.TextChoices):
    WAITING = "waiting", "Waiting for admission"
    DISPATCHED = "dispatched", "Dispatched"
    RETRYING = "retrying", "Waiting out backoff"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


SETTLED_STEP_STATUSES = (StepStatus.COMPLETED, StepStatus.FAILED, StepStatus.CANCELLED)


class StepCheckpoint(models.Model):
    """The durable record of one call a workflow made: a step, a sleep, a child or a signal wait.

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
    child_run_id = models.CharField(max_length=200, blank=True, default="")
    worker = models.CharField(max_length=200, blank=True, default="", help_text="Worker executing the attempt.")
    late_result = BoundedJSONField(default=None, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "sequence"]  # by the column: ordering by "run" would join the run table
        constraints = [models.UniqueConstraint(fields=["run", "key"], name="df_checkpoint_run_key")]
        indexes = [
            models.Index(fields=["queue", "status"], name="df_checkpoint_queue_status"),
            models.Index(fields=["status", "dispatched_at"], name="df_checkpoint_status_disp"),
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
    every process. Advanced after each admitting transaction commits (`durable_flow.counters`),
    in a row of its own, so it never contends with the `db` backend's lock on `FlowQueue`."""

    queue = models.CharField(primary_key=True, max_length=100)
    admissions = models.BigIntegerField(default=0, help_text="Step attempts admitted through the queue, ever.")
    parked = models.BigIntegerField(default=0, help_text="Step attempts that waited in the queue's line, ever.")

    class Meta:
        ordering = ["queue"]

    def __str__(self) -> str:
        return self.queue


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


class QuotaRefusal(models.Model):
    """Starts a quota refused, counted per key and minute (for the dashboard and the admin)."""

    key = models.CharField(max_length=200)
    minute = models.DateTimeField()
    refusals = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["key", "minute"], name="df_refusal_key_minute")]
        indexes = [models.Index(fields=["minute"], name="df_refusal_minute")]


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

    class Meta:
        ordering = ["checkpoint_id", "attempt"]
        constraints = [models.UniqueConstraint(fields=["checkpoint", "attempt"], name="df_attempt_checkpoint_n")]
        indexes = [models.Index(fields=["run", "started_at"], name="df_attempt_run_started")]

    def __str__(self) -> str:
        return f"{self.checkpoint_id} attempt {self.attempt} ({self.status})"


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


# The admission backends' rows live in their own module (kept under 400 lines each); imported
# here so Django registers them with this app and `durable_flow.models` names every model.
from durable_flow.admission.models import (  # noqa: E402
    AdmissionHold,
    AdmissionKeyMark,
    AdmissionKeyServed,
    AdmissionKeyTat,
    AdmissionMark,
    AdmissionResourceHead,
    AdmissionResourceServed,
    AdmissionResourceWaiter,
    AdmissionSlot,
    AdmissionStart,
    AdmissionWaiter,
)
from durable_flow.start_models import StartCounter  # noqa: E402

__all__ = [
    "SETTLED_STEP_STATUSES",
    "TERMINAL_RUN_STATUSES",
    "AdmissionHold",
    "AdmissionKeyMark",
    "AdmissionKeyServed",
    "AdmissionKeyTat",
    "AdmissionMark",
    "AdmissionResourceHead",
    "AdmissionResourceServed",
    "AdmissionResourceWaiter",
    "AdmissionSlot",
    "AdmissionStart",
    "AdmissionWaiter",
    "AttemptStatus",
    "FlowQueue",
    "QueueCounter",
    "QueueSample",
    "QuotaRefusal",
    "RunStatus",
    "Signal",
    "StartCounter",
    "StepAttempt",
    "StepCheckpoint",
    "StepKind",
    "StepStatus",
    "Task",
    "TaskKind",
    "WorkerHeartbeat",
    "WorkerSample",
    "WorkflowRun",
]
