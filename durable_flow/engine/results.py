"""Results: execute one attempt of a dispatched step on a worker, and record its result
exactly once (a duplicate is kept on `late_result` and changes nothing else)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import DataError, transaction

from durable_flow.attempts import attempt_finished, attempt_started, set_retry_at
from durable_flow.current import running_step
from durable_flow.engine.base import EngineBase
from durable_flow.engine.locking import locked_run_for_result, retry_on_conflict
from durable_flow.engine.step_start import start_attempt
from durable_flow.models import TERMINAL_RUN_STATUSES, RunStatus, StepCheckpoint, StepStatus
from durable_flow.registry import get_step, step_backoff
from durable_flow.serialization import ensure_json, error_info

if TYPE_CHECKING:
    from durable_flow.engine.core import Engine


class ResultsMixin(EngineBase):
    """Running step attempts and checkpointing what they return."""

    def execute_step(
        self: Engine,
        run_id: str,
        key: str,
        attempt: int,
        worker_id: str = "",
        *,
        also: Callable[[], object] | None = None,
    ) -> str:
        """Run one attempt of a dispatched step and record its result. Returns what happened:
        `completed`, `failed`, `skipped` (stale or cancelled) or `missing`. `also` runs inside
        the transaction that records the result (see `run_turn`)."""
        # The worker's stamp and the attempt's row in one transaction (one commit, one SQLite
        # write lock), on every step between a slot's handoff and the call.
        with transaction.atomic():
            cp, run_status = start_attempt(run_id, key, attempt, worker_id)
            cancelled = run_status in (RunStatus.CANCELLING, *TERMINAL_RUN_STATUSES)
            # A queue's or step concurrency's slot must still be this step's to run it.
            adopted = cp is not None and (cancelled or not cp.holds_slot or self.admission.adopt(cp.queue, cp.ticket))
            if cp is not None and adopted and not cancelled:
                # Written when the worker picks the attempt up, before the rate window's start
                # wait: no write may come between the window counting the start and the call.
                attempt_started(cp, attempt, worker_id, self.now())
        if cp is None:
            return "skipped" if StepCheckpoint.objects.filter(run_id=run_id, key=key).exists() else "missing"
        if cancelled:
            self.record_result(run_id, key, attempt, cancelled=True, also=also)
            return "skipped"
        if not adopted:
            # The slot went with a dead process and may be someone else's now: running anyway
            # would exceed the cap, so the step goes back through admission.
            self.readmit(run_id, key, attempt)
            return "skipped"
        try:
            definition = get_step(cp.name)
            if cp.holds_slot and cp.queue:
                self.await_start(cp)  # the rate window counts the step's start: here, right before the call
            with running_step(run_id, key, attempt):  # for durable_flow.current_step()
                output = definition.fn(cp.input)
            ensure_json(output, f"output of step {cp.name!r}", self.settings.max_payload_bytes)
        except Exception as exc:  # noqa: BLE001 - a step's failure is data, recorded durably
            self.record_result(run_id, key, attempt, error=error_info(exc), also=also)
            return "failed"
        try:
            self.record_result(run_id, key, attempt, output=output, also=also)
        except DataError as exc:
            # The database refused the output (a value it cannot store): a failed attempt, not a
            # result to re-run the step for forever.
            self.record_result(run_id, key, attempt, error=error_info(exc), also=also)
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
        also: Callable[[], object] | None = None,
    ) -> None:
        """Checkpoint a step attempt's result exactly once, release its slot, wake the run.

        A duplicate (an RQ job retried, a timed-out attempt answering late) is kept on
        `late_result` and changes nothing else.
        """
        with transaction.atomic():
            run, checkpoints = locked_run_for_result(run_id, key)
            if also is not None:
                also()
            cp = checkpoints.get(key)
            if run is None or cp is None:
                return
            stale = cp.status != StepStatus.DISPATCHED or (error is not None and cp.attempt != attempt)
            ignored = cancelled or run.status in (RunStatus.CANCELLING, RunStatus.CANCELLED) or run.is_terminal
            attempt_finished(cp, attempt, self.now(), error=error, cancelled=ignored and not stale, late=stale)
            if stale:
                cp.late_result = {"attempt": attempt, "output": output, "error": error}
                cp.save(update_fields=["late_result"])
                return
            # The slot goes back now; `holds_slot` is written by the status update below.
            released = ("holds_slot",) if self._release(cp, save=False) else ()
            if ignored:
                cp.late_result = {"attempt": attempt, "output": output, "error": error}
                self.settle(cp, StepStatus.CANCELLED, fields=("late_result", *released))
                self._finish_cancelling(run)
                return
            if error is not None and cp.attempt < cp.max_attempts:
                cp.status = StepStatus.RETRYING
                cp.error = error
                cp.wake_at = self.now() + step_backoff(cp.name, cp.attempt)
                cp.save(update_fields=["status", "error", "wake_at", "holds_slot"])
                set_retry_at(cp, attempt, cp.wake_at)
                self._continue(run, checkpoints if not cp.group else None)  # parks it until the backoff is up
                return
            if error is not None:
                self.settle(cp, StepStatus.FAILED, error=error, fields=released)
            else:
                self.settle(cp, StepStatus.COMPLETED, output=output, fields=released)
            if not cp.group:
                self._continue(run, checkpoints)  # every checkpoint of the run is in hand
            elif self._group_settled(cp):
                self._continue(run)

    def _release(self: Engine, cp: StepCheckpoint, *, save: bool = True) -> bool:
        """Give the slot back; the backend grants it on with this transaction. Whether it held
        one (with `save=False` the caller writes `holds_slot` in its own update)."""
        if not cp.holds_slot:
            return False
        cp.holds_slot = False
        if save:
            cp.save(update_fields=["holds_slot"])
        self.release_ticket(cp.queue, cp.ticket)
        return True
