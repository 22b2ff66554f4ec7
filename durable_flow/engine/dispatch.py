"""Dispatch: create a step's checkpoint, ask admission for a slot (or park in the queue's
waiting line), send the attempt out; send a step whose slot was lost back through admission."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from copy import copy
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction

from durable_flow.admission.base import AdmissionRequest, Grant
from durable_flow.definitions.registry import StepDefinition, get_step
from durable_flow.definitions.serialization import ensure_json
from durable_flow.definitions.step_concurrency import constraints_of
from durable_flow.engine import inline_handoff
from durable_flow.engine.base import EngineBase
from durable_flow.engine.locking import locked_run, retry_on_conflict
from durable_flow.engine.turn import StepOptions
from durable_flow.exceptions import RunNotFound, StepNotFound
from durable_flow.models import RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.store.attempts import attempt_started
from durable_flow.store.counters import count_admission, count_parked
from durable_flow.store.statements import insert, save_fields

if TYPE_CHECKING:
    from durable_flow.engine.core import Engine

logger = logging.getLogger("durable_flow.engine")


class DispatchMixin(EngineBase):
    """Checkpoint creation, admission and dispatch of step attempts."""

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

    def admit(self: Engine, cp: StepCheckpoint) -> bool:
        """Ask the queue for a slot: True when admitted. Otherwise the call is parked in the
        queue's waiting line and costs nothing until a grant dispatches it (`handoff`)."""
        if cp.holds_slot:
            return True
        # Step concurrency gates the call whatever its queue (see `AdmissionRequest`).
        constraints = constraints_of(cp.run.step_concurrency)
        gated_queue = bool(cp.queue) and self.admission.handles(cp.queue)
        if not gated_queue and not constraints:
            return True
        self.release_deferred_now()  # a result's slot, given back before anything is decided
        request = AdmissionRequest(
            queue=cp.queue,
            ticket=cp.ticket,
            priority=cp.priority,
            fairness_key=cp.fairness_key,
            constraints=constraints,
        )
        if gated_queue and self.paused_queues.is_paused(cp.queue):
            # A paused queue decides nothing: the call joins its line (keeping any place it had)
            # and `resume_queue` grants it; a slot it already holds is kept.
            if self.admission.reoffer(cp.queue, [request]):
                cp.holds_slot = True
                return True
            self._park(cp)
            return False
        decision = self.admission.try_admit(request)
        reopens = decision.retry_at_ms if decision.reason == "rate_limited" else None
        self.take_grant(cp.queue, Grant(decision.granted, reopens))
        if decision.admitted:
            cp.holds_slot = True
            return True
        self._park(cp)
        return False

    def _park(self, cp: StepCheckpoint) -> None:
        """Record the call as waiting for a grant (counted once per attempt that joins the line:
        durable_flow_admissions_total{decision="parked"})."""
        if cp.pk is None:
            insert(cp)
        elif cp.status != StepStatus.WAITING:
            cp.status = StepStatus.WAITING
            cp.save(update_fields=["status"])
        else:
            return  # already in line (a re-offer that found no slot): counted when it joined
        count_parked(cp.queue)

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
        now = self.now()
        cp.attempt += 1
        if timeout_redispatch:
            # A timed-out attempt is retried in place: it keeps its slot and its attempt budget.
            cp.max_attempts += 1
        cp.status = StepStatus.DISPATCHED
        cp.dispatched_at = now
        cp.worker = inline_to
        timeout = self.step_timeout(cp)
        cp.wake_at = now + timedelta(seconds=timeout) if timeout else None
        if cp.pk is None:
            insert(cp)
        else:
            save_fields(cp, ["attempt", "max_attempts", "status", "dispatched_at", "worker", "wake_at", "holds_slot"])
        if cp.holds_slot and not timeout_redispatch:
            count_admission(cp.queue)  # admitted now (directly or by a grant): durable_flow_admissions_total
        if inline_to:
            inline_handoff.hand_over(cp.run_id, cp.key, cp.attempt, self._started_inline(cp, now))
        else:
            self.transport.enqueue_step(cp.run_id, cp.key, cp.attempt, cp.priority)

    def _started_inline(self: Engine, cp: StepCheckpoint, now: datetime) -> StepCheckpoint | None:
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
    def readmit(self: Engine, run_id: str, key: str, attempt: int) -> None:
        """Send a dispatched attempt whose slot was lost back to admission (a new attempt follows)."""
        with transaction.atomic():
            run, cp = locked_run(run_id, key)
            if run is None or cp is None or cp.status != StepStatus.DISPATCHED or cp.attempt != attempt:
                return
            if run.status == RunStatus.CANCELLING or run.is_terminal:
                # Cancelled meanwhile: the attempt that never ran is the last thing it waited for.
                cp.holds_slot = False
                cp.save(update_fields=["holds_slot"])
                self.settle(cp, StepStatus.CANCELLED)
                self._finish_cancelling(run)
                return
            cp.status, cp.holds_slot, cp.wake_at = StepStatus.WAITING, False, None
            cp.max_attempts += 1  # the lost attempt never ran; it does not use up a retry
            cp.save(update_fields=["status", "holds_slot", "wake_at", "max_attempts"])
            self.wake(run)

    @retry_on_conflict
    def redispatch_pending(
        self: Engine, run_id: str, older_than_s: float = 0.0, keys: Iterable[str] | None = None
    ) -> int:
        """Re-send the run's in-flight steps (for jobs a broker lost), or only those named by
        `keys`. Each gets a new attempt and keeps its slot; whichever attempt answers first wins."""
        with transaction.atomic():
            run, _ = locked_run(run_id)
            if run is None:
                raise RunNotFound(f"no run with id {run_id!r}")
            cutoff = self.now() - timedelta(seconds=older_than_s)
            count = 0
            in_flight = run.checkpoints.filter(
                kind=StepKind.STEP, status=StepStatus.DISPATCHED, dispatched_at__lte=cutoff
            )
            if keys is not None:
                in_flight = in_flight.filter(key__in=list(keys))
            for cp in in_flight.select_for_update():
                self.dispatch(cp, timeout_redispatch=True)
                count += 1
            if run.status == RunStatus.PENDING:
                self.transport.enqueue_turn(run.id)
            return count
