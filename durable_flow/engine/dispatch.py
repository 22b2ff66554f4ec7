"""Dispatch: create a step's checkpoint, ask admission for a slot, send the attempt out;
send a step whose slot was lost back through admission; wake a queue's next waiters early."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction

from durable_flow.admission.base import AdmissionRequest
from durable_flow.engine.base import EngineBase
from durable_flow.engine.locking import locked_run, retry_on_conflict
from durable_flow.exceptions import RunNotFound, StepNotFound
from durable_flow.models import RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.registry import StepDefinition, get_step
from durable_flow.serialization import ensure_json
from durable_flow.turn import StepOptions

#: How long a call that found its queue paused parks before it looks again, should this process
#: see a resume late; `resume_queue` wakes the waiters itself.
PAUSED_RECHECK = timedelta(seconds=60)

if TYPE_CHECKING:
    from durable_flow.engine.core import Engine


def ms_to_datetime(epoch_ms: int) -> datetime:
    """An admission backend's epoch-milliseconds instant as an aware datetime."""
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)


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

    def admit(self, cp: StepCheckpoint) -> datetime | None:
        """Ask the queue for a slot; None when admitted, else when to retry."""
        if not cp.queue or cp.holds_slot or not self.admission.handles(cp.queue):
            return None
        if self.paused_queues.is_paused(cp.queue):
            # Admits nothing and asks the backend nothing; `resume_queue` wakes the waiters, and
            # the long retry is only a safety net for a resume this process saw late.
            return self._park(cp, self.now() + PAUSED_RECHECK)
        decision = self.admission.try_admit(
            AdmissionRequest(queue=cp.queue, ticket=cp.ticket, priority=cp.priority, fairness_key=cp.fairness_key)
        )
        if decision.admitted:
            cp.holds_slot = True
            return None
        assert decision.retry_at_ms is not None
        return self._park(cp, ms_to_datetime(decision.retry_at_ms))

    def _park(self, cp: StepCheckpoint, retry_at: datetime) -> datetime:
        """Record the call as waiting for admission; the run's turn parks until `retry_at`."""
        if cp.pk is None:
            cp.save()
        elif cp.status != StepStatus.WAITING:
            cp.status = StepStatus.WAITING
            cp.save(update_fields=["status"])
        return retry_at

    def step_timeout(self, cp: StepCheckpoint) -> float | None:
        """Seconds an attempt may run before it is re-dispatched, or None for no limit."""
        if cp.timeout_s is not None:  # set at creation from ctx.step(timeout=...)
            return cp.timeout_s
        try:
            definition = get_step(cp.name)
        except StepNotFound:
            return None
        return definition.timeout.total_seconds() if definition.timeout else None

    def dispatch(self, cp: StepCheckpoint, *, timeout_redispatch: bool = False) -> None:
        """Send a new attempt of the step to the transport (inside the turn's transaction)."""
        now = self.now()
        cp.attempt += 1
        if timeout_redispatch:
            # A timed-out attempt is retried in place: it keeps its slot and its attempt budget.
            cp.max_attempts += 1
        cp.status = StepStatus.DISPATCHED
        cp.dispatched_at = now
        cp.worker = ""
        timeout = self.step_timeout(cp)
        cp.wake_at = now + timedelta(seconds=timeout) if timeout else None
        if cp.pk is None:
            cp.save()
        else:
            cp.save(
                update_fields=["attempt", "max_attempts", "status", "dispatched_at", "worker", "wake_at", "holds_slot"]
            )
        self.transport.enqueue_step(cp.run_id, cp.key, cp.attempt, cp.priority)

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

    def wake_waiters(self: Engine, queue: str, limit: int = 2) -> int:
        """Early wake: a slot freed on `queue`, so retry its rightful next blocked runs now
        instead of at their `retry_ms` tick.

        A backend that can name its next waiters (`next_waiters` not None) is asked, so the run woken is
        the one admission will pick; otherwise the best-placed by priority and age. One spare
        wake covers a waiter that has gone away; the rest keep their tick.
        """
        with transaction.atomic():
            tickets = self.admission.next_waiters(queue, limit)
            if tickets is not None:
                run_ids = [ticket.rsplit("/", 1)[0] for ticket in tickets]
            else:
                run_ids = list(
                    StepCheckpoint.objects.filter(queue=queue, status=StepStatus.WAITING)
                    .order_by("-priority", "id")
                    .values_list("run_id", flat=True)[:limit]
                )
            return sum(self.wake(run_id) for run_id in dict.fromkeys(run_ids))
