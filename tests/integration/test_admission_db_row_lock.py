"""PostgreSQL: the `db` backend hands a slot on and joins a full line without the queue's row lock.

A release with somebody in line swaps its slot for the next waiter's (the number of slots held
never changes) and a call that finds a queue full joins its line under a share lock of the row,
so neither waits for the other, nor for a decision holding the row. Each verdict waits on
events or on the server's lock table, never on a timing margin: a statement that must not wait
for the row runs under a `lock_timeout` far longer than it needs, in a transaction the test
holds open as long as it likes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.db import connection, transaction

from durable_flow.admission.base import AdmissionRequest
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.models import AdmissionSlot, AdmissionWaiter, FlowQueue

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "row-lock"


@pytest.fixture(autouse=True)
def _postgresql_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks and share locks: PostgreSQL")


def backend_with(config: QueueConfig) -> DatabaseAdmissionBackend:
    FlowQueue.objects.create(name=config.name, config=config.as_dict())
    return DatabaseAdmissionBackend()


def admit(backend: DatabaseAdmissionBackend, ticket: str, key: str = "") -> bool:
    with transaction.atomic():
        return backend.try_admit(AdmissionRequest(queue=QUEUE, ticket=ticket, fairness_key=key)).admitted


def holders() -> set[str]:
    return set(AdmissionSlot.objects.filter(queue=QUEUE).values_list("ticket", flat=True))


def waiters() -> set[str]:
    return set(AdmissionWaiter.objects.filter(queue=QUEUE).values_list("ticket", flat=True))


@contextmanager
def held_elsewhere(lock: Callable[[], object]) -> Iterator[None]:
    """`lock()` run in a transaction of another connection, held open until the block ends."""
    taken, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                lock()
                taken.set()
                done.wait(60)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            taken.set()
        finally:
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert taken.wait(60), "the other transaction never took its lock"
        assert not errors, errors
        yield
    finally:
        done.set()
        thread.join(60)
    assert not errors, errors


def no_wait_for_locks() -> None:
    """In this transaction, a statement that waits for a lock fails after 20 s (instead of
    waiting): long enough for any busy host, short enough to fail on the old path."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL lock_timeout = '20s'")


def lock_row(mode: str) -> Callable[[], object]:
    def lock() -> object:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM durable_flow_flowqueue WHERE name = %s FOR {mode}", [QUEUE])
            return cursor.fetchall()

    return lock


def test_a_release_hands_its_slot_to_the_next_waiter_while_another_transaction_holds_the_queue_row() -> None:
    backend = backend_with(QueueConfig(name=QUEUE, concurrency=1))
    assert admit(backend, "a/1")
    assert not admit(backend, "b/1")

    with held_elsewhere(lock_row("UPDATE")), transaction.atomic():
        no_wait_for_locks()
        granted = backend.release(QUEUE, "a/1")

    assert granted.tickets == ("b/1",)
    assert holders() == {"b/1"}
    assert waiters() == set()


def test_a_call_joins_a_full_line_while_another_call_joins_it() -> None:
    backend = backend_with(QueueConfig(name=QUEUE, concurrency=1))
    assert admit(backend, "a/1")
    assert not admit(backend, "b/1")

    with held_elsewhere(lock_row("SHARE")), transaction.atomic():
        no_wait_for_locks()
        decision = backend.try_admit(AdmissionRequest(queue=QUEUE, ticket="c/1"))

    assert not decision.admitted
    assert decision.reason == "concurrency"
    assert holders() == {"a/1"}
    assert waiters() == {"b/1", "c/1"}


def waiting_for_a_lock(application_name: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock')",
            [application_name],
        )
        return bool(cursor.fetchone()[0])


def test_a_release_that_would_free_its_slot_waits_for_a_call_joining_the_line_and_grants_it() -> None:
    """No waiter is left in the line of a queue with room: a release that finds nobody to hand
    its slot to takes the queue's lock, which waits for the commit of a call joining the line
    (under the share lock), and then grants it."""
    backend = backend_with(QueueConfig(name=QUEUE, concurrency=1))
    assert admit(backend, "a/1")
    assert not admit(backend, "b/1")
    joined, commit = threading.Event(), threading.Event()

    def join_c() -> None:
        try:
            with transaction.atomic():
                assert not backend.try_admit(AdmissionRequest(queue=QUEUE, ticket="c/1")).admitted
                joined.set()
                commit.wait(60)
        finally:
            connection.close()

    grants: list[tuple[str, ...]] = []

    def release_b() -> None:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL application_name = 'df-release-under-test'")
                grants.append(backend.release(QUEUE, "b/1").tickets)
        finally:
            connection.close()

    joiner = threading.Thread(target=join_c)
    joiner.start()
    assert joined.wait(60)
    # b was in line (committed): a's slot goes to it at once, the joiner's lock notwithstanding.
    with transaction.atomic():
        no_wait_for_locks()
        assert backend.release(QUEUE, "a/1").tickets == ("b/1",)
    # c is not committed yet: b's release finds nobody to hand on to and waits for the queue.
    releaser = threading.Thread(target=release_b)
    releaser.start()
    while not waiting_for_a_lock("df-release-under-test"):
        releaser.join(0.05)
        assert releaser.is_alive(), f"the release did not wait for the joiner: {grants}"
    commit.set()
    joiner.join(60)
    releaser.join(60)

    assert grants == [("c/1",)]
    assert holders() == {"c/1"}
    assert waiters() == set()


def test_hand_overs_serve_fairness_keys_in_turn() -> None:
    backend = backend_with(QueueConfig(name=QUEUE, concurrency=1, fairness="key"))
    assert admit(backend, "h/1", "a")
    for ticket, key in (("a1/1", "a"), ("a2/1", "a"), ("a3/1", "a"), ("b1/1", "b"), ("b2/1", "b")):
        assert not admit(backend, ticket, key)

    order = []
    holder = "h/1"
    for _ in range(5):
        with transaction.atomic():
            (holder,) = backend.release(QUEUE, holder).tickets
        order.append(holder)

    # "a" was served last (h): "b" first, then the keys alternate while both wait.
    assert order == ["b1/1", "a1/1", "b2/1", "a2/1", "a3/1"]
