"""The poller's schedule duty: start each declared schedule's due ticks, once across the fleet.

Each pass reads every declared schedule's row (`durable_flow.models.Schedule`), asks
`durable_flow.definitions.schedules.due_ticks` which ticks to run under the schedule's catch-up
policy, and in one transaction claims them (a compare-and-set on `next_tick_at`,
`durable_flow.store.schedules.claim`) and starts one run per tick through `Engine.start`, the
path of every start: the workflow's start quota, debounce and singleton apply. A tick's run id
is deterministic (`tick_run_id`), so even a start repeated by hand is the same run.

A start its quota refuses is recorded as a refusal (as any refused start is) and the tick is
spent: it is not retried on every pass while the quota stays full.

Each tick is counted in `durable_flow_schedule_ticks_total{workflow, outcome}` with the
transaction that claimed it: `started`, `gated`, `refused` or `invalid` for a tick whose start
was tried, `skipped` for a missed tick its catch-up policy dropped (at most `MAX_CATCH_UP` a
pass are counted, as at most that many are looked at).
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction

from durable_flow.definitions.registry import WorkflowDefinition, scheduled_workflows
from durable_flow.definitions.schedules import ScheduleSpec, due_count, due_ticks, next_tick, tick_run_id
from durable_flow.engine import Engine, retry_on_conflict
from durable_flow.exceptions import ConcurrencyLimitError, InvalidInput
from durable_flow.models import Schedule, ScheduleOutcome
from durable_flow.store import metric_counts
from durable_flow.store import schedules as store

logger = logging.getLogger("durable_flow.runtime.schedules")


class ScheduleTicker:
    """Starts due schedule ticks; any number of pollers may run one each."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def tick(self) -> list[str]:
        """Start every declared schedule's due ticks; return the ids of the runs started
        (or gated) by this pass."""
        declared = scheduled_workflows()
        if not declared:
            return []
        now = self.engine.now()
        stored = store.rows(declared)
        run_ids: list[str] = []
        for name, definition in declared.items():
            spec = definition.schedule
            assert spec is not None  # scheduled_workflows() holds only scheduled ones
            row = stored.get(name)
            if row is None:
                store.create(name, spec.cron, spec.timezone, next_tick(spec, now))
            elif (row.cron, row.timezone) != (spec.cron, spec.timezone):
                store.redeclare(row, spec.cron, spec.timezone, next_tick(spec, now))
            elif not row.paused:
                run_ids.extend(self._start_due(definition, spec, row, now))
        return run_ids

    @retry_on_conflict
    def _start_due(self, definition: WorkflowDefinition, spec: ScheduleSpec, row: Schedule, now: datetime) -> list[str]:
        ticks, following = due_ticks(spec, row.next_tick_at, now)
        if following == row.next_tick_at:
            return []  # not due yet
        run_ids: list[str] = []
        with transaction.atomic():
            if not store.claim(row, following, ticks[-1] if ticks else None):
                return []  # another poller started these ticks
            if not ticks:
                store.record(definition.name, "", ScheduleOutcome.SKIPPED)
            dropped = due_count(spec, row.next_tick_at, now) - len(ticks)
            if dropped > 0:
                count_ticks(definition.name, ScheduleOutcome.SKIPPED, dropped)
            for tick in ticks:
                run_id = tick_run_id(definition.name, tick)
                outcome = self._start(definition, spec, run_id)
                store.record(definition.name, run_id, outcome, tick)
                count_ticks(definition.name, outcome)
                if outcome in (ScheduleOutcome.STARTED, ScheduleOutcome.GATED):
                    run_ids.append(run_id)
        return run_ids

    def _start(self, definition: WorkflowDefinition, spec: ScheduleSpec, run_id: str) -> str:
        """Start one tick's run; what it came to (`ScheduleOutcome`)."""
        try:
            run = self.engine.start(definition, spec.input, run_id=run_id)
        except ConcurrencyLimitError:
            # Recorded by the start (`store.quotas.record_refusal`); the tick is spent.
            logger.info("schedule %r: tick %s refused by its start quota", definition.name, run_id)
            return ScheduleOutcome.REFUSED
        except InvalidInput:
            # A start key or input the engine refuses would be refused at every tick alike.
            logger.exception("schedule %r: tick %s could not start", definition.name, run_id)
            return ScheduleOutcome.INVALID
        return ScheduleOutcome.GATED if getattr(run, "start_outcome", None) else ScheduleOutcome.STARTED


def count_ticks(workflow: str, outcome: str, ticks: int = 1) -> None:
    """Count `ticks` of `workflow`'s schedule under `outcome`, once the pass's transaction commits."""
    metric_counts.count(metric_counts.SCHEDULE_TICKS, {"workflow": workflow, "outcome": outcome}, ticks)
