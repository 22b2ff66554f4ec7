"""When a settled step's slot goes back: after its run's inline turn, unless that turn asks for one.

On a backend in the database (`db`) a release takes the queue's lock, which is then held to the
commit: every statement the transaction sends after the release is waited out by every other
decider of the queue. A result's transaction releases the slot and then takes the run's next
turn inline (`TurnsMixin._continue`: the workflow's replay, the run's update), so
releasing first would hold the lock over the whole turn. The release is therefore deferred to the
end of the turn, where the lock spans only the release (and the grant it makes) and the commit.

Deferring must not change what is decided: the turn's first admission (its next step, through
any queue or step-concurrency constraint) releases the slot first (`release_deferred_now`, called
by `DispatchMixin.admit`), so the run's next step finds the slot free exactly as before. If the
turn fails after that, the whole transaction rolls back, the release with it on `db`, and the
result is recorded again with its turn queued, the release made at the end of that try (on `redis`
the first release stands and the second finds the ticket gone: it frees nothing twice).
A backend whose slots are adopted by the executing process (`SLOTS_ADOPTED`: `redis`) also
releases at the end of the turn, before the commit: the step it grants is then dispatched, and
started (its slot adopted), in the result's own transaction, one commit between a result and the
next step instead of three. That is safe for the cap although Redis does not roll back with the
transaction: a result that then fails to commit leaves its attempt dispatched with a slot that is
gone, and the attempt's retry finds it gone (`adopt` is False) and goes back through admission; a
grant whose dispatch rolled back is a waiter holding a slot, which the poller's re-offer
dispatches. Redis unreachable at the release is not the result's failure: the release is made
after the commit instead. A backend outside the database whose slots are not adopted releases
after the commit always (`release_settled`): a slot of its freed before the commit could go to
another step while this one, rolled back, would run again without one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.db import DatabaseError

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
        if not self.admission.RELEASES_IN_TRANSACTION and not self.admission.SLOTS_ADOPTED:
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
            self._release_before_commit(queue, ticket)

    def release_deferred_now(self: Engine) -> None:
        """An admission is about to be decided: give back the deferred slot first."""
        deferred: _Deferred | None = getattr(_local, "deferred", None)
        if deferred is not None and not deferred.released:
            deferred.released = True
            self._release_before_commit(deferred.queue, deferred.ticket)

    def _release_before_commit(self: Engine, queue: str, ticket: str) -> None:
        """Release in the result's transaction; on a backend outside the database, an error of
        the backend (not of the database) moves the release after the commit, where an outage
        is logged once and left to the poller's maintenance (`release_strays`)."""
        if self.admission.RELEASES_IN_TRANSACTION:
            self.release_ticket(queue, ticket)
            return
        try:
            self.release_ticket(queue, ticket)
        except DatabaseError:
            raise  # the transaction is broken: the result is retried, and its slot found gone
        except Exception:  # noqa: BLE001 - any error of the backend's: the result commits all the same
            self.release_settled(queue, ticket)  # after the commit, as a backend outside the database does
        else:
            self.release_outage.recovered()
