"""Push wake-ups across real processes: an idle claimer is woken by another process's commit
(PostgreSQL's `NOTIFY`, SQLite's doorbell), a caller's `wait` by the commit that ends its run,
and a worker killed with its doorbell bound breaks no later enqueue.

Every poll that could deliver the same thing is set far past the test's own timeout, so only
the push can; the timeouts are generous (no verdict rests on a short margin).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from django.db import connection, connections, transaction
from django.db.transaction import TransactionManagementError

from durable_flow import RunNotFound, start, wait
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, WorkerHeartbeat
from durable_flow.operations import api as operations_api
from durable_flow.store import doorbell
from durable_flow.store.run_bells import watchers
from durable_flow.transports.db.transport import DatabaseTaskSource
from durable_flow.transports.runner import ClaimedTask
from tests.conftest import ManagedProcess, wait_for
from tests.support.workers import RQ_ENV

#: Far past every timeout below: a poll at this pace delivers nothing in time.
NEVER_S = 600.0
TIMEOUT_S = 60.0

sqlite_only = pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's doorbell: runs in the SQLite pass")


@pytest.fixture(autouse=True)
def quiet_watchers() -> Iterator[None]:
    """The waits' listener is this process's for good; here it closes with each test (its
    connection would hold the test database open)."""
    yield
    watchers.stop()


@pytest.fixture
def no_safety_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """`wait` reads its run again only when pushed (and once at its start)."""
    monkeypatch.setattr(operations_api, "WAIT_SAFETY_POLL_S", NEVER_S)


def enqueue_elsewhere(spawn: Callable[..., ManagedProcess], run_id: str) -> ManagedProcess:
    """Another process commits a turn task for `run_id` and exits."""
    code = (
        "from django.db import transaction\n"
        "from durable_flow.transports.db.transport import DatabaseTransport\n"
        "with transaction.atomic():\n"
        f"    DatabaseTransport().enqueue_turn({run_id!r})\n"
    )
    return spawn("shell", "-c", code, env={"DURABLE_FLOW_TRANSPORT": "db"})


def test_an_idle_claimer_is_woken_by_a_task_another_process_commits(
    transactional_db: None, spawn: Callable[..., ManagedProcess]
) -> None:
    source = DatabaseTaskSource(visibility_timeout_s=60, poll_interval_s=NEVER_S)
    source.open(cast(Any, None))  # binds this process's doorbell (SQLite) or LISTENs (PostgreSQL)
    claimed: list[ClaimedTask] = []

    def claim() -> None:
        try:
            claimed.extend(source.claim("w", 1, wait_s=NEVER_S))
        finally:
            connections.close_all()

    claimer = threading.Thread(target=claim, daemon=True)
    try:
        claimer.start()
        enqueuer = enqueue_elsewhere(spawn, "pushed-run")
        assert enqueuer.proc.wait(TIMEOUT_S) == 0, enqueuer.output()
        claimer.join(TIMEOUT_S)
        assert not claimer.is_alive(), "the claimer was not woken by the other process's commit"
        assert [(task.kind, task.run_id) for task in claimed] == [("turn", "pushed-run")]
    finally:
        source.close("w")


@pytest.mark.usefixtures("no_safety_poll")
def test_wait_wakes_when_a_worker_process_finishes_the_run(
    db_transport_engine: Engine, spawn: Callable[..., ManagedProcess]
) -> None:
    spawn("durable_worker", env={"DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_POLL_INTERVAL_S": "60"})
    wait_for(WorkerHeartbeat.objects.filter(stopped_at__isnull=True).exists, what="the worker to start")
    run = start("tests.stamped", {})
    finished = wait(run.id, timeout=TIMEOUT_S)
    assert finished.status == RunStatus.COMPLETED
    assert isinstance(finished.output, float)


@pytest.mark.usefixtures("no_safety_poll")
def test_wait_wakes_when_an_rq_worker_finishes_the_run(rq_engine: Engine, spawn: Callable[..., ManagedProcess]) -> None:
    spawn("durable_worker", env=RQ_ENV)
    wait_for(WorkerHeartbeat.objects.filter(stopped_at__isnull=True).exists, what="the worker to start")
    run = start("tests.stamped", {})
    assert wait(run.id, timeout=TIMEOUT_S).status == RunStatus.COMPLETED


def test_wait_times_out_on_a_run_nobody_runs(db_transport_engine: Engine) -> None:
    run = start("tests.stamped", {})
    with pytest.raises(TimeoutError, match="still pending"):
        wait(run.id, timeout=0.2)


def test_wait_refuses_a_transaction_and_an_unknown_run(db_transport_engine: Engine) -> None:
    run = start("tests.stamped", {})
    with pytest.raises(TransactionManagementError), transaction.atomic():
        wait(run.id, timeout=1)
    with pytest.raises(RunNotFound):
        wait("no-such-run", timeout=1)


@sqlite_only
def test_a_killed_workers_doorbell_breaks_no_enqueue_and_is_removed(
    db_transport_engine: Engine, spawn: Callable[..., ManagedProcess]
) -> None:
    where = doorbell.folder()
    assert where is not None

    def bells() -> list[Path]:
        return sorted(where.glob(f"{doorbell.TASKS}.*.sock")) if where.exists() else []

    before = set(bells())
    killed = spawn("durable_worker", env={"DURABLE_FLOW_TRANSPORT": "db"})
    stale = wait_for(lambda: set(bells()) - before, what="the worker's doorbell")
    killed.kill()  # SIGKILL: its socket file stays behind
    assert all(path.exists() for path in stale)
    run = start("tests.stamped", {})  # rings the dead doorbell: refused, removed
    assert not any(path.exists() for path in stale)
    spawn("durable_worker", env={"DURABLE_FLOW_TRANSPORT": "db"})
    assert wait(run.id, timeout=TIMEOUT_S).status == RunStatus.COMPLETED
