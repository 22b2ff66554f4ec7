"""The `db` transport's leases across a database outage.

While the database is away no worker can renew its leases, so once it is back a lapsed lease may
be a live worker's whose task still runs: taking it would run the task twice at once (past its
queue's cap). A worker takes a lapsed lease only after it has had the database for a whole lease
since it started or rode out an outage (`DatabaseTaskSource.outage_seen`); a task the poller gave
up (`reclaim_from`, its worker's heartbeat lapsed) is unclaimed and taken at once.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import OperationalError
from django.utils import timezone

from durable_flow import start
from durable_flow.models import Task
from durable_flow.runtime.controllers import build_controller
from durable_flow.runtime.worker import WorkerRuntime
from durable_flow.testing.clock import FakeMonotonic
from durable_flow.transports.db.transport import DatabaseTaskSource, DatabaseTransport
from durable_flow.transports.runner import ClaimedTask
from tests.conftest import MovableClock, local_engine

LEASE_S = 60.0

pytestmark = pytest.mark.django_db(transaction=True)


def lapse(task_id: int) -> None:
    """The lease ran out while the database was away (nobody could renew it)."""
    Task.objects.filter(pk=task_id).update(lease_until=timezone.now() - timedelta(seconds=1))


@pytest.mark.parametrize("renewed", [True, False])
def test_after_an_outage_a_lapsed_lease_waits_one_lease_for_its_worker_to_renew_it(
    clock: MovableClock, renewed: bool
) -> None:
    local_engine(clock, DatabaseTransport(visibility_timeout_s=LEASE_S))
    start("tests.three_steps", 1)
    monotonic = FakeMonotonic()
    live = DatabaseTaskSource(LEASE_S, 0.1, monotonic=monotonic)
    other = DatabaseTaskSource(LEASE_S, 0.1, monotonic=monotonic)
    [task] = live.claim("live-w", 1, 0)
    lapse(task.handle)
    other.outage_seen()  # its claims failed while the database was away, and succeed again
    assert other.claim("other-w", 1, 0) == []
    monotonic.now += LEASE_S / 2
    if renewed:
        live.renew("live-w", [task])  # the live worker's heartbeat, once the database is back
    assert other.claim("other-w", 1, 0) == []
    monotonic.now += LEASE_S / 2  # a whole lease since the outage: a lease still lapsed is a dead worker's
    taken = [t.handle for t in other.claim("other-w", 1, 0)]
    assert taken == ([] if renewed else [task.handle])
    assert Task.objects.get(pk=task.handle).claimed_by == ("live-w" if renewed else "other-w")


def test_a_task_the_poller_gave_up_is_taken_at_once_even_after_an_outage(clock: MovableClock) -> None:
    transport = DatabaseTransport(visibility_timeout_s=LEASE_S)
    local_engine(clock, transport)
    start("tests.three_steps", 1)
    monotonic = FakeMonotonic()
    dead = DatabaseTaskSource(LEASE_S, 0.1, monotonic=monotonic)
    other = DatabaseTaskSource(LEASE_S, 0.1, monotonic=monotonic)
    [task] = dead.claim("dead-w", 1, 0)
    other.outage_seen()
    assert transport.reclaim_from(["dead-w"]) == 1  # its heartbeat lapsed a TTL after the poller's grace
    assert [t.handle for t in other.claim("other-w", 1, 0)] == [task.handle]


def test_a_dead_worker_turn_whose_run_has_a_turn_queued_is_dropped_not_doubled(clock: MovableClock) -> None:
    transport = DatabaseTransport(visibility_timeout_s=LEASE_S)
    local_engine(clock, transport)
    run = start("tests.three_steps", 1)
    [task] = DatabaseTaskSource(LEASE_S, 0.1).claim("dead-w", 1, 0)
    transport.enqueue_turn(run.id)  # a turn for the same run queued meanwhile (e.g. a wake)
    assert transport.reclaim_from(["dead-w"]) == 1
    assert list(Task.objects.filter(run_id=run.id).values_list("kind", "claimed_by")) == [("turn", None)]
    assert not Task.objects.filter(pk=task.handle).exists()


class RefusedOnce(DatabaseTaskSource):
    """The real source, whose database refuses one claim (an outage, as the worker sees it) a
    whole lease after the worker started."""

    def __init__(self, monotonic: FakeMonotonic) -> None:
        super().__init__(LEASE_S, 0.1, monotonic=monotonic)
        self.monotonic = monotonic
        self.refused = False

    def claim(self, worker_id: str, limit: int, wait_s: float) -> list[ClaimedTask]:
        if not self.refused:
            self.refused = True
            self.monotonic.now += LEASE_S  # the start's own grace is over
            raise OperationalError("terminating connection due to administrator command")
        return super().claim(worker_id, limit, wait_s)


def test_a_worker_that_rode_out_an_outage_leaves_a_lapsed_lease_to_its_worker(clock: MovableClock) -> None:
    engine = local_engine(clock, DatabaseTransport(visibility_timeout_s=LEASE_S))
    start("tests.three_steps", 1)
    [task] = DatabaseTaskSource(LEASE_S, 0.1).claim("live-w", 1, 0)
    lapse(task.handle)
    source = RefusedOnce(FakeMonotonic())
    WorkerRuntime(engine, source, build_controller(1), idle_wait_s=0.01).run(burst=True)
    assert source.refused
    assert Task.objects.get(pk=task.handle).claimed_by == "live-w"  # not taken in the lease after the outage
