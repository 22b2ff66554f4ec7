"""Results: execute one attempt of a dispatched step on a worker, and record its result
exactly once (a duplicate is kept on `late_result` and changes nothing else).

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
from functools import partial
from typing import TYPE_CHECKING, Any

from django.db import DataError, close_old_connections, transaction

from durable_flow.definitions.current import running_step
from durable_flow.definitions.registry import get_step, step_backoff
from durable_flow.definitions.serialization import ensure_json, error_info, readable
from durable_flow.engine.base import EngineBase
from durable_flow.engine.locking import locked_run_for_result, retry_on_conflict
from durable_flow.engine.turn import InlineTurnFailed
from durable_flow.engine.user_code import is_code_failure
from durable_flow.models import TERMINAL_RUN_STATUSES, RunStatus, StepCheckpoint, StepStatus
from durable_flow.store.attempts import attempt_finished, attempt_started, set_retry_at
from durable_flow.store.outage import Outage, transient_errors
from durable_flow.store.statements import writes_together
from durable_flow.store.step_start import start_attempt

if TYPE_CHECKING:
    from durable_flow.engine.core import Engine

logger = logging.getLogger("durable_flow.engine")


class ResultsMixin(EngineBase):
    """Running step attempts and checkpointing what they return."""

    #: Releases after commit that failed because the admission backend was unreachable: logged
    #: once per outage (set by `Engine.__init__`).
    release_outage: Outage
    #: The wait before a step's start (its rate-window count) riding out an outage of the
    #: admission backend, logged once per outage (set by `Engine.__init__`).
    start_outage: Outage

    def execute_step(
        self: Engine,
        run_id: str,
        key: str,
        attempt: int,
        worker_id: str = "",
        *,
        also: Callable[[], object] | None = None,
        dispatched: StepCheckpoint | None = None,
    ) -> str:
        """Run one attempt of a dispatched step and record its result. Returns what happened:
        `completed`, `failed`, `skipped` (stale or cancelled) or `missing`. `also` runs inside
        the transaction that records the result (see `run_turn`). `dispatched`: the attempt
        was started by the transaction that dispatched it to this thread (`inline_handoff`)."""
        if dispatched is not None:
            cp, run_status = dispatched, RunStatus.RUNNING
            cancelled = False
            adopted = True  # by the dispatching transaction, where a backend needs it (`_started_inline`)
        else:
            # The worker's stamp and the attempt's row in one transaction (one commit, one SQLite
            # write lock), on every step between a slot's handoff and the call.
            with transaction.atomic():
                cp, run_status = start_attempt(run_id, key, attempt, worker_id)
                cancelled = run_status in (RunStatus.CANCELLING, *TERMINAL_RUN_STATUSES)
                # A queue's or step concurrency's slot must still be this step's to run it.
                adopted = cp is not None and (
                    cancelled or not cp.holds_slot or self.admission.adopt(cp.queue, cp.ticket)
                )
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
                self._await_start_through_outages(cp)  # the window counts the start: right before the call
            with running_step(run_id, key, attempt):  # for durable_flow.current_step()
                output = definition.fn(readable(cp.input, f"input of step {cp.name!r}"))
            ensure_json(output, f"output of step {cp.name!r}", self.settings.max_payload_bytes)
        except BaseException as exc:  # a step's failure is data, recorded durably
            if not is_code_failure(exc, f"step {cp.name!r} of run {run_id} (attempt {attempt})"):
                raise  # the engine's own unwinding, or a signal's stop (`engine/user_code.py`)
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

    def _await_start_through_outages(self: Engine, cp: StepCheckpoint) -> None:
        """`await_start`, waiting out an outage of the admission backend (Redis, or the database
        for `db`) with backoff: the step has not started, so the backend being down is not the
        step's failure and must not spend one of its attempts (or fail its run)."""
        while True:
            try:
                self.await_start(cp)
            except transient_errors() as exc:
                self.sleep(self.start_outage.failed(exc))
                if not transaction.get_connection().in_atomic_block:
                    close_old_connections()  # a connection the database dropped is reopened
                continue
            self.start_outage.recovered()
            return

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
        `late_result` and changes nothing else. The run's next turn is taken inline, in the same
        transaction (`TurnsMixin._continue`); if that turn fails, the transaction rolls back and
        the result is recorded again with the turn queued for a worker instead.
        """
        record = partial(
            self._record_result, run_id, key, attempt, output=output, error=error, cancelled=cancelled, also=also
        )
        try:
            record(inline=True)
        except InlineTurnFailed as failed:
            logger.warning("run %s: inline turn failed (%s); queuing it instead", run_id, failed.__cause__)
            record(inline=False)

    def _record_result(
        self: Engine,
        run_id: str,
        key: str,
        attempt: int,
        *,
        output: Any,
        error: dict[str, Any] | None,
        cancelled: bool,
        also: Callable[[], object] | None,
        inline: bool,
    ) -> None:
        """One try of `record_result`, with the run's next turn taken inline or queued."""
        # Its writes go with the statement after each (`writes_together`): one round trip less
        # for each, on the path between a step's end and the next step's start in its slot.
        with transaction.atomic(), writes_together():
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
                self.settle(cp, StepStatus.CANCELLED, fields=("late_result", *released))
                if held:
                    self.release_settled(cp.queue, cp.ticket, guarded=False)
                self._finish_cancelling(run)
                return
            if retrying:
                cp.status = StepStatus.RETRYING
                cp.error = error
                cp.wake_at = self.now() + step_backoff(cp.name, cp.attempt)
                cp.save(update_fields=["status", "error", "wake_at", "holds_slot"])
                set_retry_at(cp, attempt, cp.wake_at)
                if held:
                    self.release_settled(cp.queue, cp.ticket, guarded=True)
                # Parks it until the backoff is up.
                self._continue(run, checkpoints if not cp.group else None, inline=inline)
                return
            if error is not None:
                self.settle(cp, StepStatus.FAILED, error=error, fields=released)
            else:
                self.settle(cp, StepStatus.COMPLETED, output=output, fields=released)
            # The slot goes back after the inline turn (or at its first admission), so the
            # queue's lock is not held over the turn (`engine/release_order.py`).
            with self.release_after_turn(cp.queue, cp.ticket) if held else nullcontext():
                if not cp.group:
                    self._continue(run, checkpoints, inline=inline)  # every checkpoint of the run is in hand
                elif self._group_settled(cp):
                    self._continue(run, inline=inline)

    def release_settled(self: Engine, queue: str, ticket: str, *, guarded: bool = False) -> None:
        """Free the ticket of a call this transaction settles (its slot, or its place in line):
        now on a backend in the database (which grants it on with this transaction), else once
        this commits, so the backend being down cannot roll the caller's transaction back. A
        cancel uses it too, so it succeeds while Redis is down: a slot it could not free is the
        maintenance's (`release_strays`), a place in line is handed on when it is granted.
        `guarded`: the ticket may be re-admitted before the commit's callback runs (a retry), so
        that release re-checks the checkpoint first."""
        if self.admission.RELEASES_IN_TRANSACTION:
            self.release_ticket(queue, ticket)
        else:
            transaction.on_commit(partial(self._release_after_commit, queue, ticket, guarded))

    def _release_after_commit(self: Engine, queue: str, ticket: str, guarded: bool) -> None:
        """Release a settled step's slot on a backend outside the database. It must not fail
        the caller (its result is recorded): a backend outage is logged once and the slot left
        to the poller's maintenance (`release_strays`)."""
        try:
            if guarded:
                self.release_stray(queue, ticket)
            else:
                self.release_ticket(queue, ticket)
        except transient_errors() as exc:
            self.release_outage.failed(exc)
        except Exception:  # the result is committed; the repair frees the slot
            logger.exception("releasing %s on queue %r failed; the poller's maintenance frees it", ticket, queue)
        else:
            self.release_outage.recovered()
