"""A run's end is notified on PostgreSQL only while someone waits for that run
(`store/run_bells.py`): a finished run nobody waits for sends no `NOTIFY` (each one queues its
commit behind a lock of the whole server), and a wait that begins while the finishing
transaction is still open sees the run ended all the same.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection, connections, transaction

from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.store import run_bells
from durable_flow.store.run_bells import watchers

pytestmark = pytest.mark.skipif(connection.vendor != "postgresql", reason="NOTIFY and advisory locks: PostgreSQL")

TIMEOUT_S = 30.0


@pytest.fixture(autouse=True)
def quiet_watchers() -> Iterator[None]:
    yield
    watchers.stop()  # its connection would hold the test database open


@pytest.fixture
def listening(transactional_db: None) -> Iterator[psycopg.Connection]:
    """A bare `LISTEN` on the runs' channel: it hears every notification, and is no wait."""
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as raw:
        raw.execute(f"LISTEN {run_bells.CHANNEL}")
        yield raw


def finish(run_id: str) -> None:
    """What the engine's `finish` does to the row and the bell, in one transaction, on a
    connection of its own (as a worker's: a session's own locks never conflict with each other)."""

    def finishing() -> None:
        try:
            with transaction.atomic():
                WorkflowRun.objects.filter(pk=run_id).update(status=RunStatus.COMPLETED)
                run_bells.finished(run_id)
        finally:
            connections.close_all()

    finisher = threading.Thread(target=finishing, daemon=True)
    finisher.start()
    finisher.join(TIMEOUT_S)
    assert not finisher.is_alive()


def new_run() -> str:
    return WorkflowRun.objects.create(workflow="tests.echo_flow", status=RunStatus.RUNNING).pk


def test_a_run_nobody_waits_for_ends_without_a_notification(listening: psycopg.Connection) -> None:
    unwatched, watched = new_run(), new_run()
    finish(unwatched)
    with watchers.watching(watched):
        finish(watched)
    heard: list[str] = []
    for note in listening.notifies(timeout=TIMEOUT_S):
        heard.append(note.payload)
        if note.payload == watched:
            break
    # Notifications arrive in commit order: the unwatched run's would have come first.
    assert heard == [watched]


def test_a_wait_begun_before_the_finishing_commit_sees_the_run_ended(transactional_db: None) -> None:
    run_id = new_run()
    checked, commit = threading.Event(), threading.Event()

    def finishing() -> None:
        try:
            with transaction.atomic():
                WorkflowRun.objects.filter(pk=run_id).update(status=RunStatus.COMPLETED)
                run_bells.finished(run_id)  # nobody waits yet: no notification
                checked.set()
                commit.wait(TIMEOUT_S)
        finally:
            connections.close_all()

    seen: list[str] = []

    def waiting() -> None:
        try:
            with watchers.watching(run_id):  # asks for the run's wait lock: held to the commit
                seen.append(WorkflowRun.objects.values_list("status", flat=True).get(pk=run_id))
        finally:
            connections.close_all()

    finisher = threading.Thread(target=finishing, daemon=True)
    finisher.start()
    assert checked.wait(TIMEOUT_S)
    waiter = threading.Thread(target=waiting, daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert seen == [], "the wait read the run before the transaction that ends it committed"
    commit.set()
    finisher.join(TIMEOUT_S)
    waiter.join(TIMEOUT_S)
    assert seen == [RunStatus.COMPLETED]


def test_a_wait_holds_its_runs_lock_only_while_it_waits(listening: psycopg.Connection) -> None:
    first, second = new_run(), new_run()
    with watchers.watching(first):
        pass
    finish(first)  # the wait is over: nobody to tell
    with watchers.watching(second):
        finish(second)
    assert [note.payload for note in listening.notifies(timeout=TIMEOUT_S, stop_after=1)] == [second]
