"""Start quotas over the rows: the key's transaction-scoped lock, the count of its active runs,
the check a start or a retry passes inside its transaction, refused starts counted per minute,
and what a run's or a child checkpoint's quota columns say (a retry's check, a recorded refusal).

The rules (`QuotaSpec`, `QuotaCheck`, what a refusal records) are declarations, in
`durable_flow.definitions.quotas`; this module reads and writes them in the database.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connection
from django.db.models import F
from django.utils import timezone

from durable_flow.definitions.quotas import ACTIVE_STATUSES, REFUSED, QuotaCheck, QuotaSpec
from durable_flow.exceptions import ConcurrencyLimitError, InvalidQuota
from durable_flow.models import QuotaRefusal, StepCheckpoint, WorkflowRun
from durable_flow.store import metric_counts


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
    """Count a refused start against its key's current minute (outside the refused start's
    transaction, which rolled back)."""
    minute = timezone.now().replace(second=0, microsecond=0)
    QuotaRefusal.objects.bulk_create([QuotaRefusal(key=exc.key, minute=minute)], ignore_conflicts=True)
    QuotaRefusal.objects.filter(key=exc.key, minute=minute).update(refusals=F("refusals") + 1)
    metric_counts.count(metric_counts.STARTS_REFUSED, {"workflow": exc.workflow})


def enforce(check: QuotaCheck, *, excluding: str | None = None) -> None:
    """Serialise on the key, count its active runs, and refuse when the quota is full.

    Must run inside the transaction that INSERTs the run (or, for a retry, makes run
    `excluding` active again; that run is not counted against itself): the advisory lock is
    held until that transaction ends, so the next start on the key counts this run.
    """
    if check.limit <= 0:
        raise ConcurrencyLimitError(check.key, check.limit, 0, check.workflow)
    lock_key(check.key)
    active = count_active(check.key, check.count_statuses, excluding=excluding)
    if active >= check.limit:
        raise ConcurrencyLimitError(check.key, check.limit, active, check.workflow)


def retry_plan(run: WorkflowRun, workflow_quota: QuotaSpec | None) -> QuotaCheck | None:
    """The check a retry of `run` passes before the run is active again, or None when the run
    started unlimited: the key it started under (`concurrency_key`), with the workflow's limit
    for that key now and its counted statuses, or, when a per-start quota gave the key, the limit
    that start stored. A retried run takes a slot as a start does; it never takes one it was not
    started with."""
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
                workflow=run.workflow,
            )
    if run.concurrency_limit is None:  # a row from before limits were stored: none to check against
        return None
    return QuotaCheck(key=key, limit=run.concurrency_limit, count_statuses=ACTIVE_STATUSES, workflow=run.workflow)


def is_refusal(cp: StepCheckpoint) -> bool:
    """Whether a child checkpoint records a refused start (no child run was created)."""
    error = cp.error if isinstance(cp.error, dict) else {}
    return cp.status == "failed" and error.get("status") == REFUSED


def raise_if_refused(cp: StepCheckpoint) -> None:
    """Inside the parent's `ctx.child`: re-raise a recorded refusal as `ConcurrencyLimitError`."""
    if is_refusal(cp):
        quota = cp.error["quota"]
        raise ConcurrencyLimitError(quota["key"], quota["limit"], quota["active"], quota["workflow"])
