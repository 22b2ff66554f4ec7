"""The schedules' read model: each stored schedule with its next and last ticks, for the
dashboard's schedules page, the admin, the JSON API and the metrics."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from durable_flow.definitions.registry import WorkflowDefinition, scheduled_workflows
from durable_flow.definitions.schedules import CATCH_UP_POLICIES, tick_run_id
from durable_flow.models import Schedule, ScheduleOutcome

__all__ = ["CATCH_UP_POLICIES", "ScheduleView", "schedule", "schedules"]


@dataclass(frozen=True)
class ScheduleView:
    """One schedule as a page shows it. `declared` is False for a row whose workflow no longer
    declares a schedule (or is gone): no poller starts it, and it is listed so it can be seen.
    `catch_up` and `max_catch_up` are the declaration's ("" and None for such a row).
    `last_outcome` and `last_refusal` are `ScheduleOutcome` values ("" for none yet)."""

    workflow: str
    cron: str
    timezone: str
    catch_up: str
    max_catch_up: int | None
    next_tick_at: datetime
    last_tick_at: datetime | None
    last_run_id: str
    last_outcome: str
    last_refused_tick_at: datetime | None
    last_refusal: str
    paused: bool
    declared: bool

    @property
    def last_outcome_label(self) -> str:
        """What the last tick came to, in words ("gated by debounce or singleton")."""
        return ScheduleOutcome(self.last_outcome).label if self.last_outcome else ""

    @property
    def last_refused_run_id(self) -> str:
        """The run id the last refused tick would have had ("" when none was refused)."""
        return tick_run_id(self.workflow, self.last_refused_tick_at) if self.last_refused_tick_at else ""

    def lag_s(self, now: datetime) -> float | None:
        """How long the next tick is overdue at `now` (0 before it is due): it grows while no
        poller runs. None for a schedule no poller starts (paused, or no longer declared)."""
        if self.paused or not self.declared:
            return None
        return max(0.0, (now - self.next_tick_at).total_seconds())


def schedules() -> list[ScheduleView]:
    """Every stored schedule, by workflow name. A declared schedule no poller has seen yet has
    no row and is not listed."""
    declared = scheduled_workflows()
    return [_view(row, declared.get(row.workflow)) for row in Schedule.objects.order_by("workflow")]


def schedule(workflow: str) -> ScheduleView | None:
    """The stored schedule of `workflow`, or None."""
    row = Schedule.objects.filter(pk=workflow).first()
    return None if row is None else _view(row, scheduled_workflows().get(workflow))


def _view(row: Schedule, definition: WorkflowDefinition | None) -> ScheduleView:
    spec = definition.schedule if definition is not None else None
    return ScheduleView(
        workflow=row.workflow,
        cron=row.cron,
        timezone=row.timezone,
        catch_up=spec.catch_up if spec is not None else "",
        max_catch_up=spec.max_catch_up if spec is not None else None,
        next_tick_at=row.next_tick_at,
        last_tick_at=row.last_tick_at,
        last_run_id=row.last_run_id,
        last_outcome=row.last_outcome,
        last_refused_tick_at=row.last_refused_tick_at,
        last_refusal=row.last_refusal,
        paused=row.paused,
        declared=spec is not None and (spec.cron, spec.timezone) == (row.cron, row.timezone),
    )
