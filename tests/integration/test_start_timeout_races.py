"""Start timeouts racing a grant, on `db` and `redis` admission: a call whose deadline passes
at the instant a release grants it a slot either runs (the grant's dispatch reached it first) or
gives up and frees the slot it was just granted, which goes to the next waiter. Never a slot
kept by nobody, never more in flight than the cap.

Two interleavings. Held back by hand (any database): the grant is made in the backend but its
dispatch is held back (`delayed_grants`: the engine's own dispatch, run later), as when the run
is locked by its give-up turn; the give-up runs in between, then the dispatch. Concurrent
(PostgreSQL): the give-up turn holds the run's row lock while another thread records the
holder's result, whose grant then skips the locked run and waits for it after its commit.
Each step waits on an event or on the backend's state, never on a timing margin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import close_old_connections, connection

from durable_flow import register_queue, start
from durable_flow.admission.base import AdmissionBackend
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from tests.conftest import MovableClock, wait_for
from tests.support.held import HeldTransport
from tests.support.redis_keys import delete_keys

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "deadline-race"


@pytest.fixture(params=["db", "redis"])
def stack(request: pytest.FixtureRequest, clock: MovableClock) -> Iterator[tuple[Engine, HeldTransport]]:
    """An engine on the test's clock over real `db` or `redis` admission, steps held."""
    backend: AdmissionBackend
    if request.param == "db":
        backend = DatabaseAdmissionBackend()
    else:
        prefix = f"df:test:{request.node.name[-40:]}:{id(clock)}"
        backend = RedisAdmissionBackend.from_options({"CONNECTION": "default", "KEY_PREFIX": prefix})
    transport = HeldTransport()
    engine = Engine(admission=backend, transport=transport, settings=get_settings(), clock=clock)
    set_engine(engine)
    yield engine, transport
    if isinstance(backend, RedisAdmissionBackend):
        delete_keys(backend.redis, f"{backend.prefix}:*")
        backend.close()


def call(value: str, **options: Any) -> dict[str, Any]:
    return {"queue": QUEUE, "value": value, **options}


def ticket_of(run: WorkflowRun) -> str:
    return StepCheckpoint.objects.get(run=run).ticket


def status_of(run: WorkflowRun) -> str:
    run.refresh_from_db()
    return run.status


def held_tickets(engine: Engine) -> set[str]:
    """Who holds the queue's slots, as the backend says (db: its slot rows; redis: its hash)."""
    if isinstance(engine.admission, RedisAdmissionBackend):
        return set(engine.admission.held_tickets(QUEUE))
    from durable_flow.models import AdmissionSlot

    return set(AdmissionSlot.objects.filter(queue=QUEUE).values_list("ticket", flat=True))


def three_in_line(engine: Engine, clock: MovableClock) -> tuple[WorkflowRun, WorkflowRun, WorkflowRun]:
    """A queue of cap 1: `holder` runs, `impatient` waits with a 30 s start timeout, `patient`
    waits behind it with none."""
    register_queue(QUEUE, concurrency=1)
    holder = start("tests.queued_deadline", call("holder"))
    impatient = start("tests.queued_deadline", call("impatient", start_timeout=30))
    patient = start("tests.queued_deadline", call("patient"))
    assert held_tickets(engine) == {ticket_of(holder)}
    return holder, impatient, patient


class HeldGrants:
    """Grants whose dispatch is held back, and the engine's own dispatch to send them later."""

    def __init__(self, dispatch: Callable[[str, list[str]], None]) -> None:
        self.held: list[tuple[str, str]] = []
        self._dispatch = dispatch

    def dispatch_held(self) -> int:
        """Send the held-back grants now, through the engine's own dispatch; how many."""
        held, self.held = self.held, []
        for queue, ticket in held:
            self._dispatch(queue, [ticket])
        return len(held)


@pytest.fixture
def delayed_grants(stack: tuple[Engine, HeldTransport]) -> Iterator[HeldGrants]:
    """Hold back the dispatch of any grant to a call with a start timeout: the backend grants
    it, the engine dispatches it only when the test says (`HeldGrants.dispatch_held`)."""
    engine, _ = stack
    grants = engine.grants
    own_here, own_after = grants._dispatch_grant_here, grants.dispatch_granted
    delayed = HeldGrants(own_after)

    def impatient(ticket: str) -> bool:
        run_id = ticket.rpartition("/")[0]
        return "start_timeout" in (WorkflowRun.objects.get(pk=run_id).input or {})

    def here(queue: str, ticket: str) -> bool:
        return False if impatient(ticket) else own_here(queue, ticket)

    def after(queue: str, tickets: Any) -> None:
        rest = []
        for ticket in tickets:
            (delayed.held.append((queue, ticket)) if impatient(ticket) else rest.append(ticket))
        own_after(queue, rest)

    grants._dispatch_grant_here, grants.dispatch_granted = here, after  # type: ignore[method-assign]
    yield delayed
    grants._dispatch_grant_here, grants.dispatch_granted = own_here, own_after  # type: ignore[method-assign]


def test_a_call_granted_as_it_gives_up_frees_the_slot_to_the_next_waiter(
    stack: tuple[Engine, HeldTransport], clock: MovableClock, delayed_grants: HeldGrants
) -> None:
    engine, transport = stack
    holder, impatient, patient = three_in_line(engine, clock)
    transport.run_step()  # the holder completes: its release grants the impatient call a slot...
    assert status_of(holder) == RunStatus.COMPLETED
    assert held_tickets(engine) == {ticket_of(impatient)}  # ...whose dispatch has not reached it
    clock.advance(seconds=31)
    assert impatient.id in TimerPoller(engine).tick()  # its deadline: it gives up, slot and all
    assert status_of(impatient) == RunStatus.FAILED
    assert held_tickets(engine) == {ticket_of(patient)}  # the slot went on, and only once
    assert transport.held_runs() == [patient.id]
    assert delayed_grants.dispatch_held() == 1  # the held-back dispatch arrives: it finds nobody waiting
    assert transport.held_runs() == [patient.id]
    assert held_tickets(engine) == {ticket_of(patient)}
    transport.run_step()
    assert status_of(patient) == RunStatus.COMPLETED
    assert held_tickets(engine) == set() and engine.admission.waiting(QUEUE) == 0


def test_a_grant_that_reached_the_call_first_wins_over_its_deadline(
    stack: tuple[Engine, HeldTransport], clock: MovableClock, delayed_grants: HeldGrants
) -> None:
    engine, transport = stack
    _holder, impatient, patient = three_in_line(engine, clock)
    transport.run_step()
    assert delayed_grants.dispatch_held() == 1  # this time the dispatch comes before the deadline's turn
    clock.advance(seconds=31)
    TimerPoller(engine).tick()
    assert transport.held_runs() == [impatient.id]
    assert held_tickets(engine) == {ticket_of(impatient)}
    transport.run_step()
    assert status_of(impatient) == RunStatus.COMPLETED
    assert transport.held_runs() == [patient.id]


def test_a_call_that_gave_up_is_never_granted_afterwards(
    stack: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = stack
    _holder, impatient, patient = three_in_line(engine, clock)
    clock.advance(seconds=31)
    TimerPoller(engine).tick()
    assert status_of(impatient) == RunStatus.FAILED
    assert engine.admission.waiting(QUEUE) == 1
    transport.run_step()  # the holder's release grants the call that was behind
    assert transport.held_runs() == [patient.id]
    assert held_tickets(engine) == {ticket_of(patient)}


def test_a_give_up_and_a_grant_at_once_on_postgresql_keep_the_cap(
    stack: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    """The give-up turn holds the impatient run's row lock while another thread records the
    holder's result: its grant goes to the impatient call in the backend, its dispatch skips the
    locked run and waits for it after the commit; the give-up then frees the granted slot."""
    if connection.vendor != "postgresql":
        pytest.skip("two transactions at once: PostgreSQL (SQLite runs one writer at a time)")
    engine, transport = stack
    holder, impatient, patient = three_in_line(engine, clock)
    clock.advance(seconds=31)
    locked, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def in_thread(work: Callable[[], object]) -> threading.Thread:
        def body() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
            finally:
                close_old_connections()

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    def hold_then_give_up() -> None:
        def hook() -> None:
            locked.set()
            assert go.wait(60)

        engine.run_turn(impatient.id, in_settling_transaction=hook)

    giving_up = in_thread(hold_then_give_up)
    assert locked.wait(60)
    granting = in_thread(transport.run_step)  # the holder's result: grants the impatient call
    wait_for(lambda: ticket_of(impatient) in held_tickets(engine), what="the grant to the locked call")
    go.set()
    giving_up.join(60)
    granting.join(60)
    assert not errors, errors
    assert status_of(holder) == RunStatus.COMPLETED
    assert status_of(impatient) == RunStatus.FAILED
    assert held_tickets(engine) == {ticket_of(patient)}
    assert transport.held_runs() == [patient.id]
    cp = StepCheckpoint.objects.get(run=impatient)
    assert (cp.status, cp.holds_slot, cp.attempt) == (StepStatus.FAILED, False, 0)
