"""The run list's rows; its filters are `durable_flow.operations.run_filters` (shared with the JSON API's
bulk endpoints, so "the runs this filter matches" means one thing everywhere)."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from durable_flow.models import WorkflowRun
from durable_flow.operations.run_filters import RANGES, RunFilterForm, filtered_runs

__all__ = ["PAGE_SIZE", "RANGES", "RunFilterForm", "filtered_runs", "run_row", "workflow_names"]

PAGE_SIZE = 50


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
    return sorted(WorkflowRun.objects.order_by().values_list("workflow", flat=True).distinct())
