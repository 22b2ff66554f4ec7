"""Inline handoff: the worker thread whose step result freed a slot runs the step it was granted to.

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
like any step of a dead worker; a live worker that drops it is caught by the heartbeat check
(`REDISPATCH_AFTER_S`). Only one step is accepted per result, so a release that grants several
waiters sends the rest through the transport, to other threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.db import transaction


@dataclass(frozen=True)
class HandedStep:
    """A dispatched step attempt this thread runs next, with no transport task."""

    run_id: str
    step_key: str
    attempt: int


class _Sink:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.taken: list[HandedStep] = []
        self.pending = False  # a dispatch for this thread is in a transaction not committed yet


_local = threading.local()


@contextmanager
def accepting(worker_id: str) -> Iterator[list[HandedStep]]:
    """Within this block (on this thread), the first granted step dispatched is handed to the
    thread as worker `worker_id`; the list holds it once its dispatch has committed."""
    previous = getattr(_local, "sink", None)
    sink = _Sink(worker_id)
    _local.sink = sink
    try:
        yield sink.taken
    finally:
        _local.sink = previous


def taker() -> str:
    """The worker id to dispatch a granted step to inline, or "" to use the transport: a thread
    accepts one step, and only while it records a result (`accepting`)."""
    sink: _Sink | None = getattr(_local, "sink", None)
    if sink is None or sink.taken or sink.pending:
        return ""
    return sink.worker_id


def hand_over(run_id: str, step_key: str, attempt: int) -> None:
    """Hand the step to this thread once the dispatching transaction commits."""
    sink: _Sink | None = getattr(_local, "sink", None)
    if sink is None:
        raise RuntimeError("hand_over() outside accepting(): the step would be dispatched nowhere")
    sink.pending = True

    def committed() -> None:
        sink.taken.append(HandedStep(run_id, step_key, attempt))
        sink.pending = False

    # A rollback discards the callback and leaves `pending` set: a retried dispatch then goes
    # through the transport, which is always safe.
    transaction.on_commit(committed)
