"""Runs as the pages read them: a line of the run list, the workflow names to filter by, a run's
page (its timeline, failed attempts, children, signals, and what live workers execute for it
now) and the run counts the overview and the metrics show. Which runs a filter matches is
`run_filters`."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db.models import Count
from django.utils import timezone

from durable_flow.config.settings import get_settings
from durable_flow.definitions.registry import workflows as registered_workflows
from durable_flow.models import (
    TERMINAL_RUN_STATUSES,
    RunStatus,
    Signal,
    StepAttempt,
    StepCheckpoint,
    WorkflowRun,
    dead_worker_cutoff,
)
from durable_flow.observe.timeline import MAX_ROWS, build_timeline
from durable_flow.observe.waits import awaited_signals, current_waits, when
from durable_flow.store import queries

#: Children and signals a run's page lists at most.
DETAIL_ROWS = 100


def run_row(run: WorkflowRun) -> dict[str, Any]:
    """What one line of the run list shows. A finished run's duration (`duration_s`); an
    unfinished one's runs to now, so the line gives its start instead (`since_ms`, ms since
    the epoch) for the page to count from: the line stays the same while the run does."""
    error = run.error or {}
    finished = run.finished_at
    return {
        "run": run,
        "duration_s": max((finished - run.created_at).total_seconds(), 0.0) if finished else None,
        "since_ms": None if finished else int(run.created_at.timestamp() * 1000),
        "error": (error.get("message") or "")[:160] if isinstance(error, dict) else str(error)[:160],
        "error_type": error.get("type", "").rsplit(".", 1)[-1] if isinstance(error, dict) else "",
    }


def workflow_names() -> list[str]:
    """Every registered workflow, sorted: the run lists' workflow filter (from the registry,
    not a `DISTINCT` over every run)."""
    return sorted(registered_workflows())


def executing_now(run_id: str, now: datetime | None = None) -> list[str]:
    """What live workers' heartbeats say is executing for the run now, one line a step attempt,
    saying when the run's rows do not show it yet: the one place that shows an optimistic first
    step (the admin's and the dashboard's run page)."""
    steps = queries.running_steps(dead_worker_cutoff(get_settings().heartbeat_ttl_s, now), run_id)
    checkpoints = StepCheckpoint.objects.filter(run_id=run_id, key__in={s.key for s in steps})
    recorded = {(key, str(attempt)) for key, attempt in checkpoints.values_list("key", "attempt")}
    return [
        f"step {s.key}, attempt {s.attempt}, on worker {s.worker}"
        + ("" if (s.key, s.attempt) in recorded else " (not recorded yet: the run's rows show it once it returns)")
        for s in steps
    ]


def run_detail(run: WorkflowRun, now: datetime | None = None) -> dict[str, Any]:
    """A run's page: its timeline, the attempts that failed (with their errors), its children
    and signals, what is executing for it now, what its calls wait for and why (`waits`), the
    signal names it waits for, and when it wakes (with the date when not today)."""
    now = now or timezone.now()
    executing = executing_now(run.pk, now)
    unsettled = list(StepCheckpoint.objects.filter(run=run, finished_at__isnull=True).order_by("sequence")[:MAX_ROWS])
    attempts = (
        StepAttempt.objects.filter(run=run).select_related("checkpoint").order_by("checkpoint__sequence", "attempt")
    )
    timeline = build_timeline(run, now=now, executing=bool(executing))
    labels = {(row.key, row.attempt): row.attempt_label for row in timeline.rows if row.attempt}
    failed = [a for a in attempts if a.error]
    for a in failed:
        a.label = labels.get((a.checkpoint.key, a.attempt), f"attempt {a.attempt}")  # type: ignore[attr-defined]
    return {
        "timeline": timeline,
        "executing": executing,
        "failed_attempts": failed,
        "children": run.children.order_by("created_at")[:DETAIL_ROWS],
        "signals": Signal.objects.filter(run=run).order_by("id")[:DETAIL_ROWS],
        "waits": current_waits(run, unsettled, now),
        "awaited_signals": [] if run.is_terminal else awaited_signals(unsettled),
        "wakes_at": when(run.wake_at, now) if run.wake_at and not run.is_terminal else "",
        "finished_at": when(run.finished_at, now) if run.finished_at else "",
    }


#: The statuses of runs not finished: the ones the pages and the metrics count. A finished
#: status is never counted by reading the runs (a long history would make every count a scan of
#: it); finished totals are counters.
LIVE_RUN_STATUSES = tuple(status for status in RunStatus.values if status not in TERMINAL_RUN_STATUSES)


#: Runs a status's count on the pages reads at most: past it, the count says "at least" (the
#: overview shows `10000+`), so a backlog of 100,000 runs costs a live tick what 10,000 do.
RUN_COUNT_CAP = 10_000


def run_counts(cap: int = RUN_COUNT_CAP) -> dict[str, int]:
    """Runs per live status (`LIVE_RUN_STATUSES`), each present (0 where there are none),
    counted up to `cap` each (a count equal to the cap means at least that many): index-only
    reads of the `(status, wake_at)` index, whatever the history holds."""
    return {
        status: WorkflowRun.objects.filter(status=status).order_by().values("status")[:cap].count()
        for status in LIVE_RUN_STATUSES
    }


def counts_by_workflow() -> Iterable[tuple[str, str, int]]:
    """`(workflow, status, runs)` for every registered workflow and live status that has runs
    (the metrics' run gauge; finished runs are counters): exact, an index-only read of the
    `(workflow, status)` index over the live runs alone."""
    live = WorkflowRun.objects.filter(workflow__in=list(registered_workflows()), status__in=LIVE_RUN_STATUSES)
    return live.values_list("workflow", "status").annotate(n=Count("*")).order_by()
