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
from durable_flow.models import RunStatus, Signal, StepAttempt, StepCheckpoint, WorkflowRun, dead_worker_cutoff
from durable_flow.observe.timeline import MAX_ROWS, build_timeline
from durable_flow.observe.waits import awaited_signals, current_waits, when
from durable_flow.store import queries

#: Children and signals a run's page lists at most.
DETAIL_ROWS = 100


def run_row(run: WorkflowRun) -> dict[str, Any]:
    """What one line of the run list shows."""
    end = run.finished_at or timezone.now()
    error = run.error or {}
    return {
        "run": run,
        "duration_s": max((end - run.created_at).total_seconds(), 0.0),
        "error": (error.get("message") or "")[:160] if isinstance(error, dict) else str(error)[:160],
        "error_type": error.get("type", "").rsplit(".", 1)[-1] if isinstance(error, dict) else "",
    }


def workflow_names() -> list[str]:
    """Every workflow that has runs, sorted: the run list's workflow filter."""
    return sorted(WorkflowRun.objects.order_by().values_list("workflow", flat=True).distinct())


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


def run_counts() -> dict[str, int]:
    """Runs per status, every status present (0 where there are none)."""
    counts = dict(WorkflowRun.objects.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    return {status: counts.get(status, 0) for status in RunStatus.values}


def counts_by_workflow() -> Iterable[tuple[str, str, int]]:
    """`(workflow, status, runs)` for every pair that has runs (the metrics' run gauge)."""
    return WorkflowRun.objects.values_list("workflow", "status").annotate(n=Count("id")).order_by()
