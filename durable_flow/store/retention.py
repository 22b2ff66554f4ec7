"""Retention: finished runs deleted once they are old enough, in small batches.

A run is *purgeable* when it is finished (`completed`, `failed` or `cancelled`) and finished
before its cutoff (now minus its workflow's `retention`, or `POLLER["RUN_RETENTION_S"]`), its
parent (if any) is finished too (a parent still running may read its child), and none of its
own children is unfinished. A purgeable run goes with everything that is only its own: its
checkpoints, step attempts, signals, any `db` transport task row left for it and the records of
what events did to it; an event goes with the last run it started, resumed or cancelled (one that
touched no run once `RUN_RETENTION_S` old); a finished child it had keeps its row, with no parent
(the model's `SET_NULL`).

Each batch is one short transaction: up to `batch_size` purgeable runs, oldest first, are found
by a read before it, then taken again by primary key inside it with the rule checked once more
(`FOR UPDATE SKIP LOCKED` on PostgreSQL, so a run an operator is retrying is skipped, and two
pollers never take the same runs), and the rows that name them are deleted, children first, by
run id with plain `DELETE` statements (no ORM collector loading the rows). A batch either commits
whole or not at all, so a purge killed at any point leaves no orphan rows, and the next purge
takes up where it stopped.

Kept on purpose: the admin's audit trail (`LogEntry`: who cancelled, retried or signalled a
run, and when), which outlives the run as the record of what people did; the dashboard's
samples and the refused starts, which have their own retention (`SAMPLE_RETENTION_S`,
`REFUSAL_RETENTION_S`); the Prometheus counters, which are totals.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from durable_flow.config.settings import DurableFlowSettings
from durable_flow.definitions.registry import workflows
from durable_flow.models import (
    TERMINAL_RUN_STATUSES,
    Event,
    EventDelivery,
    Signal,
    StepAttempt,
    StepCheckpoint,
    Task,
    WorkflowRun,
)
from durable_flow.store import metric_counts

#: The tables a purge deletes from, children first, each by its run column.
PURGED = (
    (EventDelivery, "run_id"),
    (StepAttempt, "run_id"),
    (StepCheckpoint, "run_id"),
    (Signal, "run_id"),
    (Task, "run_id"),
    (WorkflowRun, "id"),
)
#: Run ids per statement: well under SQLite's and PostgreSQL's parameter limits.
CHUNK = 500
#: The counter of purged runs (by workflow) and of purged rows (by table).
RUNS_PURGED = "durable_flow_runs_purged_total"
ROWS_PURGED = "durable_flow_rows_purged_total"


def table_label(model: type) -> str:
    """A purged table as the metrics and the dry run name it: `checkpoints`, `attempts`..."""
    return {
        EventDelivery: "event_deliveries",
        Event: "events",
        StepAttempt: "attempts",
        StepCheckpoint: "checkpoints",
        Signal: "signals",
        Task: "tasks",
        WorkflowRun: "runs",
    }[model]


@dataclass(frozen=True)
class Scope:
    """Runs finished before `cutoff`, of the workflows `only` names (all when None) but those
    `excluding` names."""

    cutoff: datetime
    only: frozenset[str] | None = None
    excluding: frozenset[str] = frozenset()

    def runs(self) -> QuerySet[WorkflowRun]:
        """The purgeable runs in scope (unordered)."""
        runs = purgeable(self.cutoff)
        if self.only is not None:
            runs = runs.filter(workflow__in=sorted(self.only))
        if self.excluding:
            runs = runs.exclude(workflow__in=sorted(self.excluding))
        return runs


@dataclass(frozen=True)
class RetentionPolicy:
    """How long finished runs are kept: `default` for every workflow (None: for ever), and the
    workflows that declare their own `retention`.

    `RetentionPolicy(timedelta(days=30), {"reports": timedelta(days=365)})` deletes runs of
    `reports` a year after they finished and every other workflow's after thirty days.
    """

    default: timedelta | None = None
    by_workflow: Mapping[str, timedelta] = field(default_factory=dict)

    @classmethod
    def configured(cls, settings: DurableFlowSettings) -> RetentionPolicy:
        """The policy of the settings and of the workflows registered in this process."""
        seconds = settings.run_retention_s
        own = {name: d.retention for name, d in workflows().items() if d.retention is not None}
        return cls(None if seconds is None else timedelta(seconds=seconds), own)

    @property
    def active(self) -> bool:
        return self.default is not None or bool(self.by_workflow)

    def scopes(self, now: datetime) -> list[Scope]:
        """One scope per workflow of its own retention, and one for every other workflow."""
        scopes = [Scope(now - kept, only=frozenset({name})) for name, kept in sorted(self.by_workflow.items())]
        if self.default is not None:
            scopes.append(Scope(now - self.default, excluding=frozenset(self.by_workflow)))
        return scopes


def purgeable(cutoff: datetime) -> QuerySet[WorkflowRun]:
    """Finished runs that finished before `cutoff` and may go (see the module's docstring).

    `created_at < cutoff` adds nothing to the rule (a run finishes after it is created) but lets
    the database walk the `created_at` index over old runs only, not every finished one."""
    finished = list(TERMINAL_RUN_STATUSES)
    unfinished_child = WorkflowRun.objects.filter(parent_id=OuterRef("pk")).exclude(status__in=finished)
    unfinished_parent = WorkflowRun.objects.filter(pk=OuterRef("parent_id")).exclude(status__in=finished)
    return (
        WorkflowRun.objects.filter(status__in=finished, created_at__lt=cutoff)
        .filter(Q(finished_at__lt=cutoff) | Q(finished_at__isnull=True, updated_at__lt=cutoff))
        .exclude(Exists(unfinished_parent))
        .exclude(Exists(unfinished_child))
    )


@dataclass
class Purged:
    """What purges deleted: rows per table (`runs`, `checkpoints`...) and runs per workflow;
    and how long their batches' transactions held their locks, the longest of them (seconds)."""

    rows: Counter[str] = field(default_factory=Counter)
    workflows: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    longest_transaction_s: float = 0.0

    @property
    def runs(self) -> int:
        return self.rows["runs"]

    def add(self, other: Purged) -> None:
        self.rows.update(other.rows)
        self.workflows.update(other.workflows)
        self.batches += other.batches
        self.longest_transaction_s = max(self.longest_transaction_s, other.longest_transaction_s)


def purge_batch(runs: QuerySet[WorkflowRun], batch_size: int) -> Purged:
    """Delete up to `batch_size` of `runs` (oldest first) and their rows, in one transaction.

    The runs are found first outside the transaction (a read: no lock held while the database
    walks the index), then taken again by primary key inside it, where the rule is checked
    once more (a run retried meanwhile is no longer finished and stays)."""
    done = Purged()
    found = list(runs.order_by("created_at").values_list("id", flat=True)[:batch_size])
    if not found:
        return done
    began = time.monotonic()
    with transaction.atomic():
        again = runs.filter(id__in=found)
        if connection.features.has_select_for_update_skip_locked:
            again = again.select_for_update(skip_locked=True)
        picked = list(again.values_list("id", "workflow"))
        if not picked:
            done.batches = 1  # all taken or changed meanwhile: the next batch looks again
            return done
        ids = [run_id for run_id, _ in picked]
        with connection.cursor() as cursor:
            q = connection.ops.quote_name
            for chunk in _chunks(ids):
                marks = ", ".join(["%s"] * len(chunk))
                # A finished child outliving its parent keeps its row, parentless (`SET_NULL`).
                cursor.execute(
                    f"UPDATE {q(WorkflowRun._meta.db_table)} SET {q('parent_id')} = NULL "
                    f"WHERE {q('parent_id')} IN ({marks})",
                    chunk,
                )
                events = list(
                    EventDelivery.objects.filter(run_id__in=chunk).values_list("event_id", flat=True).distinct()
                )
                for model, column in PURGED:
                    cursor.execute(f"DELETE FROM {q(model._meta.db_table)} WHERE {q(column)} IN ({marks})", chunk)
                    done.rows[table_label(model)] += max(cursor.rowcount, 0)
                # The events whose last run went with this chunk go with it.
                done.rows["events"] += _delete_events(events)
        done.workflows.update(workflow for _, workflow in picked)
        done.batches = 1
        for workflow, count in done.workflows.items():
            metric_counts.count(RUNS_PURGED, {"workflow": workflow}, count)
        for table, count in done.rows.items():
            if count:
                metric_counts.count(ROWS_PURGED, {"table": table}, count)
    done.longest_transaction_s = time.monotonic() - began
    return done


def _delete_events(ids: list[str]) -> int:
    """Delete those of the events `ids` that are delivered and name no run any more (a plain
    DELETE, as for the runs: the ORM's collector would load each one's deliveries first)."""
    q = connection.ops.quote_name
    events, deliveries = q(Event._meta.db_table), q(EventDelivery._meta.db_table)
    deleted = 0
    with connection.cursor() as cursor:
        for chunk in _chunks(ids):
            marks = ", ".join(["%s"] * len(chunk))
            cursor.execute(
                f"DELETE FROM {events} WHERE {q('id')} IN ({marks}) AND {q('pending')} = %s AND NOT EXISTS "
                f"(SELECT 1 FROM {deliveries} WHERE {deliveries}.{q('event_id')} = {events}.{q('id')})",
                [*chunk, False],
            )
            deleted += max(cursor.rowcount, 0)
    return deleted


def purge_events(cutoff: datetime, batch_size: int) -> int:
    """Delete up to `batch_size` events received before `cutoff` that touched no run (an event
    no workflow is triggered by, no wait and no `cancel_on` matched): one short transaction."""
    found = list(
        Event.objects.filter(received_at__lt=cutoff, pending=False)
        .exclude(Exists(EventDelivery.objects.filter(event_id=OuterRef("pk"))))
        .values_list("id", flat=True)[:batch_size]
    )
    if not found:
        return 0
    with transaction.atomic():
        deleted = _delete_events(found)
    if deleted:
        metric_counts.count(ROWS_PURGED, {"table": "events"}, deleted)
    return deleted


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(ids), CHUNK):
        yield ids[start : start + CHUNK]


def purge(
    scopes: list[Scope],
    batch_size: int,
    *,
    max_batches: int | None = None,
    max_seconds: float | None = None,
    after_batch: Callable[[Purged], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Purged:
    """Purge each scope in batches until it has none left, `max_batches` were taken in all, or
    the batch that reached `max_seconds` (by `clock`) since the first one began has ended.

    `after_batch` is called with each batch's figures once it committed (the command prints
    them and flushes the counters; a failure it raises stops the purge there, committed work
    kept)."""
    total = Purged()
    began = clock()
    for scope in scopes:
        runs = scope.runs()
        while max_batches is None or total.batches < max_batches:
            if max_seconds is not None and total.batches and clock() - began >= max_seconds:
                return total
            done = purge_batch(runs, batch_size)
            if not done.batches:
                break
            total.add(done)
            if after_batch is not None:
                after_batch(done)
            if done.runs < batch_size:
                break
    return total


def purge_pass(settings: DurableFlowSettings, now: datetime) -> Purged:
    """The poller's share: at most `PURGE_BATCHES` batches of `PURGE_BATCH_SIZE` runs under the
    configured policy (nothing when no retention is configured), and no new batch once
    `PURGE_PASS_S` has passed.

    The time bound is what keeps a purge from slowing the workload: the database's CPU is what
    they share, and a pass that stops after its time takes at most about `PURGE_PASS_S` in
    `MAINTENANCE_S` of it (a tenth, with the defaults), however slow a batch is. On a quiet
    database the batch bound comes first; on a busy one, whose batches take longer, the purge
    slows down with it."""
    policy = RetentionPolicy.configured(settings)
    if not policy.active:
        return Purged()
    done = purge(
        policy.scopes(now),
        settings.purge_batch_size,
        max_batches=settings.purge_batches,
        max_seconds=settings.purge_pass_s,
    )
    if policy.default is not None:
        done.rows["events"] += purge_events(now - policy.default, settings.purge_batch_size)
    return done


def dry_run(scopes: list[Scope]) -> dict[str, int]:
    """What a purge of `scopes` would delete now, rows per table (`runs`, `checkpoints`...)."""
    counts: Counter[str] = Counter()
    for scope in scopes:
        ids = scope.runs().values("id")
        for model, column in PURGED:
            lookup = "pk__in" if model is WorkflowRun else f"{column}__in"
            counts[table_label(model)] += model.objects.filter(**{lookup: ids}).count()
    return {table_label(model): counts[table_label(model)] for model, _ in PURGED}
