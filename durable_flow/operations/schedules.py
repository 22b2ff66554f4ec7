"""Pause and resume a schedule (`durable_flow.definitions.schedules`): the admin's and the
dashboard's actions, and the public `pause_schedule` / `resume_schedule`."""

from __future__ import annotations

from django.db import transaction

from durable_flow.config.limits import WORKFLOW_NAME_LENGTH
from durable_flow.config.validation import storable_text
from durable_flow.definitions.registry import scheduled_workflows
from durable_flow.definitions.schedules import ScheduleSpec, next_tick
from durable_flow.engine import get_engine
from durable_flow.exceptions import ScheduleNotFound
from durable_flow.models import Schedule
from durable_flow.store import schedules as store


def pause_schedule(workflow: str) -> Schedule:
    """Pause `workflow`'s schedule: no poller starts its ticks until it is resumed.
    `ScheduleNotFound` when none is stored under that name, `InvalidInput` for a name no
    workflow can have (not a string, too long, a NUL character)."""
    storable_text(workflow, "workflow", WORKFLOW_NAME_LENGTH)
    if not store.set_paused(workflow, True):
        raise ScheduleNotFound(f"no schedule is stored for workflow {workflow!r}")
    return Schedule.objects.get(pk=workflow)


def resume_schedule(workflow: str) -> Schedule:
    """Resume `workflow`'s schedule at its next tick from now: the ticks that fell while it was
    paused are not caught up (a pause is a decision, not an outage). Refuses what
    `pause_schedule` refuses."""
    storable_text(workflow, "workflow", WORKFLOW_NAME_LENGTH)
    with transaction.atomic():
        row = Schedule.objects.select_for_update().filter(pk=workflow).first()
        if row is None:
            raise ScheduleNotFound(f"no schedule is stored for workflow {workflow!r}")
        declared = scheduled_workflows().get(workflow)
        spec = declared.schedule if declared is not None else None
        spec = spec or ScheduleSpec(cron=row.cron, timezone=row.timezone)
        store.set_paused(workflow, False, next_tick(spec, get_engine().now()))
    return Schedule.objects.get(pk=workflow)
