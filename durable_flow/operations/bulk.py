"""Bulk operations: cancel or retry thousands of runs (every run an admin filter matches) in a
bounded number of queries.

Runs are processed in batches of `BATCH_SIZE` ids, one transaction each, found by keyset
pagination on the primary key (`matching_batches`): a batch that changes runs' status (and so
drops them out of a status filter) does not shift the next page, and nothing holds a cursor or
a lock between batches. Within a batch the work is set-based: a handful of queries for the
whole batch (lock the rows, read their unsettled checkpoints, one UPDATE per kind of change, one
INSERT of the audit entries), not a transaction per run. What cannot be done for a set without
repeating the engine's per-run rules takes the engine's own per-run path inside the batch's
transaction: cancelling a child whose parent is still live (the parent must be told), and
retrying a run with failed or cancelled child calls (the children are retried with it) or one
under a start quota or a singleton (each passes them again, counting the runs retried before it).

Each processed run gets its own admin `LogEntry` (so its History shows who cancelled or retried
it), written with one bulk INSERT per batch.

The result counts what happened to each run selected: `done`, `skipped` (it no longer needed it
when its batch reached it: a run to cancel that finished by then, a run to retry that is no
longer failed or cancelled) and `failed` (refused, with a reason each). An operator confirms a
count first; `confirmed_at` (when that count was shown) keeps the selection to the runs that
count was about: started by then, and for a cancel unfinished then, so the runs that finished
in between are counted as skipped instead of silently missing from the total.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Count, F, Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from durable_flow.definitions.registry import get_workflow
from durable_flow.engine import get_engine, retry_on_conflict
from durable_flow.exceptions import ConcurrencyLimitError, DurableFlowError, WorkflowNotFound
from durable_flow.models import (
    SETTLED_STEP_STATUSES,
    TERMINAL_RUN_STATUSES,
    RunStatus,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WorkflowRun,
)
from durable_flow.operations.audit import record_operations
from durable_flow.operations.runs import RETRYABLE, attempt_budget, retry
from durable_flow.store import metric_counts
from durable_flow.store.attempts import operator_retried

#: Runs per transaction: large enough to amortise the per-batch queries, small enough that an
#: `IN (...)` list stays far below every database's parameter limit and a batch's locks are short.
BATCH_SIZE = 500
CANCELLED_ERROR = {"type": "Cancelled", "message": "cancelled"}
LIVE_PARENT_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED)
#: A confirmation time this far ahead of the server's clock is not one a confirmation page wrote.
CLOCK_SLACK = timedelta(minutes=5)


@dataclass
class BulkResult:
    """What a bulk operation did: `done` runs changed, `skipped` runs that no longer needed it
    when their batch reached them (finished by then, for a cancel), and why others were refused
    (`failed` of them)."""

    done: int = 0
    refused: list[str] = field(default_factory=list)
    batches: int = 0
    skipped: int = 0

    @property
    def failed(self) -> int:
        return len(self.refused)

    def summary(self, verb: str) -> str:
        """`Cancel: 45 done, 7 already finished.` — every count that is not zero, in words."""
        parts = [f"{self.done} done"]
        if self.skipped:
            why = "already finished" if verb == "Cancel" else "no longer failed or cancelled"
            parts.append(f"{self.skipped} {why}")
        if self.failed:
            parts.append(f"{self.failed} failed")
        return f"{verb}: {', '.join(parts)}."


def cancellable(runs: QuerySet[WorkflowRun]) -> QuerySet[WorkflowRun]:
    """The runs of `runs` a cancel would change (every non-terminal one)."""
    return runs.exclude(status__in=TERMINAL_RUN_STATUSES)


def unfinished_at(
    runs: QuerySet[WorkflowRun], confirmed_at: datetime, statuses: Sequence[str] = ()
) -> QuerySet[WorkflowRun]:
    """The runs of `runs` a cancel confirmed at `confirmed_at` was about, as the rows tell it
    now: started by then, and either still unfinished (in `statuses`, when the operator's filter
    named some) or finished since (the ones a cancel reports as already finished). `runs` must
    not be filtered by status itself (a finished run no longer has the status it had then):
    pass the filter's statuses here. A status filter naming only finished statuses selects
    nothing to cancel."""
    started = runs.filter(created_at__lte=confirmed_at)
    live = [status for status in statuses if status not in TERMINAL_RUN_STATUSES]
    if statuses and not live:
        return started.none()
    unfinished = ~Q(status__in=TERMINAL_RUN_STATUSES) & (Q(status__in=live) if live else Q())
    finished_since = Q(status__in=TERMINAL_RUN_STATUSES, finished_at__gte=confirmed_at)
    return started.filter(unfinished | finished_since)


def retryable(runs: QuerySet[WorkflowRun]) -> QuerySet[WorkflowRun]:
    """The runs of `runs` a retry would consider (failed or cancelled)."""
    return runs.filter(status__in=RETRYABLE)


def confirmation_time(raw: str | None) -> datetime | None:
    """When a confirmation page showed its count, as its form sends it back (ISO 8601 with an
    offset); None for anything else, a time without an offset or one in the future."""
    try:
        value = parse_datetime(raw) if isinstance(raw, str) and len(raw) <= 64 else None
    except ValueError:  # well formed, but no such date
        return None
    if value is None or timezone.is_naive(value) or value > timezone.now() + CLOCK_SLACK:
        return None
    return value


def matching_batches(runs: QuerySet[WorkflowRun], size: int = BATCH_SIZE) -> Iterator[list[str]]:
    """The ids `runs` matches, `size` at a time, by keyset pagination on the primary key."""
    ordered = runs.order_by("pk").values_list("pk", flat=True)
    last: str | None = None
    while True:
        page = ordered if last is None else ordered.filter(pk__gt=last)
        ids = list(page[:size])
        if not ids:
            return
        yield ids
        last = ids[-1]


def cancel_matching(
    runs: QuerySet[WorkflowRun],
    user: Any = None,
    message: str = "Cancelled (bulk)",
    *,
    confirmed_at: datetime | None = None,
    statuses: Sequence[str] = (),
) -> BulkResult:
    """Cancel every non-terminal run `runs` (and, if given, in `statuses`) matches, batch by
    batch (see the module doc). With `confirmed_at`, the runs the confirmed count was about
    (`unfinished_at`): those finished since are counted as skipped."""
    if confirmed_at is not None:
        selection = unfinished_at(runs, confirmed_at, statuses)
    else:
        selection = cancellable(runs.filter(status__in=statuses) if statuses else runs)
    result = BulkResult()
    for ids in matching_batches(selection):
        done, skipped = cancel_batch(ids, user, message)
        result.done += done
        result.skipped += skipped
        result.batches += 1
    return result


def retry_matching(
    runs: QuerySet[WorkflowRun],
    user: Any = None,
    message: str = "Retried (bulk)",
    *,
    confirmed_at: datetime | None = None,
) -> BulkResult:
    """Retry every failed or cancelled run `runs` matches, batch by batch; with `confirmed_at`,
    only runs started by then. A run no longer failed or cancelled when its batch locks it
    (retried by someone else meanwhile) is counted as skipped."""
    selection = retryable(runs)
    if confirmed_at is not None:
        selection = selection.filter(created_at__lte=confirmed_at)
    result = BulkResult()
    for ids in matching_batches(selection):
        done, refused, skipped = retry_batch(ids, user, message)
        result.done += done
        result.refused.extend(refused)
        result.skipped += skipped
        result.batches += 1
    return result


@retry_on_conflict
def cancel_batch(ids: Sequence[str], user: Any = None, message: str = "Cancelled (bulk)") -> tuple[int, int]:
    """Cancel these runs (the non-terminal ones) and their descendants in one transaction: how
    many of `ids` were cancelled (or set cancelling, with a step still executing), and how many
    had already finished when they were locked."""
    engine = get_engine()
    with transaction.atomic():
        locked = list(WorkflowRun.objects.select_for_update().filter(pk__in=ids))
        runs = [run for run in locked if run.status not in TERMINAL_RUN_STATUSES]
        in_batch = {run.pk for run in runs}
        outside = {run.parent_id for run in runs if run.parent_id and run.parent_id not in in_batch}
        live_parents = set(
            WorkflowRun.objects.filter(pk__in=outside, status__in=LIVE_PARENT_STATUSES).values_list("pk", flat=True)
        )
        for run in runs:
            if run.parent_id in live_parents:
                engine.cancel(run.pk)  # the parent's child call must settle and wake it
        _cancel_set(engine, [run.pk for run in runs if run.parent_id not in live_parents])
        record_operations(user, runs, message)
    return len(runs), len(locked) - len(runs)


def _cancel_set(engine: Any, ids: list[str]) -> None:
    """What `Engine.cancel` does per run, for a set of locked runs whose parents need no report:
    withdraw parked steps from their queues, settle every unsettled call as cancelled, finish
    each run (or leave it `cancelling` while a step executes), then the same for their children."""
    while ids:
        now = engine.now()
        unsettled = StepCheckpoint.objects.filter(run_id__in=ids).exclude(status__in=SETTLED_STEP_STATUSES)
        executing = unsettled.filter(kind=StepKind.STEP, status=StepStatus.DISPATCHED)
        busy = set(executing.values_list("run_id", flat=True))
        parked = unsettled.exclude(pk__in=executing.values("pk")).select_for_update()
        for queue, ticket_run, key in (
            parked.filter(kind=StepKind.STEP).exclude(queue="").values_list("queue", "run_id", "key")
        ):
            engine.release_settled(queue, StepCheckpoint(run_id=ticket_run, key=key).ticket)
        parked.update(
            status=StepStatus.CANCELLED, holds_slot=False, output=None, error=None, wake_at=None, finished_at=now
        )
        stamp = timezone.now()
        WorkflowRun.objects.filter(pk__in=busy).update(status=RunStatus.CANCELLING, wake_at=None, updated_at=stamp)
        finishing = WorkflowRun.objects.filter(pk__in=ids).exclude(pk__in=busy)
        for workflow, runs in finishing.order_by().values_list("workflow").annotate(n=Count("pk")):
            labels = {"workflow": workflow, "status": RunStatus.CANCELLED}
            metric_counts.count(metric_counts.RUNS_FINISHED, labels, runs)
        finishing.update(
            status=RunStatus.CANCELLED,
            output=None,
            error=CANCELLED_ERROR,
            wake_at=None,
            finished_at=now,
            updated_at=stamp,
        )
        ids = list(
            WorkflowRun.objects.select_for_update()
            .filter(parent_id__in=ids)
            .exclude(status__in=TERMINAL_RUN_STATUSES)
            .values_list("pk", flat=True)
        )


@retry_on_conflict
def retry_batch(ids: Sequence[str], user: Any = None, message: str = "Retried (bulk)") -> tuple[int, list[str], int]:
    """Retry these runs (the failed or cancelled ones) in one transaction: how many were
    retried, a reason for each refused (version changed, parent finished, ...), and how many
    were no longer failed or cancelled when they were locked."""
    engine = get_engine()
    refused: list[str] = []
    with transaction.atomic():
        locked = list(WorkflowRun.objects.select_for_update().filter(pk__in=ids))
        runs = [run for run in locked if run.status in RETRYABLE]
        parents = dict(
            WorkflowRun.objects.filter(pk__in={run.parent_id for run in runs if run.parent_id}).values_list(
                "pk", "status"
            )
        )
        ok: list[WorkflowRun] = []
        for run in runs:
            reason = _refusal(run, parents)
            if reason:
                refused.append(reason)
            else:
                ok.append(run)
        with_children = set(
            StepCheckpoint.objects.filter(
                run_id__in=[run.pk for run in ok],
                kind=StepKind.CHILD,
                status__in=(StepStatus.FAILED, StepStatus.CANCELLED),
            ).values_list("run_id", flat=True)
        )
        # A run under a start quota or a singleton must pass them again, each counting the runs
        # retried before it: the per-run path, like a run whose children are retried with it.
        per_run = with_children | {run.pk for run in ok if run.concurrency_key or run.start_key}
        done: list[WorkflowRun] = []
        for run in ok:
            if run.pk in per_run:
                try:
                    retry(run.pk)
                except ConcurrencyLimitError as exc:
                    refused.append(f"run {run.pk!r}: {exc}")
                    continue
                except DurableFlowError as exc:
                    refused.append(str(exc))
                    continue
            done.append(run)
        _reset_set(engine, [run.pk for run in done if run.pk not in per_run])
        record_operations(user, done, message)
    return len(done), refused, len(locked) - len(runs)


def _refusal(run: WorkflowRun, parent_status: dict[str, str]) -> str | None:
    """Why `operations.retry` would refuse this run, or None."""
    try:
        version = get_workflow(run.workflow).version
    except WorkflowNotFound as exc:
        return f"run {run.pk!r}: {exc}"
    if version != run.version:
        return f"run {run.pk!r} ran version {run.version!r} of {run.workflow!r}, now {version!r} (re-run it instead)"
    if run.parent_id and parent_status.get(run.parent_id) not in LIVE_PARENT_STATUSES:
        return f"run {run.pk!r} is a child of finished run {run.parent_id!r}; retry the parent"
    return None


def _reset_set(engine: Any, ids: list[str]) -> None:
    """What `operations.retry` does per run, for locked runs with no failed child calls, start
    quota or singleton: failed or cancelled steps wait for admission again with a new attempt
    budget, cancelled sleeps and signal waits start over, and each run is pending with one
    queued turn."""
    if not ids:
        return
    unsettled = StepCheckpoint.objects.filter(run_id__in=ids, status__in=(StepStatus.FAILED, StepStatus.CANCELLED))
    steps = unsettled.filter(kind=StepKind.STEP).select_for_update()
    by_name: dict[str, list[int]] = defaultdict(list)
    for pk, name in steps.values_list("pk", "name"):
        by_name[name].append(pk)
    operator_retried([pk for pks in by_name.values() for pk in pks], engine.now())
    for name, pks in by_name.items():
        StepCheckpoint.objects.filter(pk__in=pks).update(
            status=StepStatus.WAITING,
            holds_slot=False,
            wake_at=None,
            finished_at=None,
            max_attempts=F("attempt") + attempt_budget(name),
        )
    # As `operations.retry`: a cancelled sleep or signal wait starts over.
    unsettled.filter(kind__in=(StepKind.SLEEP, StepKind.SIGNAL), status=StepStatus.CANCELLED).delete()
    WorkflowRun.objects.filter(pk__in=ids).update(
        status=RunStatus.PENDING, output=None, error=None, finished_at=None, wake_at=None, updated_at=timezone.now()
    )
    engine.transport.enqueue_turns(ids)
