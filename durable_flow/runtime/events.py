"""An event's delivery: the runs it starts (triggers), resumes (waits) and cancels (`cancel_on`).

`send_event` records the event (`Event`, pending) in its caller's transaction and delivers it
right after that transaction commits, in the sender's process; the poller delivers what a
process that died left pending (`EventDeliverer.sweep`). A delivery is a series of short
transactions, never one long one, each of which can be repeated:

1. **Starts.** One transaction per triggered workflow, in name order: it locks the event's row
   (a second deliverer skips it: `store.events.lock_pending`), goes on only if the workflow has
   no start row yet, starts the run through `Engine.start` (the path of every start: the
   workflow's quota, debounce and singleton apply) under a deterministic run id
   (`triggered_run_id`) and writes the start row (`EventDelivery`). The run and its row commit
   together, so a delivery killed half-way and finished by the poller starts each run once.
   A start the quota refuses is recorded as refused (as a schedule's tick is) and not retried.
2. **Waits.** The waits for the event's name that began by the event's `received_at`, read
   under the name's lock (`store.events`), each resumed in its own transaction if its `match`
   holds and it still waits.
3. **Cancels.** The runs in progress of the workflows that declare `cancel_on` for the name
   (but those this very event started), cancelled if the `match` holds.
4. The event is marked delivered.

Steps 2 and 3 change only what still waits or runs, so a delivery repeated after a crash (or
run by two processes at once) resumes and cancels nothing twice.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import transaction

from durable_flow.definitions.events import Condition, compile_condition, payload, triggered_run_id
from durable_flow.definitions.registry import WorkflowDefinition, cancelled_by, triggered_by
from durable_flow.engine import Engine, get_engine, retry_on_conflict
from durable_flow.exceptions import ConcurrencyLimitError, InvalidInput
from durable_flow.models import TERMINAL_RUN_STATUSES, Event, EventAction, WorkflowRun
from durable_flow.store import events as store
from durable_flow.store import metric_counts

logger = logging.getLogger("durable_flow.runtime.events")

#: How long an event may stay pending before the poller delivers it: its sender delivers it
#: within moments of its commit, unless the sender's process died.
SWEEP_AFTER = timedelta(seconds=5)
#: The most pending events one poller pass delivers.
SWEEP_BATCH = 100


class EventDeliverer:
    """Delivers recorded events to runs; any number of processes may deliver at once."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine or get_engine()

    def deliver(self, event_id: str) -> bool:
        """Deliver the event (or finish a delivery left half-way). False when it is delivered
        already or another process holds it at this moment (that one finishes it)."""
        event = Event.objects.filter(pk=event_id, pending=True).first()
        if event is None:
            return False
        incoming = payload(event.name, event.data, event.id, event.received_at)
        for definition in triggered_by(event.name):
            if not self._start(event.id, definition, incoming):
                return False  # another deliverer holds the event now: it goes on from here
        self._resume_waits(event, incoming)
        self._cancel(event, incoming)
        store.finish(event.id, self.engine.now())
        return True

    def sweep(self) -> int:
        """Deliver the events a dead process left pending (the poller's pass). How many."""
        cutoff = self.engine.now() - SWEEP_AFTER
        return sum(self.deliver(event_id) for event_id in store.pending_before(cutoff, SWEEP_BATCH))

    @retry_on_conflict
    def _start(self, event_id: str, definition: WorkflowDefinition, incoming: dict[str, Any]) -> bool:
        """Start `definition`'s run for the event, once; False when the event's row is held
        by another deliverer (or delivered meanwhile)."""
        with transaction.atomic():
            if store.lock_pending(event_id) is None:
                return False
            if definition.name in store.started_workflows(event_id):
                return True  # started by an earlier delivery
            condition = definition.triggers[0].condition if definition.triggers else None
            if condition is not None and not condition.holds(event=incoming):
                return True  # `trigger_if` does not hold: nothing to record
            run_id = triggered_run_id(definition.name, event_id)
            action, started = self._start_run(definition, incoming, run_id)
            store.record_delivery(event_id, action, definition.name, started)
            metric_counts.count(metric_counts.EVENT_STARTS, {"workflow": definition.name, "action": action})
        return True

    def _start_run(self, definition: WorkflowDefinition, incoming: dict[str, Any], run_id: str) -> tuple[str, str]:
        """The action a trigger's start came to, and the run it concerns."""
        try:
            run = self.engine.start(definition, incoming, run_id=run_id)
        except ConcurrencyLimitError:
            # Recorded by the start (`store.quotas.record_refusal`); not retried.
            logger.info("event %s: start of %r refused by its start quota", incoming["id"], definition.name)
            return EventAction.REFUSED, run_id
        except InvalidInput:
            logger.exception("event %s: start of %r is invalid", incoming["id"], definition.name)
            return EventAction.INVALID, run_id
        gated = getattr(run, "start_outcome", None) or run.id != run_id
        return (EventAction.GATED if gated else EventAction.STARTED), run.id

    def _resume_waits(self, event: Event, incoming: dict[str, Any]) -> None:
        with transaction.atomic():
            store.lock_name(event.name)  # see `store.events`: the look-backs of new waits
            page = store.waits_for(event.name, event.received_at)
        while page:
            for _, run_id, key, match, run_input in page:
                if _holds(match, run_input, incoming):
                    self.engine.deliver_event(run_id, key, incoming)
            page = store.waits_for(event.name, event.received_at, after=page[-1][0])

    def _cancel(self, event: Event, incoming: dict[str, Any]) -> None:
        for definition in cancelled_by(event.name):
            specs = [spec for spec in definition.cancel_on if spec.event == event.name]
            own = triggered_run_id(definition.name, event.id)
            for run_id, run_input in _in_progress(definition.name):
                if run_id == own:
                    continue
                if any(spec.match is None or spec.match.holds(event=run_input, incoming=incoming) for spec in specs):
                    run = self.engine.cancel(run_id)
                    if run.status in (*TERMINAL_RUN_STATUSES, "cancelling"):
                        store.record_delivery(event.id, EventAction.CANCELLED, definition.name, run_id)


def _holds(match: str | None, run_input: Any, incoming: dict[str, Any]) -> bool:
    if match is None:
        return True
    try:
        condition: Condition = compile_condition(match)
    except ValueError:
        return False  # compiled when the wait began; a process without the same bindings refuses it
    return condition.holds(event=run_input, incoming=incoming)


def _in_progress(workflow: str) -> list[tuple[str, Any]]:
    """The runs of `workflow` in progress (through the `(workflow, status)` index): (id, input)."""
    return list(
        WorkflowRun.objects.filter(workflow=workflow)
        .exclude(status__in=TERMINAL_RUN_STATUSES)
        .values_list("id", "input")
    )
