"""Results: execute one attempt of a dispatched step on a worker, and record its result
exactly once (a duplicate is kept on `late_result` and changes nothing else). An attempt whose
slot was lost before it started goes back through admission (`readmit`).

The database is the source of truth for a result: recording it never depends on a backend
whose state lives elsewhere. With such an admission backend (`redis`) a completed or failed
step's slot is released at the end of the result's transaction (`engine/release_order.py`), and
after its commit if Redis refuses it then (a retry's or a cancel's release always waits for the
commit); a release lost to an outage is logged (once per outage) and left to the poller's
maintenance (`release_strays`), which frees a backend slot that no checkpoint holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from django.db import DataError, transaction

from durable_flow.definitions.current import running_step
from durable_flow.definitions.registry import get_step, step_backoff
from durable_flow.definitions.serialization import ensure_json, error_info, readable
from durable_flow.engine.base import settle
from durable_flow.engine.locking import locked_run, locked_run_for_result, retry_on_conflict
from durable_flow.engine.turn import InlineTurnFailed
from durable_flow.engine.user_code import is_code_failure
from durable_flow.engine.wait_causes import backoff
from durable_flow.engine.wake import group_settled
from durable_flow.models import TERMINAL_RUN_STATUSES, RunStatus, StepCheckpoint, StepStatus
from durable_flow.store import metric_counts
from durable_flow.store.attempts import attempt_finished, attempt_started, set_retry_at
from durable_flow.store.outage import Outage, transient_errors
from durable_flow.store.statements import writes_together
from durable_flow.store.step_start import start_attempt

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.config.settings import DurableFlowSettings
    from durable_flow.engine.base import Clock
    from durable_flow.engine.lifecycle import Lifecycle
    from durable_flow.engine.release_order import Releases
    from durable_flow.engine.start_window import StartWindow
    from durable_flow.engine.turns import Turns
    from durable_flow.engine.wake import Waker

logger = logging.getLogger("durable_flow.engine")


class _AdmissionUnreachable(Exception):
    """The admission backend could not be reached to adopt a step's slot (its `__cause__`)."""


class Results:
    """Running step attempts and checkpointing what they return. Re-admission lives here, not
    with dispatch, because it ends a cancelling run and wakes the run, as a result does."""

    def __init__(
        self,
        settings: DurableFlowSettings,
        admission: AdmissionBackend,
        clock: Clock,
        start_window: StartWindow,
        releases: Releases,
        lifecycle: Lifecycle,
        turns: Turns,
        waker: Waker,
    ) -> None:
        """`admission` adopts a claimed attempt's slot; `start_window` counts its start;
        `releases` gives its slot back; `lifecycle` ends a cancelling run; `turns` takes the
        run's next turn inline; `waker` queues it instead."""
        self.settings = settings
        self.admission = admission
        self.clock = clock
        self.start_window = start_window
        self.releases = releases
        self.lifecycle = lifecycle
        self.turns = turns
        self.waker = waker
        #: The wait riding out an outage of the admission backend at a step's adoption, logged once per outage.
        self.adopt_outage = Outage("admission: adopting a step's slot", logger)

    def _start_through_outages(
        self, run_id: str, key: str, attempt: int, worker_id: str
    ) -> tuple[StepCheckpoint | None, bool, bool]:
        """Start the attempt: the worker's stamp and the attempt's row in one transaction (one
        commit, one SQLite write lock), with the adoption of its slot. An admission backend out
        of reach (Redis down, a Cluster master failing over) is waited out with backoff, the
        transaction rolled back each time: the step has not run, so it is not the step's failure,
        and failing the task would leave the step to `REDISPATCH_AFTER_S`."""
        while True:
            try:
                with transaction.atomic():
                    cp, run_status = start_attempt(run_id, key, attempt, worker_id)
                    cancelled = run_status in (RunStatus.CANCELLING, *TERMINAL_RUN_STATUSES)
                    # A queue's or step concurrency's slot must still be this step's to run it.
                    adopted = cp is not None and (cancelled or not cp.holds_slot or self._adopt(cp))
                    if cp is not None and adopted and not cancelled:
                        # Written when the worker picks the attempt up, before the rate window's
                        # start wait: no write may come between the window counting the start and the call.
                        attempt_started(cp, attempt, worker_id, self.clock())
            except _AdmissionUnreachable as exc:
                self.start_window.sleep(self.adopt_outage.failed(exc.__cause__ or exc))
                continue
            self.adopt_outage.recovered()
            return cp, cancelled, adopted

    def _adopt(self, cp: StepCheckpoint) -> bool:
        try:
            return self.admission.adopt(cp.queue, cp.ticket)
        except transient_errors() as exc:
            raise _AdmissionUnreachable from exc

    def execute_step(
        self,
        run_id: str,
        key: str,
        attempt: int,
        worker_id: str = "",
        *,
        in_settling_transaction: Callable[[], object] | None = None,
        dispatched: StepCheckpoint | None = None,
    ) -> str:
        """Run one attempt of a dispatched step and record its result. Returns what happened:
        `completed`, `failed`, `skipped` (stale or cancelled) or `missing`. `in_settling_transaction` runs inside
        the transaction that records the result (see `run_turn`). `dispatched`: the attempt
        was started by the transaction that dispatched it to this thread (`inline_handoff`)."""
        if dispatched is not None:
            cp = dispatched
            cancelled = False
            adopted = True  # by the dispatching transaction, where a backend needs it (`_started_inline`)
        else:
            cp, cancelled, adopted = self._start_through_outages(run_id, key, attempt, worker_id)
        if cp is None:
            return "skipped" if StepCheckpoint.objects.filter(run_id=run_id, key=key).exists() else "missing"
        if cancelled:
            self.record_result(run_id, key, attempt, cancelled=True, in_settling_transaction=in_settling_transaction)
            return "skipped"
        if not adopted:
            # The slot went with a dead process and may be someone else's now: running anyway
            # would exceed the cap, so the step goes back through admission.
            self.readmit(run_id, key, attempt)
            return "skipped"
        began: datetime | None = None  # the call's start: durable_flow_step_duration_seconds
        try:
            definition = get_step(cp.name)
            if cp.holds_slot and cp.queue:
                self.start_window.await_start_through_outages(cp)  # the window counts the start: right before the call
            began = self.clock()
            with running_step(run_id, key, attempt):  # for durable_flow.current_step()
                output = definition.fn(readable(cp.input, f"input of step {cp.name!r}"))
            ensure_json(output, f"output of step {cp.name!r}", self.settings.max_payload_bytes)
        except BaseException as exc:  # a step's failure is data, recorded durably
            if not is_code_failure(exc, f"step {cp.name!r} of run {run_id} (attempt {attempt})"):
                raise  # the engine's own unwinding, or a signal's stop (`engine/user_code.py`)
            ended = self.clock()
            self.record_result(
                run_id, key, attempt, error=error_info(exc), in_settling_transaction=in_settling_transaction
            )
            metric_counts.observe_span(metric_counts.STEP_DURATION, {"step": cp.name}, began, ended)
            return "failed"
        ended = self.clock()
        try:
            self.record_result(run_id, key, attempt, output=output, in_settling_transaction=in_settling_transaction)
        except DataError as exc:
            # The database refused the output (a value it cannot store): a failed attempt, not a
            # result to re-run the step for forever.
            self.record_result(
                run_id, key, attempt, error=error_info(exc), in_settling_transaction=in_settling_transaction
            )
            return "failed"
        metric_counts.observe_span(metric_counts.STEP_DURATION, {"step": cp.name}, began, ended)
        return "completed"

    @retry_on_conflict
    def record_result(
        self,
        run_id: str,
        key: str,
        attempt: int,
        *,
        output: Any = None,
        error: dict[str, Any] | None = None,
        cancelled: bool = False,
        in_settling_transaction: Callable[[], object] | None = None,
    ) -> None:
        """Checkpoint a step attempt's result exactly once, release its slot, wake the run.

        A duplicate (an RQ job retried, a timed-out attempt answering late) is kept on
        `late_result` and changes nothing else. The run's next turn is taken inline, in the same
        transaction (`Turns.continue_inline`); if that turn fails, the transaction rolls back and
        the result is recorded again with the turn queued for a worker instead.
        """
        record = partial(
            self._record_result,
            run_id,
            key,
            attempt,
            output=output,
            error=error,
            cancelled=cancelled,
            in_settling_transaction=in_settling_transaction,
        )
        try:
            record(inline=True)
        except InlineTurnFailed as failed:
            logger.warning("run %s: inline turn failed (%s); queuing it instead", run_id, failed.__cause__)
            record(inline=False)

    def _record_result(
        self,
        run_id: str,
        key: str,
        attempt: int,
        *,
        output: Any,
        error: dict[str, Any] | None,
        cancelled: bool,
        in_settling_transaction: Callable[[], object] | None,
        inline: bool,
    ) -> None:
        """One try of `record_result`, with the run's next turn taken inline or queued."""
        # Its writes go with the statement after each (`writes_together`): one round trip less
        # for each, on the path between a step's end and the next step's start in its slot.
        with transaction.atomic(), writes_together():
            run, checkpoints = locked_run_for_result(run_id, key)
            if in_settling_transaction is not None:
                in_settling_transaction()
            cp = checkpoints.get(key)
            if run is None or cp is None:
                return
            stale = cp.status != StepStatus.DISPATCHED or (error is not None and cp.attempt != attempt)
            ignored = cancelled or run.status in (RunStatus.CANCELLING, RunStatus.CANCELLED) or run.is_terminal
            attempt_finished(cp, attempt, self.clock(), error=error, cancelled=ignored and not stale, late=stale)
            if stale:
                cp.late_result = {"attempt": attempt, "output": output, "error": error}
                cp.save(update_fields=["late_result"])
                return
            # The slot goes back right after the checkpoint's update below (or, on a backend
            # outside the database, once this commits), so the queue's lock, held from the
            # release to the commit, spans one UPDATE less. A retried call re-uses its ticket,
            # so its after-commit release checks the checkpoint under its lock first.
            retrying = not ignored and error is not None and cp.attempt < cp.max_attempts
            held = cp.holds_slot
            cp.holds_slot = False
            released = ("holds_slot",) if held else ()
            if ignored:
                cp.late_result = {"attempt": attempt, "output": output, "error": error}
                settle(cp, StepStatus.CANCELLED, self.clock(), fields=("late_result", *released))
                if held:
                    self.releases.release_settled(cp.queue, cp.ticket, guarded=False)
                self.lifecycle.finish_cancelling(run)
                return
            if retrying:
                cp.status = StepStatus.RETRYING
                cp.error = error
                cp.wake_at = self.clock() + step_backoff(cp.name, cp.attempt)
                cp.wait_cause, cp.wait_detail = backoff(cp.wake_at)
                cp.save(update_fields=["status", "error", "wake_at", "holds_slot", "wait_cause", "wait_detail"])
                set_retry_at(cp, attempt, cp.wake_at)
                metric_counts.count(metric_counts.STEP_RETRIES, {"step": cp.name})
                if held:
                    self.releases.release_settled(cp.queue, cp.ticket, guarded=True)
                # Parks it until the backoff is up.
                self.turns.continue_inline(run, checkpoints if not cp.group else None, inline=inline)
                return
            if error is not None:
                settle(cp, StepStatus.FAILED, self.clock(), error=error, fields=released)
            else:
                settle(cp, StepStatus.COMPLETED, self.clock(), output=output, fields=released)
            # The slot goes back after the inline turn (or at its first admission), so the
            # queue's lock is not held over the turn (`engine/release_order.py`).
            with self.releases.release_after_turn(cp.queue, cp.ticket) if held else nullcontext():
                if not cp.group:
                    self.turns.continue_inline(run, checkpoints, inline=inline)  # all of the run's checkpoints in hand
                elif group_settled(cp):
                    self.turns.continue_inline(run, inline=inline)

    @retry_on_conflict
    def readmit(self, run_id: str, key: str, attempt: int) -> None:
        """Send a dispatched attempt whose slot was lost back to admission (a new attempt follows)."""
        with transaction.atomic():
            run, cp = locked_run(run_id, key)
            if run is None or cp is None or cp.status != StepStatus.DISPATCHED or cp.attempt != attempt:
                return
            if run.status == RunStatus.CANCELLING or run.is_terminal:
                # Cancelled meanwhile: the attempt that never ran is the last thing it waited for.
                cp.holds_slot = False
                cp.save(update_fields=["holds_slot"])
                settle(cp, StepStatus.CANCELLED, self.clock())
                self.lifecycle.finish_cancelling(run)
                return
            cp.status, cp.holds_slot, cp.wake_at = StepStatus.WAITING, False, None
            cp.max_attempts += 1  # the lost attempt never ran; it does not use up a retry
            cp.save(update_fields=["status", "holds_slot", "wake_at", "max_attempts"])
            self.waker.wake(run)
