"""Results: execute one attempt of a dispatched step on a worker, and record its result
exactly once (a duplicate is kept on `late_result` and changes nothing else)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import DataError, transaction

from durable_flow.attempts import attempt_finished, attempt_started, set_retry_at
from durable_flow.current import running_step
from durable_flow.engine.base import EngineBase
from durable_flow.engine.locking import locked_run, one, retry_on_conflict
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus
from durable_flow.registry import get_step, step_backoff
from durable_flow.serialization import ensure_json, error_info

if TYPE_CHECKING:
    from durable_flow.engine.core import Engine


class ResultsMixin(EngineBase):
    """Running step attempts and checkpointing what they return."""

    def execute_step(self: Engine, run_id: str, key: str, attempt: int, worker_id: str = "") -> str:
        """Run one attempt of a dispatched step and record its result. Returns what happened:
        `completed`, `failed`, `skipped` (stale or cancelled) or `missing`."""
        cp = one(StepCheckpoint.objects.select_related("run").filter(run_id=run_id, key=key))
        if cp is None:
            return "missing"
        if cp.status != StepStatus.DISPATCHED or cp.attempt != attempt:
            return "skipped"
        if cp.run.status in (RunStatus.CANCELLING, RunStatus.CANCELLED) or cp.run.is_terminal:
            self.record_result(run_id, key, attempt, cancelled=True)
            return "skipped"
        if cp.holds_slot and cp.queue and not self.admission.adopt(cp.queue, cp.ticket):
            # The slot went with a dead process and may be someone else's now: running anyway
            # would exceed the cap, so the step goes back through admission.
            self.readmit(run_id, key, attempt)
            return "skipped"
        if worker_id:
            StepCheckpoint.objects.filter(pk=cp.pk, attempt=attempt).update(worker=worker_id)
        # Written when the worker picks the attempt up, before the rate window's start wait: no
        # write may come between the window counting the start and the call.
        attempt_started(cp, attempt, worker_id, self.now())
        try:
            definition = get_step(cp.name)
            if cp.holds_slot and cp.queue:
                self.await_start(cp)  # the rate window counts the step's start: here, right before the call
            with running_step(run_id, key, attempt):  # for durable_flow.current_step()
                output = definition.fn(cp.input)
            ensure_json(output, f"output of step {cp.name!r}", self.settings.max_payload_bytes)
        except Exception as exc:  # noqa: BLE001 - a step's failure is data, recorded durably
            self.record_result(run_id, key, attempt, error=error_info(exc))
            return "failed"
        try:
            self.record_result(run_id, key, attempt, output=output)
        except DataError as exc:
            # The database refused the output (a value it cannot store): a failed attempt, not a
            # result to re-run the step for forever.
            self.record_result(run_id, key, attempt, error=error_info(exc))
            return "failed"
        return "completed"

    @retry_on_conflict
    def record_result(
        self: Engine,
        run_id: str,
        key: str,
        attempt: int,
        *,
        output: Any = None,
        error: dict[str, Any] | None = None,
        cancelled: bool = False,
    ) -> None:
        """Checkpoint a step attempt's result exactly once, release its slot, wake the run.

        A duplicate (an RQ job retried, a timed-out attempt answering late) is kept on
        `late_result` and changes nothing else.
        """
        with transaction.atomic():
            run, cp = locked_run(run_id, key)
            if run is None or cp is None:
                return
            stale = cp.status != StepStatus.DISPATCHED or (error is not None and cp.attempt != attempt)
            ignored = cancelled or run.status in (RunStatus.CANCELLING, RunStatus.CANCELLED) or run.is_terminal
            attempt_finished(cp, attempt, self.now(), error=error, cancelled=ignored and not stale, late=stale)
            if stale:
                cp.late_result = {"attempt": attempt, "output": output, "error": error}
                cp.save(update_fields=["late_result"])
                return
            self._release(cp)
            if ignored:
                cp.late_result = {"attempt": attempt, "output": output, "error": error}
                cp.save(update_fields=["late_result"])
                self.settle(cp, StepStatus.CANCELLED)
                self._finish_cancelling(run)
                return
            if error is not None and cp.attempt < cp.max_attempts:
                cp.status = StepStatus.RETRYING
                cp.error = error
                cp.wake_at = self.now() + step_backoff(cp.name, cp.attempt)
                cp.save(update_fields=["status", "error", "wake_at", "holds_slot"])
                set_retry_at(cp, attempt, cp.wake_at)
                self._continue(run)  # the turn parks the run until the backoff is up
                return
            if error is not None:
                self.settle(cp, StepStatus.FAILED, error=error)
            else:
                self.settle(cp, StepStatus.COMPLETED, output=output)
            if self._group_settled(cp):
                self._continue(run)

    def _release(self: Engine, cp: StepCheckpoint) -> None:
        """Give the slot back; the backend grants it on with this transaction."""
        if cp.holds_slot:
            cp.holds_slot = False
            cp.save(update_fields=["holds_slot"])
            self.release_ticket(cp.queue, cp.ticket)
