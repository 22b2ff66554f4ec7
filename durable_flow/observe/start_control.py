"""Debounce and singleton as the dashboard shows them: each declaring workflow's settings, the
runs waiting out a debounce now, and the starts debounced, skipped and replaced so far."""

from __future__ import annotations

from typing import Any

from durable_flow.definitions.keys import describe_key
from durable_flow.definitions.registry import workflows
from durable_flow.definitions.start_control import OUTCOMES, DebounceSpec
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.store.counters import start_outcomes


def usage() -> list[dict[str, Any]]:
    """Per workflow declaring debounce or singleton: its settings, the runs waiting out a debounce
    now, and the starts debounced, skipped and replaced so far (the dashboard's overview)."""
    from django.db.models import Count

    declared = {name: d.start_control for name, d in workflows().items() if d.start_control is not None}
    counts = start_outcomes()
    if not declared and not counts:
        return []
    waiting = dict(
        WorkflowRun.objects.filter(status=RunStatus.DEBOUNCED, workflow__in=list(declared))
        .values("workflow")
        .annotate(n=Count("id"))
        .values_list("workflow", "n")
    )
    rows = []
    for name, control in sorted(declared.items()):
        if isinstance(control, DebounceSpec):
            rule = f"debounce {control.period.total_seconds():g} s"
            if control.max_wait is not None:
                rule += f", max wait {control.max_wait.total_seconds():g} s"
        else:
            rule = f"singleton, {control.mode}"
        rows.append(
            {
                "workflow": name,
                "rule": rule,
                "key": describe_key(control.key),
                "debouncing": waiting.get(name, 0),
                **{outcome: counts.get((name, outcome), 0) for outcome in OUTCOMES},
            }
        )
    # Tasks (`tasks.debounce`/`tasks.singleton`) are declared on functions no registry lists:
    # they show once they have counted a start.
    for label in sorted({label for label, _ in counts} - set(declared)):
        outcomes = {outcome: counts.get((label, outcome), 0) for outcome in OUTCOMES}
        rows.append({"workflow": label, "rule": "task", "key": "", "debouncing": None, **outcomes})
    return rows


def outcome_counts() -> list[tuple[str, str, int]]:
    """`(workflow, outcome, starts)` for every start debounced, skipped or replaced so far,
    sorted (the metrics' counter; a task counts under its label)."""
    return sorted((workflow, outcome, n) for (workflow, outcome), n in start_outcomes().items())
