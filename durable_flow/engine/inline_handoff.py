"""Inline handoff: a worker thread runs next the step its own transaction dispatched.

Two cases. A slot freed by a step's result is granted to a waiter, and the thread that recorded
the result runs that waiter's step (below). A run's turn that dispatches a step (its first
admitted call, on a worker) hands it to the thread that ran the turn: a one-step workflow then
costs one claim, not two, and no step task row is written or deleted (`accepting(turns=True)`).

Under contention most slots are freed by a step's result, recorded in a worker thread. Sending
the granted step through the transport from there costs a hop per handoff (an enqueue, a claim
that may wait for the `db` transport's poll, another thread picking it up), which is most of the
gap between one step's end and the next start in its slot. So while a worker thread records a
result it *accepts* one granted step: the grant's dispatch is recorded as usual, in its own
transaction (the checkpoint says `dispatched`, stamped with this worker's id), but no transport
task is sent; once that transaction commits the step is handed to the thread, which runs it
next as if it had claimed it.

Durability is the dispatch's, not the transport's: a worker that dies before or while running
the handed step leaves a `dispatched` checkpoint stamped with its id, which the poller re-drives
like any step of a dead worker; a live worker whose engine fails on it (a deadlock, a dropped
connection) sends it through the transport at once as a new attempt (`WorkerRuntime`), and one
that drops it otherwise is caught by the heartbeat check (`REDISPATCH_AFTER_S`). Only one step
is accepted per result or turn, so a release that grants several waiters, or a turn that
dispatches a fan-out, sends the rest through the transport, to other threads.

A handed step starts in the transaction that dispatched it: its `StepAttempt` row is written
there (`running`, this worker, started now) and the handed step carries its checkpoint, so the
thread runs it with no start statement (`dispatched`); a step that holds a slot still has its
rate window count the start right before the call. On a backend whose slots follow a live
process (`SLOTS_ADOPTED`: `redis`) the dispatching transaction adopts the slot before it
writes the start (a slot already gone leaves the step to start as a claimed one does, where its
adoption fails and it goes back through admission).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django.db import transaction

if TYPE_CHECKING:
    from durable_flow.models import StepCheckpoint


@dataclass(frozen=True)
class HandedStep:
    """A dispatched step attempt this thread runs next, with no transport task."""

    run_id: str
    step_key: str
    attempt: int
    #: The checkpoint as dispatched, when the attempt was started in the dispatching
    #: transaction (no slot to adopt): the thread runs it without reading it back.
    dispatched: StepCheckpoint | None = field(default=None, repr=False)


class _Sink:
    def __init__(self, worker_id: str, turns: bool) -> None:
        self.worker_id = worker_id
        self.turns = turns
        self.taken: list[HandedStep] = []
        self.pending = False  # a dispatch for this thread is in a transaction not committed yet


_local = threading.local()


@contextmanager
def accepting(worker_id: str, *, turns: bool = False) -> Iterator[list[HandedStep]]:
    """Within this block (on this thread), the first granted step dispatched is handed to the
    thread as worker `worker_id` (with `turns`, a step a turn dispatches too); the list holds
    it once its dispatch has committed."""
    previous = getattr(_local, "sink", None)
    sink = _Sink(worker_id, turns)
    _local.sink = sink
    try:
        yield sink.taken
    finally:
        _local.sink = previous


def taker(*, turn: bool = False) -> str:
    """The worker id to dispatch a step to inline, or "" to use the transport: a thread accepts
    one step, and only while it records a result or (`turn`: a turn's dispatch) runs a turn
    that accepts them (`accepting`).

    A result's inline turn does not hand the run's next step to its thread: that thread takes
    the step its result's release grants instead, and a run's steps in a row would otherwise
    hold one thread for the whole run."""
    sink: _Sink | None = getattr(_local, "sink", None)
    if sink is None or sink.taken or sink.pending or (turn and not sink.turns):
        return ""
    return sink.worker_id


def hand_over(run_id: str, step_key: str, attempt: int, dispatched: StepCheckpoint | None = None) -> None:
    """Hand the step to this thread once the dispatching transaction commits."""
    sink: _Sink | None = getattr(_local, "sink", None)
    if sink is None:
        raise RuntimeError("hand_over() outside accepting(): the step would be dispatched nowhere")
    sink.pending = True

    def committed() -> None:
        sink.taken.append(HandedStep(run_id, step_key, attempt, dispatched))
        sink.pending = False

    # A rollback discards the callback and leaves `pending` set: a retried dispatch then goes
    # through the transport, which is always safe.
    transaction.on_commit(committed)
