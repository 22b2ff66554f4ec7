"""The schedules' read model: each stored schedule with its next and last ticks, for the
dashboard's schedules page and the admin."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from durable_flow.definitions.registry import scheduled_workflows
from durable_flow.models import Schedule


@dataclass(frozen=True)
class ScheduleView:
    """One schedule as a page shows it. `declared` is False for a row whose workflow no longer
    declares a schedule (or is gone): no poller starts it, and it is listed so it can be seen."""

    workflow: str
    cron: str
    timezone: str
    catch_up: str
    next_tick_at: datetime
    last_tick_at: datetime | None
    last_run_id: str
    last_outcome: str
    paused: bool
    declared: bool


def schedules() -> list[ScheduleView]:
    """Every stored schedule, by workflow name. A declared schedule no poller has seen yet has
    no row and is not listed."""
    declared = scheduled_workflows()
    views = []
    for row in Schedule.objects.order_by("workflow"):
        definition = declared.get(row.workflow)
        spec = definition.schedule if definition is not None else None
        views.append(
            ScheduleView(
                workflow=row.workflow,
                cron=row.cron,
                timezone=row.timezone,
                catch_up=spec.catch_up if spec is not None else "",
                next_tick_at=row.next_tick_at,
                last_tick_at=row.last_tick_at,
                last_run_id=row.last_run_id,
                last_outcome=row.get_last_outcome_display() if row.last_outcome else "",
                paused=row.paused,
                declared=spec is not None and (spec.cron, spec.timezone) == (row.cron, row.timezone),
            )
        )
    return views
