"""Optimistic first turns: a run's first step runs before anything is written, and is recorded
with its result, in the transaction that takes the run's next turn.

A run's first turn, claimed by a worker that accepts its step (`EAGER_STEPS`), normally costs
two transactions: the turn (lock the run, write the step's checkpoint as dispatched and its
running attempt, mark the run running), then, after the step, the result (lock the run again,
settle the checkpoint and the attempt, take the next turn inline). DBOS records a step only
once it has returned; this does the same for that one step: the turn replays the workflow
without the run's lock, and when its first call is a plain step (no queue, no step
concurrency, no timeout, not a fan-out) the thread runs it at once; then one transaction locks
the run, checks that nothing took the turn meanwhile (the run is still pending with no turn
taken), writes the checkpoint and its attempt as they ended, and takes the next turn inline.
Anything else the replay reaches (a sleep, a signal, a child, a queued step, the workflow
returning or raising) leaves the turn to the locked path, which replays it again.

`OPTIMISTIC_FIRST_STEP`: on the `rq` transport, on by default with `EAGER_STEPS` (a turn job's
first delivery: RQ has not stamped its `started_at`); on the `db` transport, on by default (a
turn task's first claim: `Task.deliveries` is 1), its task row deleted in the transaction that
records the step. What it costs:
- While the step runs, the run's rows do not say so: the run reads `pending` with no
  checkpoint; only the worker's heartbeat lists it (told through `on_step`), and the run's
  pages and the poller read it there (`queries.running_steps`: "Executing now", and no turn
  sent again for a pending run whose first step a live worker runs).
- A crash mid-step leaves no attempt behind. The turn's job (task row) is still the
  transport's, so it is run again (the poller re-queues a dead worker's jobs and gives up its
  task rows; a lapsed lease is taken again); a turn delivered a second time takes the
  locked path, so a step that kills its process is recorded as dispatched there and is bounded
  by its retries like any step, instead of crashing the worker forever.
- Two deliveries of one turn at once may both run the step (a step is at-least-once anyway):
  the first result to lock the run is recorded, the other is dropped.
- A probe that finds nothing to run (the first call is a queued step, a sleep...; the turn is
  not the run's first) cost an unlocked read and a partial replay for nothing (`bench/peer_dbos.py`
  measures it). `ProbeGate` stops probing every first delivery once many probes in a row found
  nothing, and resumes on a find.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import DataError, transaction

from durable_flow.definitions.current import running_step
from durable_flow.definitions.registry import WorkflowDefinition, get_step, get_workflow, step_backoff
from durable_flow.definitions.serialization import ensure_json, error_info, readable
from durable_flow.definitions.step_concurrency import constraints_of
from durable_flow.engine.context import WorkflowContext
from durable_flow.engine.locking import retry_on_conflict
from durable_flow.engine.turn import InlineTurnFailed, StepOptions, Unwind
from durable_flow.engine.user_code import is_code_failure
from durable_flow.engine.wait_causes import backoff
from durable_flow.exceptions import DurableFlowError
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.store import metric_counts
from durable_flow.store.attempts import attempt_finished
from durable_flow.store.statements import (
    insert,
    insert_held,
    lock_run_drawing_id,
    read_run,
    save_fields,
    writes_together,
)

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.config.settings import DurableFlowSettings
    from durable_flow.engine.base import Clock
    from durable_flow.engine.dispatch import Dispatcher
    from durable_flow.engine.turns import Turns

logger = logging.getLogger("durable_flow.engine")


class _FirstStep(Unwind):
    """The probe's replay reached a plain step: run it (`cp`, unsaved)."""

    def __init__(self, cp: StepCheckpoint) -> None:
        super().__init__(cp.key)
        self.cp = cp


class _NotOptimistic(Unwind):
    """The probe's replay reached a call that must be written first: take the locked path.
    An `Unwind`, like `Suspend`, so a workflow's `except Exception` lets it through."""


class _Probe:
    """The engine as a probing replay's `ctx` sees it (`turn.TurnEngine`): a plain step's call
    stops the replay with the step in hand; every other call stops it too, before anything is
    written."""

    def __init__(self, dispatcher: Dispatcher, admission: AdmissionBackend, clock: Clock) -> None:
        self._dispatcher = dispatcher
        self._admission = admission
        self._clock = clock

    def now(self) -> datetime:
        return self._clock()

    def create_step_checkpoint(self, run: WorkflowRun, **call: Any) -> StepCheckpoint:
        """The engine's (unsaved) checkpoint, unless the call is a fan-out's wave or a step with a
        timeout (the poller must be able to time it out: it needs the dispatch written)."""
        options: StepOptions = call["options"]
        if call["group"] or options.timeout is not None or call["step"].timeout is not None:
            raise _NotOptimistic
        return self._dispatcher.create_step_checkpoint(run, **call)

    def admit(self, cp: StepCheckpoint, options: StepOptions | None = None) -> bool:
        gated = bool(cp.queue) and self._admission.handles(cp.queue)
        if gated or constraints_of(cp.run.step_concurrency):
            raise _NotOptimistic  # admission decides, and a slot is written down
        return True

    def give_up(self, cp: StepCheckpoint) -> bool:
        raise _NotOptimistic  # a first turn has no call in line to give up

    def dispatch(self, cp: StepCheckpoint, **_: Any) -> None:
        raise _FirstStep(cp)

    # The calls that write before anything waits (a sleep's or a signal wait's checkpoint, a
    # due sleep settled, a signal consumed, a child started): the locked path takes them.
    def create_checkpoint(self, run: WorkflowRun, **fields: Any) -> StepCheckpoint:
        raise _NotOptimistic

    def settle(self, cp: StepCheckpoint, status: str, output: Any = None, error: Any = None) -> None:
        raise _NotOptimistic

    def consume_signal(self, run: WorkflowRun, name: str, key: str) -> Any:
        raise _NotOptimistic

    def find_event(self, name: str, match: Any, began: datetime, event: Any) -> Any:
        raise _NotOptimistic

    def start_child(self, parent: WorkflowRun, **call: Any) -> StepCheckpoint:
        raise _NotOptimistic


class ProbeGate:
    """Whether a turn's first delivery is worth a probe, from how the last probes of this
    process went: after `misses_to_thin` probes in a row that found nothing to run, only one
    first delivery in `thinned_every` is probed; the first probe that finds a plain first step
    probes every one again. A skipped probe is the locked path, which is always correct: this
    only decides where an unlocked read is likely to pay for itself. Shared by a process's
    worker threads (a lock keeps the counts whole)."""

    def __init__(self, misses_to_thin: int = 32, thinned_every: int = 16) -> None:
        self.misses_to_thin = misses_to_thin
        self.thinned_every = thinned_every
        self._misses = 0
        self._skipped = 0
        self._lock = threading.Lock()

    def should_probe(self) -> bool:
        with self._lock:
            if self._misses < self.misses_to_thin:
                return True
            self._skipped += 1
            if self._skipped >= self.thinned_every:
                self._skipped = 0
                return True
            return False

    def record(self, found: bool) -> None:
        with self._lock:
            self._misses = 0 if found else self._misses + 1


@dataclass
class _Ran:
    """What the optimistic step did."""

    cp: StepCheckpoint
    started_at: datetime
    output: Any = None
    error: dict[str, Any] | None = None


class FirstTurns:
    """A run's first turn and first step, written once, with the step's result. Owns the
    probe gate."""

    def __init__(
        self,
        settings: DurableFlowSettings,
        admission: AdmissionBackend,
        clock: Clock,
        dispatcher: Dispatcher,
        turns: Turns,
    ) -> None:
        """`dispatcher` builds the probed step's checkpoint; `turns` takes the run's next turn
        once the step is recorded."""
        self.settings = settings
        self.admission = admission
        self.clock = clock
        self.dispatcher = dispatcher
        self.turns = turns
        self.probe_gate = ProbeGate()

    def run_first_turn(
        self,
        run_id: str,
        worker_id: str,
        *,
        on_step: Callable[[str], object] | None = None,
        in_settling_transaction: Callable[[], object] | None = None,
    ) -> str | None:
        """Take a run's first turn optimistically (see the module's docstring). Returns the
        run's status afterwards, or None when this turn must take the locked path (nothing was
        written, `in_settling_transaction` was not called, and the step, if any, did not run). `on_step` gets the
        step's key right before it runs (the worker lists it as running in its heartbeat);
        `in_settling_transaction` runs in the transaction that records the step, as in `run_turn`'s (the `db`
        source deletes its task row there). Probed as `probe_gate` says (see `ProbeGate`)."""
        if not self.probe_gate.should_probe():
            return None
        cp = self._probe_first_call(run_id)
        self.probe_gate.record(found=cp is not None)
        if cp is None:
            return None
        if on_step is not None:
            on_step(cp.key)
        ran = self._run_first_step(cp, worker_id)
        return self._record_first_step(run_id, ran, in_settling_transaction)

    def _probe_first_call(self, run_id: str) -> StepCheckpoint | None:
        """The run's first call (unsaved) when it is a plain step and this is the run's first
        turn (the run pending, no turn taken), read without the run's lock; else None."""
        run = read_run(run_id)
        if run is None or run.status != RunStatus.PENDING or run.turns:
            return None
        definition = self._probe_definition(run)
        return None if definition is None else self._probe(run, definition)

    def _probe_definition(self, run: WorkflowRun) -> WorkflowDefinition | None:
        try:
            definition = get_workflow(run.workflow)
        except DurableFlowError:
            return None  # the locked path fails the run
        return definition if definition.version == run.version else None

    def _probe(self, run: WorkflowRun, definition: WorkflowDefinition) -> StepCheckpoint | None:
        """Replay the workflow up to its first call, writing nothing: that call's checkpoint
        (unsaved) when it is a plain step, else None."""
        ctx = WorkflowContext(_Probe(self.dispatcher, self.admission, self.clock), run, {})
        try:
            definition.fn(ctx, readable(run.input, f"input of run {run.id!r}"))
        except _FirstStep as first:
            return first.cp
        except _NotOptimistic:
            return None
        except BaseException as exc:  # the locked path records the workflow's error
            if not is_code_failure(exc):
                raise
            return None
        return None  # finished without a call: the locked path records the output

    def _run_first_step(self, cp: StepCheckpoint, worker_id: str) -> _Ran:
        """Run attempt 1 of the step on this thread, as `execute_step` runs a claimed one."""
        now = self.clock()
        cp.attempt, cp.status, cp.dispatched_at, cp.worker = 1, StepStatus.DISPATCHED, now, worker_id
        ran = _Ran(cp=cp, started_at=now)
        try:
            definition = get_step(cp.name)
            step_input = json.loads(json.dumps(cp.input))  # what the step would read back: JSON
            with running_step(cp.run_id, cp.key, 1):
                ran.output = definition.fn(step_input)
            ensure_json(ran.output, f"output of step {cp.name!r}", self.settings.max_payload_bytes)
        except BaseException as exc:  # a step's failure is data, recorded durably
            if not is_code_failure(exc, f"step {cp.name!r} of run {cp.run_id} (attempt 1)"):
                raise  # nothing was written: the turn's task is run again
            ran.output, ran.error = None, error_info(exc)
        return ran

    def _record_first_step(
        self, run_id: str, ran: _Ran, in_settling_transaction: Callable[[], object] | None = None
    ) -> str:
        """Record the step as it ended, with the first turn, then take the next turn inline; if
        that turn fails, record again with the turn queued (as `record_result` does). A result
        the database refuses (a value it cannot store) is recorded as the attempt's failure,
        with the turn queued. The checkpoint's INSERT is held back to the transaction's last
        round trip on PostgreSQL, so a refusal may come out of the inline turn (as its failure)
        or at the write's end: either way each retry is taken once."""
        inline = True
        while True:
            try:
                return self._write_first_step(
                    run_id, ran, inline=inline, in_settling_transaction=in_settling_transaction
                )
            except InlineTurnFailed as failed:
                logger.warning("run %s: inline turn failed (%s); queuing it instead", run_id, failed.__cause__)
            except DataError as exc:
                if ran.error is not None:
                    raise
                ran.output, ran.error = None, error_info(exc)
            inline = False

    @retry_on_conflict
    def _write_first_step(
        self, run_id: str, ran: _Ran, *, inline: bool, in_settling_transaction: Callable[[], object] | None = None
    ) -> str:
        with transaction.atomic(), writes_together():
            run, drawn_id = lock_run_drawing_id(run_id, StepCheckpoint)
            if in_settling_transaction is not None:
                # The turn's task is done whatever this finds: recorded, or answered by another.
                in_settling_transaction()
            if run is None:
                return "missing"
            if run.status != RunStatus.PENDING or run.turns:
                # Cancelled meanwhile, or another delivery of this turn took it first: that one
                # answers for the run, and this attempt's result is dropped.
                logger.info("run %s moved on (%s) while its first step ran; its result is dropped", run_id, run.status)
                return str(run.status)
            cp = ran.cp
            cp.run = run
            run.turns = 1  # the turn that dispatched the step; the inline turn below is the second
            retrying = ran.error is not None and cp.attempt < cp.max_attempts
            now = self.clock()
            if retrying:
                cp.status, cp.error = StepStatus.RETRYING, ran.error
                metric_counts.count(metric_counts.STEP_RETRIES, {"step": cp.name})
                cp.wake_at = now + step_backoff(cp.name, cp.attempt)
                cp.wait_cause, cp.wait_detail = backoff(cp.wake_at)
            else:
                cp.status = StepStatus.FAILED if ran.error is not None else StepStatus.COMPLETED
                cp.output, cp.error, cp.wake_at, cp.finished_at = ran.output, ran.error, None, now
            if drawn_id is None:
                insert(cp)
            else:  # sent with the attempt and the run's writes, in the transaction's last round trip
                cp.pk = drawn_id
                insert_held(cp)
            attempt_finished(
                cp,
                cp.attempt,
                now,
                error=ran.error,
                cancelled=False,
                late=False,
                worker=cp.worker,
                started_at=ran.started_at,
                retry_at=cp.wake_at if retrying else None,
            )
            run.status = RunStatus.RUNNING  # what the dispatching turn would have left
            if not inline:
                save_fields(run, ["status", "turns", "updated_at"])  # so `wake` finds it parked
            self.turns.continue_inline(run, {cp.key: cp}, inline=inline)
            return str(run.status)
