"""Start quotas over the rows: the key's transaction-scoped lock, the count of its active runs,
the check a start or a retry passes inside its transaction, refused starts (counted per minute,
and kept one row each until their retention ends), and what a run's or a child checkpoint's
quota columns say (a retry's check, a recorded refusal).

The rules (`QuotaSpec`, `QuotaCheck`, what a refusal records) are declarations, in
`durable_flow.definitions.quotas`; this module reads and writes them in the database.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import F
from django.utils import timezone

from durable_flow.definitions.quotas import ACTIVE_STATUSES, REFUSED, QuotaCheck, QuotaSpec
from durable_flow.exceptions import ConcurrencyLimitError, InvalidQuota
from durable_flow.models import QuotaRefusal, StartRefusal, StepCheckpoint, WorkflowRun
from durable_flow.store import metric_counts

#: Run statuses a run leaves at its `wake_at`, for `pending` (the poller wakes it then).
PARKED_STATUSES = ("debounced", "suspended")


def lock_key(key: str) -> None:
    """Take the key's transaction-scoped lock (PostgreSQL); SQLite's write lock is already held."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [key])


def count_active(key: str, statuses: Iterable[str] = ACTIVE_STATUSES, *, excluding: str | None = None) -> int:
    """Runs of `key` occupying a slot (but run `excluding`): one COUNT(*) on the
    (concurrency_key, status) index."""
    runs = WorkflowRun.objects.filter(concurrency_key=key, status__in=list(statuses))
    if excluding is not None:
        runs = runs.exclude(pk=excluding)
    return runs.count()


def record_refusal(exc: ConcurrencyLimitError) -> None:
    """Count a refused start against its key's current minute, and keep its row in the refusal
    history (outside the refused start's transaction, which rolled back).

    One INSERT per refusal, not a batch: a refused start has already paid a transaction (the
    key's lock and its COUNT) and the minute's upsert, so the row adds one statement to three,
    and a row buffered in memory would be lost with its process."""
    now = timezone.now()
    minute = now.replace(second=0, microsecond=0)
    QuotaRefusal.objects.bulk_create([QuotaRefusal(key=exc.key, minute=minute)], ignore_conflicts=True)
    QuotaRefusal.objects.filter(key=exc.key, minute=minute).update(refusals=F("refusals") + 1)
    StartRefusal.objects.create(workflow=exc.workflow, key=exc.key, at=now, active=exc.active, limit=exc.limit)
    metric_counts.count(metric_counts.STARTS_REFUSED, {"workflow": exc.workflow})


#: Refusal rows deleted per statement, and statements per poller pass: a short lock each, and a
#: bounded pass however far behind the history is.
PRUNE_BATCH = 1000
PRUNE_BATCHES = 10


def prune_refusals(retention_s: float, now: datetime) -> int:
    """Delete refusal rows (`StartRefusal`, and the per-minute `QuotaRefusal` counts) older than
    the retention, in batches of `PRUNE_BATCH`; return how many went."""
    cutoff = now - timedelta(seconds=retention_s)
    deleted = 0
    for model, field in ((StartRefusal, "at"), (QuotaRefusal, "minute")):
        for _ in range(PRUNE_BATCHES):
            ids = list(
                model.objects.filter(**{f"{field}__lt": cutoff})
                .order_by(field)
                .values_list("pk", flat=True)[:PRUNE_BATCH]
            )
            if not ids:
                break
            deleted += model.objects.filter(pk__in=ids).delete()[0]
    return deleted


def enforce(check: QuotaCheck, *, excluding: str | None = None) -> None:
    """Serialise on the key, count its active runs, and refuse when the quota is full.

    Must run inside the transaction that INSERTs the run (or, for a retry, makes run
    `excluding` active again; that run is not counted against itself): the advisory lock is
    held until that transaction ends, so the next start on the key counts this run.
    """
    if check.limit <= 0:
        raise ConcurrencyLimitError(check.key, check.limit, 0, check.workflow)  # never frees: no retry_at
    lock_key(check.key)
    active = count_active(check.key, check.count_statuses, excluding=excluding)
    if active >= check.limit:
        raise ConcurrencyLimitError(check.key, check.limit, active, check.workflow, retry_at=slot_frees_at(check))


def slot_frees_at(check: QuotaCheck) -> datetime | None:
    """When a slot of the key frees as planned now, or None when that is not known.

    A parked run (`debounced`, or `suspended` on a timer) holding a slot becomes `pending` at its
    `wake_at`; if the quota does not count `pending`, its slot frees then. A run that is pending,
    running or cancelling ends when its code does, which nothing knows in advance, so a quota
    counting every active status (the default) has no such time. One query on the
    `(concurrency_key, status)` index, run only when a start is refused."""
    parked = [status for status in PARKED_STATUSES if status in check.count_statuses]
    if "pending" in check.count_statuses or not parked:
        return None
    runs = WorkflowRun.objects.filter(concurrency_key=check.key, status__in=parked, wake_at__isnull=False)
    return runs.order_by("wake_at").values_list("wake_at", flat=True).first()


def retry_plan(run: WorkflowRun, workflow_quota: QuotaSpec | None, label: str | None = None) -> QuotaCheck | None:
    """The check a retry of `run` passes before the run is active again, or None when the run
    started unlimited: the key it started under (`concurrency_key`), with the workflow's limit
    for that key now and its counted statuses, or, when a per-start quota gave the key, the limit
    that start stored. A retried run takes a slot as a start does; it never takes one it was not
    started with. A refusal names `label` (`WorkflowDefinition.label_for`), else the workflow."""
    workflow = label or run.workflow
    key = run.concurrency_key
    if not key:
        return None
    if workflow_quota is not None:
        try:
            own = workflow_quota.resolve_key(run.input) == key
        except InvalidQuota:
            own = False
        if own:
            return QuotaCheck(
                key=key,
                limit=workflow_quota.resolve_limit(key),
                count_statuses=workflow_quota.count_statuses,
                workflow=workflow,
            )
    if run.concurrency_limit is None:  # a row from before limits were stored: none to check against
        return None
    return QuotaCheck(key=key, limit=run.concurrency_limit, count_statuses=ACTIVE_STATUSES, workflow=workflow)


def is_refusal(cp: StepCheckpoint) -> bool:
    """Whether a child checkpoint records a refused start (no child run was created)."""
    error = cp.error if isinstance(cp.error, dict) else {}
    return cp.status == "failed" and error.get("status") == REFUSED


def raise_if_refused(cp: StepCheckpoint) -> None:
    """Inside the parent's `ctx.child`: re-raise a recorded refusal as `ConcurrencyLimitError`."""
    if is_refusal(cp):
        quota = cp.error["quota"]
        raise ConcurrencyLimitError(quota["key"], quota["limit"], quota["active"], quota["workflow"])
