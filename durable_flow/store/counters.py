"""Persisted counters behind the Prometheus counters: a metric scraped from one web process must
count what every worker process did, so the count lives in the database (`QueueCounter`), not
in process memory.

The engine calls `count_admission(queue)` once per admitted step attempt (`engine/dispatch.py`,
where an attempt holding a slot is dispatched: a direct admission and a grant to a waiter both
pass there), and `count_parked(queue)` once per attempt that joins a queue's waiting line
(`Admitter._park`, when the call is first written as waiting or goes back to waiting). An
attempt that parked and was later granted counts once under each. The increment runs after the
admitting transaction commits, in its own short autocommit UPDATE: a turn that rolls back counts
nothing, and the counter row is locked for one statement only, never for the length of a turn.
A process killed between the commit and the increment loses that one count (an undercount,
never a double count).

In a worker process (`WorkerRuntime`, while it runs) the committed counts go to a background
thread instead (`CountWriter`), which sums what has come in since its last write and writes
each queue's sum in one UPDATE. The worker thread that committed an admission goes straight on
(under contention: to the step a result's release handed it), with no UPDATE of the queue's
counter row, which every thread of every worker shares, between one step's end and the next
start. A worker killed loses the counts not written yet (at most one gathering's worth); a
graceful stop writes them.

Only named queues are counted: a step on no queue (`queue=""`) that step concurrency alone
gates is admitted and parked per key, not per queue, and a `queue=""` series would read as a
queue that does not exist.

Debounce and singleton count the starts they fold, skip or replace (`count_start`, in
`StartCounter`) inside the start's own transaction instead: a start is short and already holds
its key's lock, so the count commits or rolls back with what it counts, without a commit of its own.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from functools import partial
from typing import Literal

from django.db import connections, transaction
from django.db.models import F, Model

from durable_flow.models import QueueCounter, StartCounter

logger = logging.getLogger(__name__)

Decision = Literal["admissions", "parked"]


def count_admission(queue: str) -> None:
    """Count one admission to `queue` once the current transaction commits (at once outside one)."""
    if queue:
        transaction.on_commit(partial(_committed, queue, "admissions"), robust=True)


def count_parked(queue: str) -> None:
    """Count one attempt parked in `queue`'s line once the current transaction commits."""
    if queue:
        transaction.on_commit(partial(_committed, queue, "parked"), robust=True)


def _committed(queue: str, column: Decision) -> None:
    writer = _writer
    if writer is not None and writer.add(queue, column, 1):
        return
    add_count(queue, column, 1)


class CountWriter:
    """Writes committed counts from a daemon thread, summed per queue and column since its last
    write: one UPDATE per queue per write, off the threads that run turns and steps. A write
    waits `gather_s` after the first count it carries: a count is taken as a result commits,
    the moment the thread that committed starts its handed step, and a write at that instant
    takes the interpreter from it, delaying that step's start on every handoff."""

    def __init__(self, gather_s: float = 0.2) -> None:
        self.gather_s = gather_s
        self._pending: Counter[tuple[str, Decision]] = Counter()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="df-counts", daemon=True)
                self._thread.start()

    def add(self, queue: str, column: Decision, count: int) -> bool:
        """Take a count to write; False once stopping (the caller writes it itself)."""
        with self._cond:
            if self._thread is None or self._stopping:
                return False
            self._pending[(queue, column)] += count
            self._cond.notify()
            return True

    def stop(self) -> None:
        """Write what is pending and end the thread."""
        with self._cond:
            self._stopping = True
            thread, self._thread = self._thread, None
            self._cond.notify()
        if thread is not None:
            thread.join(timeout=30)

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._stopping:
                        self._cond.wait()
                    self._cond.wait_for(lambda: self._stopping, timeout=self.gather_s)
                    batch, self._pending = self._pending, Counter()
                    stopping = self._stopping
                self._write(batch)
                if stopping:
                    return
        finally:
            connections.close_all()  # this thread's own connections

    @staticmethod
    def _write(batch: Counter[tuple[str, Decision]]) -> None:
        for (queue, column), count in sorted(batch.items()):
            try:
                add_count(queue, column, count)
            except Exception:  # the database is down: those counts are lost (an undercount)
                logger.exception("could not write %d %s count(s) of queue %r", count, column, queue)
                connections.close_all()  # reopened on the next write


_writer: CountWriter | None = None
_writer_users = 0
_writer_lock = threading.Lock()


def start_background_writes() -> None:
    """Write this process's committed counts from a background thread until the matching
    `stop_background_writes()` (a worker's run; nested calls share one thread)."""
    global _writer, _writer_users
    with _writer_lock:
        _writer_users += 1
        if _writer is None:
            _writer = CountWriter()
            _writer.start()


def stop_background_writes() -> None:
    """The last user's stop writes what is pending and goes back to writing at each commit."""
    global _writer, _writer_users
    with _writer_lock:
        _writer_users = max(0, _writer_users - 1)
        writer = _writer if _writer_users == 0 else None
        if writer is not None:
            _writer = None
    if writer is not None:
        writer.stop()


def add_count(queue: str, column: Decision, count: int) -> None:
    """Add `count` to `queue`'s `column`: one UPDATE, plus an INSERT the first time."""
    _increment(QueueCounter, {"queue": queue}, column, count)


def _increment(model: type[Model], row: dict[str, str], column: str, count: int) -> None:
    """Add `count` to `column` of the counter row `row` identifies, creating the row first if
    it is missing (concurrent creators: the constraint keeps one, each UPDATE adds once)."""
    rows = model.objects.filter(**row)  # type: ignore[attr-defined]
    if rows.update(**{column: F(column) + count}):
        return
    model.objects.bulk_create([model(**row)], ignore_conflicts=True)  # type: ignore[attr-defined]
    rows.update(**{column: F(column) + count})


def count_start(workflow: str, outcome: str) -> None:
    """Count one start that debounce or singleton handled without creating a run (`debounced`,
    `skipped`) or by cancelling the key's run (`replaced`), in the start's own transaction: it
    already holds the key's lock and is short, so the count commits (or rolls back) with what it
    counts, at no extra commit."""
    _increment(StartCounter, {"workflow": workflow, "outcome": outcome}, "starts", 1)


def start_outcomes() -> dict[tuple[str, str], int]:
    """Every `(workflow, outcome)` start count so far."""
    return {(w, o): n for w, o, n in StartCounter.objects.values_list("workflow", "outcome", "starts")}


def admissions() -> dict[str, int]:
    """Every queue's admissions so far."""
    return dict(QueueCounter.objects.values_list("queue", "admissions"))


def decisions() -> dict[str, dict[str, int]]:
    """Every queue's counts so far: `{queue: {"admitted": n, "parked": m}}`."""
    return {
        queue: {"admitted": admitted, "parked": parked}
        for queue, admitted, parked in QueueCounter.objects.values_list("queue", "admissions", "parked")
    }
