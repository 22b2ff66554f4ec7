"""Dispatch: build a step call's checkpoint and send a new attempt of it out, to the transport
or (inline) to the worker thread that dispatched it; re-send a run's in-flight steps.

Admission is decided before this (`admit`), so sending an attempt needs no other part: the
grants (`handoff`) and the turns dispatch through it alike.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from copy import copy
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction

from durable_flow.definitions.registry import StepDefinition, get_step
from durable_flow.definitions.serialization import ensure_json
from durable_flow.engine import inline_handoff
from durable_flow.engine.base import Clock, TaskQueue
from durable_flow.engine.locking import locked_run, retry_on_conflict
from durable_flow.engine.turn import StepOptions
from durable_flow.exceptions import RunNotFound, StepNotFound
from durable_flow.models import ADMISSION_CAUSES, RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.store import metric_counts
from durable_flow.store.attempts import attempt_started
from durable_flow.store.counters import count_admission
from durable_flow.store.queries import AttemptStart, attempt_starts
from durable_flow.store.statements import insert, save_fields

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.config.settings import DurableFlowSettings

logger = logging.getLogger("durable_flow.engine")


class Dispatcher:
    """Checkpoints of step calls, and new attempts sent out."""

    def __init__(
        self, settings: DurableFlowSettings, admission: AdmissionBackend, transport: TaskQueue, clock: Clock
    ) -> None:
        """`admission` adopts the slot of an attempt started inline (`_started_inline`)."""
        self.settings = settings
        self.admission = admission
        self.transport = transport
        self.clock = clock

    def create_checkpoint(self, run: WorkflowRun, **fields: Any) -> StepCheckpoint:
        """Write a checkpoint for a call that needs no admission (sleep, signal, child)."""
        return StepCheckpoint.objects.create(run=run, **fields)

    def create_step_checkpoint(
        self,
        run: WorkflowRun,
        *,
        key: str,
        sequence: int,
        step: StepDefinition[Any],
        input: Any,
        options: StepOptions,
        group: str,
    ) -> StepCheckpoint:
        """Build (unsaved) the checkpoint of a step call."""
        ensure_json(input, f"input of step {step.name!r}", self.settings.max_payload_bytes)
        retries = step.retries if options.retries is None else options.retries
        # Not saved yet: admission decides whether it is written as dispatched or as waiting,
        # so a step that goes straight out costs one INSERT.
        return StepCheckpoint(
            run=run,
            key=key,
            sequence=sequence,
            kind=StepKind.STEP,
            name=step.name,
            status=StepStatus.WAITING,
            input=input,
            max_attempts=retries + 1,
            queue=options.queue,
            priority=options.priority,
            fairness_key=options.fairness_key,
            group=group,
            timeout_s=options.timeout.total_seconds() if options.timeout else None,
        )

    def step_timeout(self, cp: StepCheckpoint) -> float | None:
        """Seconds an attempt may run before it is re-dispatched, or None for no limit."""
        if cp.timeout_s is not None:  # set at creation from ctx.step(timeout=...)
            return cp.timeout_s
        try:
            definition = get_step(cp.name)
        except StepNotFound:
            return None
        return definition.timeout.total_seconds() if definition.timeout else None

    def dispatch(
        self, cp: StepCheckpoint, *, timeout_redispatch: bool = False, inline_to: str = "", from_turn: bool = False
    ) -> None:
        """Send a new attempt of the step to the transport (inside the turn's transaction), or
        with `inline_to`, to that worker's current thread once this transaction commits
        (`inline_handoff`: the attempt is stamped with the worker, so a crash re-drives it).
        `from_turn`: a call a turn just admitted, handed to the turn's thread if it accepts one."""
        if from_turn and not inline_to:
            inline_to = inline_handoff.taker(turn=True)
        now = self.clock()
        # A later attempt asked for its slot when its backoff ended (None when that is not known:
        # a retry an operator asked for, a slot lost in flight); a first one, when it was created.
        backoff_end = cp.wake_at if cp.attempt and cp.status in (StepStatus.RETRYING, StepStatus.WAITING) else None
        cp.attempt += 1
        if timeout_redispatch:
            # A timed-out attempt is retried in place: it keeps its slot and its attempt budget.
            cp.max_attempts += 1
        cp.status = StepStatus.DISPATCHED
        cp.dispatched_at = now
        cp.worker = inline_to
        # Admitted: no longer waiting. The detail of a queue wait stays, for this attempt's
        # history row (`attempt_started` copies it); any other wait's is dropped.
        if timeout_redispatch or cp.wait_cause not in ADMISSION_CAUSES:
            cp.wait_detail = None
        cp.wait_cause = ""
        timeout = self.step_timeout(cp)
        cp.wake_at = now + timedelta(seconds=timeout) if timeout else None
        if cp.pk is None:
            insert(cp)
        else:
            fields = ["attempt", "max_attempts", "status", "dispatched_at", "worker", "wake_at", "holds_slot"]
            save_fields(cp, [*fields, "wait_cause", "wait_detail"])
        if cp.holds_slot and not timeout_redispatch:
            count_admission(cp.queue)  # admitted now (directly or by a grant): durable_flow_admissions_total
            if cp.queue:  # the attempt's wait for its slot: durable_flow_admission_wait_seconds
                asked_at = cp.created_at if cp.attempt == 1 else backoff_end
                metric_counts.observe_span(metric_counts.ADMISSION_WAIT, {"queue": cp.queue}, asked_at, now)
        if inline_to:
            inline_handoff.hand_over(cp.run_id, cp.key, cp.attempt, self._started_inline(cp, now))
        else:
            self.transport.enqueue_step_of_queue(cp.queue, cp.run_id, cp.key, cp.attempt, cp.priority)

    def _started_inline(self, cp: StepCheckpoint, now: datetime) -> StepCheckpoint | None:
        """An attempt handed to this thread starts here, in the dispatching transaction: its
        history row is written now (the thread runs it right after the commit), and the thread
        gets the checkpoint instead of reading it back. A slot it holds was granted by this
        transaction or the one before it, in this process, and the rate window counts its start
        on the thread right before the call, as for a claimed step. On a backend whose slots
        follow a live process (`SLOTS_ADOPTED`: `redis`) the slot is adopted first, here: if this
        transaction then rolls back, the call is a waiter holding a slot, which the poller's
        re-offer dispatches. A slot already gone (None) leaves the start to the thread, whose
        adoption fails the same way and sends the call back through admission. An adoption that
        raises (Redis unreachable) also leaves the start to the thread, which rides the outage
        out: nothing here may fail the transaction, which has recorded a result."""
        if cp.holds_slot and self.admission.SLOTS_ADOPTED:
            try:
                adopted = self.admission.adopt(cp.queue, cp.ticket)
            except Exception:  # noqa: BLE001 - the thread's own start adopts the slot again
                logger.warning("adopting %s's slot on %r failed; its thread starts it", cp.ticket, cp.queue)
                return None
            if not adopted:
                return None
        attempt_started(cp, cp.attempt, cp.worker, now)
        handed = copy(cp)
        handed.input = json.loads(json.dumps(cp.input))  # what the step would read back: JSON, not the caller's objects
        return handed

    @retry_on_conflict
    def redispatch_pending(
        self,
        run_id: str,
        older_than_s: float = 0.0,
        keys: Iterable[str] | None = None,
        seen: Mapping[str, AttemptStart] | None = None,
    ) -> int:
        """Re-send the run's in-flight steps (for jobs a broker lost), or only those named by
        `keys`. Each gets a new attempt and keeps its slot; whichever attempt answers first wins.

        `seen`: the steps (by key) judged lost, each with the start the judgement read. Only a
        step still at that start is re-sent, decided under its row's lock: between a judgement
        and this transaction a live worker may have taken the same attempt up (a dead worker's
        task claimed again) and run it, and a second attempt beside it would run the step twice."""
        with transaction.atomic():
            run, _ = locked_run(run_id)
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            cutoff = self.clock() - timedelta(seconds=older_than_s)
            count = 0
            in_flight = run.checkpoints.filter(
                kind=StepKind.STEP, status=StepStatus.DISPATCHED, dispatched_at__lte=cutoff
            )
            if seen is not None:
                keys = seen if keys is None else set(keys) & set(seen)
            if keys is not None:
                in_flight = in_flight.filter(key__in=list(keys))
            locked = list(in_flight.select_for_update())
            if seen is not None and locked:
                # Read after the rows are locked (a statement of its own, so on PostgreSQL it sees
                # a start committed while this transaction waited for them): a start that comes
                # later waits for this commit, and then finds its attempt stale.
                now_at = attempt_starts(run.checkpoints.filter(pk__in=[cp.pk for cp in locked]))
                locked = [cp for cp in locked if now_at.get(cp.key) == seen[cp.key]]
            for cp in locked:
                self.dispatch(cp, timeout_redispatch=True)
                count += 1
            if run.status == RunStatus.PENDING:
                self.transport.enqueue_turn(run.id)
            return count
