"""Every statement on the `Schedule` rows: create, claim a tick, record its outcome, pause.

A tick is claimed by a compare-and-set on `next_tick_at` (an UPDATE filtered on the value the
poller read). On PostgreSQL a second poller's UPDATE waits for the first one's row lock, then
finds the value changed and updates nothing; on SQLite the write transaction serialises them.
The caller starts the tick's runs in the claiming transaction, so a tick is started once or,
if that transaction rolls back, not at all and claimed again on the next pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from durable_flow.models import Schedule, ScheduleOutcome


def rows(workflows: Iterable[str]) -> dict[str, Schedule]:
    """The stored rows of these schedules, by workflow."""
    return {row.workflow: row for row in Schedule.objects.filter(workflow__in=list(workflows))}


def create(workflow: str, cron: str, timezone: str, next_tick_at: datetime) -> None:
    """Store a newly declared schedule (a row another poller created first is kept)."""
    Schedule.objects.bulk_create(
        [Schedule(workflow=workflow, cron=cron, timezone=timezone, next_tick_at=next_tick_at)], ignore_conflicts=True
    )


def redeclare(row: Schedule, cron: str, timezone: str, next_tick_at: datetime) -> bool:
    """A changed declaration: its ticks start over from `next_tick_at`, unless another poller
    moved the row meanwhile. Returns whether this call changed it."""
    changed = Schedule.objects.filter(workflow=row.workflow, cron=row.cron, timezone=row.timezone).update(
        cron=cron, timezone=timezone, next_tick_at=next_tick_at
    )
    return bool(changed)


def claim(row: Schedule, next_tick_at: datetime, last_tick_at: datetime | None) -> bool:
    """Move `row`'s next tick from the value read to `next_tick_at`, if it still holds that
    value and is not paused. Whether this call claimed the ticks in between; the caller's
    transaction must start them."""
    changed = Schedule.objects.filter(workflow=row.workflow, next_tick_at=row.next_tick_at, paused=False).update(
        next_tick_at=next_tick_at, **({"last_tick_at": last_tick_at} if last_tick_at is not None else {})
    )
    return bool(changed)


#: The outcomes that are a refused start, kept as the schedule's last refusal.
REFUSALS = (ScheduleOutcome.REFUSED, ScheduleOutcome.INVALID)


def record(workflow: str, run_id: str, outcome: str, tick: datetime | None = None) -> None:
    """The last tick's run and what its start came to; a refused one (`REFUSALS`) is also kept
    as the last refusal, with its `tick`, until another tick is refused."""
    fields: dict[str, object] = {"last_run_id": run_id, "last_outcome": outcome}
    if outcome in REFUSALS:
        fields.update(last_refused_tick_at=tick, last_refusal=outcome)
    Schedule.objects.filter(workflow=workflow).update(**fields)


def set_paused(workflow: str, paused: bool, next_tick_at: datetime | None = None) -> bool:
    """Pause or resume a schedule; resuming sets the next tick (`next_tick_at`), so the ticks
    of the pause are not caught up. Whether the schedule exists."""
    fields: dict[str, object] = {"paused": paused}
    if next_tick_at is not None:
        fields["next_tick_at"] = next_tick_at
    return bool(Schedule.objects.filter(workflow=workflow).update(**fields))
