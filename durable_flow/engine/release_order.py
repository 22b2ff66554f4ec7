"""When a settled step's slot goes back: after its run's inline turn, unless that turn asks for one.

On a backend in the database (`db`) a release takes the queue's lock, which is then held to the
commit: every statement the transaction sends after the release is waited out by every other
decider of the queue. A result's transaction releases the slot and then takes the run's next
turn inline (`TurnsMixin._continue`: a savepoint, the workflow's replay, the run's update), so
releasing first would hold the lock over the whole turn. The release is therefore deferred to the
end of the turn, where the lock spans only the release (and the grant it makes) and the commit.

Deferring must not change what is decided: the turn's first admission (its next step, through
any queue or step-concurrency constraint) releases the slot first (`release_deferred_now`, called
by `DispatchMixin.admit`), so the run's next step finds the slot free exactly as before. If the
turn's savepoint rolls back after that, the release went with it, and it is done again at the end.
A backend whose state lives outside the database releases after the commit anyway
(`release_settled`): there nothing is deferred.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from durable_flow.engine.base import EngineBase

if TYPE_CHECKING:
    from durable_flow.engine.core import Engine


@dataclass
class _Deferred:
    queue: str
    ticket: str
    released: bool = False


_local = threading.local()


class ReleaseOrderMixin(EngineBase):
    """The deferred release of a result's slot (see the module's docstring)."""

    @contextmanager
    def release_after_turn(self: Engine, queue: str, ticket: str) -> Iterator[None]:
        """Release `ticket`'s slot when the block (the run's inline turn) ends, or earlier at the
        turn's first admission. Nothing is released if the block raises: its transaction rolls
        back whole."""
        if not self.admission.RELEASES_IN_TRANSACTION:
            self.release_settled(queue, ticket)
            yield
            return
        deferred = _Deferred(queue, ticket)
        outer, _local.deferred = getattr(_local, "deferred", None), deferred
        try:
            yield
        finally:
            _local.deferred = outer
        if not deferred.released:
            self.release_ticket(queue, ticket)

    def release_deferred_now(self: Engine) -> None:
        """An admission is about to be decided: give back the deferred slot first."""
        deferred: _Deferred | None = getattr(_local, "deferred", None)
        if deferred is not None and not deferred.released:
            deferred.released = True
            self.release_ticket(deferred.queue, deferred.ticket)

    @staticmethod
    def deferred_release_undone() -> None:
        """The turn's savepoint rolled back, and a release made inside it with it."""
        deferred: _Deferred | None = getattr(_local, "deferred", None)
        if deferred is not None:
            deferred.released = False
