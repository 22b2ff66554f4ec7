"""Releases: when a settled call's slot (or place in line) goes back to its queue.

A call that a transaction settles or withdraws (a result, a retry, a cancel, a run's end) gives
its ticket back through `Releases.release_settled`: in the transaction on a backend in the
database, after the commit on one outside it, so an outage of that backend cannot roll the
caller's transaction back. A completed or failed step's slot goes back after its run's inline
turn, unless that turn asks for one, as follows.

On a backend in the database (`db`) a release takes the queue's lock, which is then held to the
commit: every statement the transaction sends after the release is waited out by every other
decider of the queue. A result's transaction releases the slot and then takes the run's next
turn inline (`Turns.continue_inline`: the workflow's replay, the run's update), so
releasing first would hold the lock over the whole turn. The release is therefore deferred to the
end of the turn, where the lock spans only the release (and the grant it makes) and the commit.

Deferring must not change what is decided: the turn's first admission (its next step, through
any queue or step-concurrency constraint) releases the slot first (`release_deferred_now`, called
by `Admitter.admit`), so the run's next step finds the slot free exactly as before. If the
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

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from django.db import DatabaseError, transaction

from durable_flow.store.outage import Outage, transient_errors

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.engine.handoff import Grants

logger = logging.getLogger("durable_flow.engine")


@dataclass
class _Deferred:
    queue: str
    ticket: str
    released: bool = False


class Releases:
    """Gives back the slots (and places in line) of the calls a transaction settles, at the
    moment the backend allows (see the module's docstring). Owns the deferred release of this
    thread's result and the outage log of releases after commit."""

    def __init__(self, admission: AdmissionBackend, grants: Grants) -> None:
        """`grants` frees a ticket and hands its room on (`release_ticket`, `release_stray`)."""
        self.admission = admission
        self.grants = grants
        self._local = threading.local()
        #: Releases after commit that failed because the admission backend was unreachable:
        #: logged once per outage.
        self.outage = Outage("admission: releasing settled steps' slots", logger)

    @contextmanager
    def release_after_turn(self, queue: str, ticket: str) -> Iterator[None]:
        """Release `ticket`'s slot when the block (the run's inline turn) ends, or earlier at the
        turn's first admission. Nothing is released if the block raises: its transaction rolls
        back whole."""
        if not self.admission.RELEASES_IN_TRANSACTION and not self.admission.SLOTS_ADOPTED:
            self.release_settled(queue, ticket)
            yield
            return
        deferred = _Deferred(queue, ticket)
        outer, self._local.deferred = getattr(self._local, "deferred", None), deferred
        try:
            yield
        finally:
            self._local.deferred = outer
        if not deferred.released:
            self._release_before_commit(queue, ticket)

    def release_deferred_now(self) -> None:
        """An admission is about to be decided: give back the deferred slot first."""
        deferred: _Deferred | None = getattr(self._local, "deferred", None)
        if deferred is not None and not deferred.released:
            deferred.released = True
            self._release_before_commit(deferred.queue, deferred.ticket)

    def _release_before_commit(self, queue: str, ticket: str) -> None:
        """Release in the result's transaction; on a backend outside the database, an error of
        the backend (not of the database) moves the release after the commit, where an outage
        is logged once and left to the poller's maintenance (`release_strays`)."""
        if self.admission.RELEASES_IN_TRANSACTION:
            self.grants.release_ticket(queue, ticket)
            return
        try:
            self.grants.release_ticket(queue, ticket)
        except DatabaseError:
            raise  # the transaction is broken: the result is retried, and its slot found gone
        except Exception:  # noqa: BLE001 - any error of the backend's: the result commits all the same
            self.release_settled(queue, ticket)  # after the commit, as a backend outside the database does
        else:
            self.outage.recovered()

    def release_settled(self, queue: str, ticket: str, *, guarded: bool = False) -> None:
        """Free the ticket of a call this transaction settles (its slot, or its place in line):
        now on a backend in the database (which grants it on with this transaction), else once
        this commits, so the backend being down cannot roll the caller's transaction back. A
        cancel uses it too, so it succeeds while Redis is down: a slot it could not free is the
        maintenance's (`release_strays`), a place in line is handed on when it is granted.
        `guarded`: the ticket may be re-admitted before the commit's callback runs (a retry), so
        that release re-checks the checkpoint first."""
        if self.admission.RELEASES_IN_TRANSACTION:
            self.grants.release_ticket(queue, ticket)
        else:
            transaction.on_commit(partial(self._release_after_commit, queue, ticket, guarded))

    def _release_after_commit(self, queue: str, ticket: str, guarded: bool) -> None:
        """Release a settled step's slot on a backend outside the database. It must not fail
        the caller (its result is recorded): a backend outage is logged once and the slot left
        to the poller's maintenance (`release_strays`)."""
        try:
            if guarded:
                self.grants.release_stray(queue, ticket)
            else:
                self.grants.release_ticket(queue, ticket)
        except transient_errors() as exc:
            self.outage.failed(exc)
        except Exception:  # the result is committed; the repair frees the slot
            logger.exception("releasing %s on queue %r failed; the poller's maintenance frees it", ticket, queue)
        else:
            self.outage.recovered()
