"""Turns: replay a run's workflow from the top, or continue it inline after a result.

A replay runs the workflow's code over the run's checkpoints; what its calls do (admit and
dispatch a step, write a sleep's checkpoint, start a child) is the `calls` it is given
(`engine/calls.py`), so the replay itself decides only how the turn ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import DatabaseError, transaction

from durable_flow.definitions.registry import get_workflow
from durable_flow.definitions.serialization import ensure_json, error_info, readable
from durable_flow.engine.context import WorkflowContext
from durable_flow.engine.locking import locked_run, retry_on_conflict
from durable_flow.engine.turn import EngineUnavailable, InlineTurnFailed, Suspend, TurnEngine
from durable_flow.engine.user_code import is_code_failure
from durable_flow.exceptions import DurableFlowError, NonDeterminismError
from durable_flow.models import TERMINAL_RUN_STATUSES, RunStatus, StepCheckpoint, WorkflowRun
from durable_flow.models.runs import WAKEABLE
from durable_flow.store import timer_bells
from durable_flow.store.statements import save_fields, writes_together

if TYPE_CHECKING:
    from durable_flow.config.settings import DurableFlowSettings
    from durable_flow.engine.lifecycle import Lifecycle
    from durable_flow.engine.wake import Waker

logger = logging.getLogger("durable_flow.engine")


class Turns:
    """Replaying runs: a queued turn, or the one a result takes inline."""

    def __init__(self, settings: DurableFlowSettings, calls: TurnEngine, lifecycle: Lifecycle, waker: Waker) -> None:
        """`calls` is what the workflow's calls reach (`ctx.step`, `ctx.sleep`, ...: `calls`);
        `lifecycle` finishes a run its replay ends; `waker` queues a turn not taken inline."""
        self.settings = settings
        self.calls = calls
        self.lifecycle = lifecycle
        self.waker = waker

    @retry_on_conflict
    def run_turn(
        self, run_id: str, *, in_settling_transaction: Callable[[], object] | None = None
    ) -> WorkflowRun | None:
        """Replay the run's workflow from the top until it finishes or must wait.

        `in_settling_transaction` runs inside the turn's transaction, after the run's row is locked: the `db`
        transport deletes its task row there, saving a transaction per task."""
        try:
            # The turn's writes after its last read (the dispatched step's attempt row, the run's
            # update) go to the database in one round trip (`writes_together`).
            with transaction.atomic(), writes_together():
                run, _ = locked_run(run_id)
                if in_settling_transaction is not None:
                    in_settling_transaction()
                if run is None:
                    # Said, not silent: on a shared broker (two deployments on one Redis
                    # database) this is the only trace of another deployment's worker taking
                    # this one's turns, which then never run here.
                    logger.warning(
                        "turn for run %s: no such run in this database (deleted since its turn was sent, or "
                        "the transport's queue is shared with another deployment: give each its own)",
                        run_id,
                    )
                    return None
                return self.replay(run)
        except EngineUnavailable as exc:
            # Rolled back, run untouched: surface the real error so the caller retries the turn
            # (a lock conflict is retried here; a worker leaves the task to be claimed again).
            raise (exc.__cause__ or DatabaseError(str(exc))) from None

    def replay(self, run: WorkflowRun, checkpoints: dict[str, StepCheckpoint] | None = None) -> WorkflowRun:
        """One turn of a run whose row this transaction has locked. `checkpoints`, when given,
        are all of the run's, read under this lock (a result's transaction has them already);
        a run's first turn has none to read."""
        if run.status in TERMINAL_RUN_STATUSES or run.status in (RunStatus.CANCELLING, RunStatus.DEBOUNCED):
            return run  # a debounced run begins when the poller wakes it, not on a stray turn
        try:
            definition = get_workflow(run.workflow)
        except DurableFlowError as exc:
            self.lifecycle.finish(run, RunStatus.FAILED, error=error_info(exc))
            return run
        if definition.version != run.version:
            exc = NonDeterminismError(
                f"run {run.id} started under version {run.version!r} of {run.workflow!r}, "
                f"but this process has version {definition.version!r}"
            )
            self.lifecycle.finish(run, RunStatus.FAILED, error=error_info(exc))
            return run
        if checkpoints is None:
            checkpoints = {cp.key: cp for cp in run.checkpoints.all()} if run.turns else {}
        ctx = WorkflowContext(self.calls, run, checkpoints)
        run.turns += 1
        try:
            output = definition.fn(ctx, readable(run.input, f"input of run {run.id!r}"))
            ensure_json(output, f"output of workflow {run.workflow!r}", self.settings.max_payload_bytes)
        except Suspend:
            run.status = RunStatus.RUNNING if ctx.in_flight else RunStatus.SUSPENDED
            run.wake_at = ctx.wake_at
            save_fields(run, ["status", "wake_at", "turns", "updated_at"])
            # A wake-up sooner than the poller's next look rings it (nothing otherwise).
            timer_bells.parked(run.wake_at, ctx.now, self.settings.poller_interval_ms / 1000)
            return run
        except DatabaseError as exc:
            # The workflow's code touched the database and failed (or aborted the transaction):
            # not a verdict on the run. Roll the turn back and retry it.
            raise EngineUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except BaseException as exc:  # any workflow error fails the run, durably
            if not is_code_failure(exc, f"workflow {run.workflow!r} of run {run.id}"):
                raise  # the engine's own unwinding, or a signal's stop (`engine/user_code.py`)
            logger.info("run %s failed: %s", run.id, exc)
            self.lifecycle.finish(run, RunStatus.FAILED, error=error_info(exc), checkpoints=checkpoints)
            return run
        self.lifecycle.finish(run, RunStatus.COMPLETED, output=output, checkpoints=checkpoints)
        return run

    def continue_inline(
        self, run: WorkflowRun, checkpoints: dict[str, StepCheckpoint] | None = None, *, inline: bool = True
    ) -> None:
        """A result is in: take the run's next turn now, in the transaction that recorded it and
        under the lock it holds, instead of queuing a turn for a worker to pick up later. Saves
        a job, a transaction and a replay's worth of reads per step.

        No savepoint around the turn: on PostgreSQL one costs two statements and a round trip on
        every step, and a turn that fails is rare. If it does fail (the engine's own work in it:
        the database, the admission backend), `InlineTurnFailed` rolls the whole transaction
        back, and `record_result` records the result again with `inline=False`, which queues
        the turn (`wake`) instead of taking it here."""
        if run.status not in WAKEABLE:
            return
        if not inline:
            self.waker.wake(run)
            return
        try:
            self.replay(run, checkpoints)
        except EngineUnavailable as exc:
            raise InlineTurnFailed(run.id) from exc
