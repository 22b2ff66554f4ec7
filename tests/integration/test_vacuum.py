"""The hot tables' upkeep: the poller vacuums a hot table once its dead rows pass the threshold
(PostgreSQL, on a real server), never more often than the minimum interval, never when turned
off, and never on SQLite; the migration's per-table autovacuum settings are on the tables."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings, reset_settings
from durable_flow.engine import Engine
from durable_flow.models import Task, TaskKind
from durable_flow.runtime.poller import TimerPoller
from durable_flow.runtime.vacuum import VacuumPolicy, Vacuums
from durable_flow.store import maintenance
from durable_flow.store.maintenance import TableHealth
from durable_flow.transports.inline import InlineTransport

postgresql_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="VACUUM: runs in the PostgreSQL pass")
TASKS = Task._meta.db_table
THRESHOLD = 1000


# -- when a table is due: the policy alone, on an injected clock ----------------------------------
def test_a_table_is_due_once_its_dead_rows_pass_the_rows_plus_the_fraction_of_live_ones() -> None:
    policy = VacuumPolicy(dead_rows=1000, dead_fraction=0.5, min_interval_s=30)
    assert policy.choose([TableHealth("t", dead=1500, live=1000)], {}, now=0) is None
    assert policy.choose([TableHealth("t", dead=1501, live=1000)], {}, now=0) == TableHealth("t", 1501, 1000)


def test_the_table_with_the_most_dead_rows_goes_first() -> None:
    policy = VacuumPolicy(dead_rows=1000, dead_fraction=0, min_interval_s=30)
    tables = [TableHealth("a", dead=2000, live=0), TableHealth("b", dead=5000, live=0), TableHealth("c", 10, 0)]
    assert policy.choose(tables, {}, now=0) == TableHealth("b", 5000, 0)


def test_a_table_is_not_vacuumed_again_within_the_minimum_interval() -> None:
    policy = VacuumPolicy(dead_rows=1000, dead_fraction=0, min_interval_s=30)
    busy = [TableHealth("a", dead=9000, live=0), TableHealth("b", dead=2000, live=0)]
    assert policy.choose(busy, {"a": 100.0}, now=129.9) == TableHealth("b", 2000, 0)
    assert policy.choose(busy, {"a": 100.0, "b": 100.0}, now=129.9) is None
    assert policy.choose(busy, {"a": 100.0, "b": 100.0}, now=130.0) == TableHealth("a", 9000, 0)


def test_no_threshold_turns_the_vacuum_off() -> None:
    policy = VacuumPolicy(dead_rows=None, dead_fraction=0, min_interval_s=30)
    assert policy.choose([TableHealth("a", dead=10**9, live=0)], {}, now=0) is None


def test_the_settings_reach_the_pollers_policy_and_none_turns_it_off() -> None:
    poller_settings = {"VACUUM_DEAD_ROWS": 5000, "VACUUM_DEAD_FRACTION": 0.25, "VACUUM_MIN_INTERVAL_S": 90}
    assert vacuum_policy({"POLLER": poller_settings}) == VacuumPolicy(5000, 0.25, 90.0)
    assert vacuum_policy({"POLLER": {"VACUUM_DEAD_ROWS": None}}).dead_rows is None
    assert vacuum_policy({}) == VacuumPolicy(2_000, 0.05, 10.0)  # the documented defaults


def vacuum_policy(durable_flow: dict[str, Any]) -> VacuumPolicy:
    with override_settings(DURABLE_FLOW=durable_flow):
        reset_settings()
        try:
            engine = Engine(admission=LocalAdmissionBackend(), transport=InlineTransport(), settings=get_settings())
            return TimerPoller(engine).vacuums.policy
        finally:
            reset_settings()


@pytest.mark.skipif(connection.vendor == "postgresql", reason="SQLite keeps no dead-row counts")
@pytest.mark.django_db
def test_on_sqlite_the_poller_reads_no_figures_and_vacuums_nothing() -> None:
    vacuums = Vacuums(VacuumPolicy(dead_rows=1000, dead_fraction=0, min_interval_s=1))
    assert maintenance.hot_table_health() == []
    assert vacuums.maybe_vacuum() is None and not vacuums.running


# -- on PostgreSQL ---------------------------------------------------------------------------------
@pytest.fixture
def poller(transactional_db: None) -> Iterator[Callable[..., TimerPoller]]:
    """A poller built with the given POLLER settings (the engine's, inline transport)."""

    def build(**poller_settings: Any) -> TimerPoller:
        with override_settings(DURABLE_FLOW={**get_settings_dict(), "POLLER": poller_settings}):
            reset_settings()
            engine = Engine(admission=LocalAdmissionBackend(), transport=InlineTransport(), settings=get_settings())
            return TimerPoller(engine)

    yield build
    reset_settings()


def get_settings_dict() -> dict[str, Any]:
    from django.conf import settings

    return {key: value for key, value in settings.DURABLE_FLOW.items() if key != "POLLER"}


def leave_dead_task_rows(count: int) -> None:
    """Insert `count` task rows and delete them: `count` dead rows in the task table."""
    now = timezone.now()
    with transaction.atomic():
        Task.objects.bulk_create(
            Task(kind=TaskKind.STEP, run_id=f"dead-{i}", step_key="1", available_at=now) for i in range(count)
        )
    Task.objects.filter(run_id__startswith="dead-").delete()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")  # report this backend's counts now


def task_table() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_dead_tup, vacuum_count FROM pg_stat_user_tables WHERE relname = %s",
            [TASKS],
        )
        dead, vacuums = cursor.fetchone()
    return {"dead": dead, "vacuums": vacuums}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Wait on the statistics (backends report them about once a second), not on a margin."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@postgresql_only
def test_the_poller_vacuums_a_hot_table_once_its_dead_rows_pass_the_threshold(
    poller: Callable[..., TimerPoller], caplog: pytest.LogCaptureFixture
) -> None:
    subject = poller(VACUUM_DEAD_ROWS=THRESHOLD, VACUUM_DEAD_FRACTION=0, VACUUM_MIN_INTERVAL_S=3600)
    vacuums_before = task_table()["vacuums"]
    leave_dead_task_rows(THRESHOLD + 500)
    wait_for(lambda: task_table()["dead"] > THRESHOLD, "the dead rows in the statistics")
    with caplog.at_level(logging.INFO, logger="durable_flow.runtime.vacuum"):
        subject.maintain()
        assert subject.vacuums.wait(120)
    assert subject.vacuums.done == 1 and subject.vacuums.failed == 0
    assert subject.vacuums.last.keys() == {TASKS}
    wait_for(lambda: task_table()["vacuums"] > vacuums_before, "the vacuum in the statistics")
    assert task_table()["dead"] < THRESHOLD
    assert any(f"vacuumed {TASKS}" in record.getMessage() for record in caplog.records)


@postgresql_only
def test_the_poller_does_not_vacuum_a_table_again_within_the_minimum_interval(
    poller: Callable[..., TimerPoller],
) -> None:
    subject = poller(VACUUM_DEAD_ROWS=THRESHOLD, VACUUM_DEAD_FRACTION=0, VACUUM_MIN_INTERVAL_S=600)
    now = [1000.0]
    subject.vacuums.clock = lambda: now[0]
    subject.vacuums.last[TASKS] = now[0] - 1  # vacuumed a second ago
    leave_dead_task_rows(THRESHOLD + 500)
    wait_for(lambda: task_table()["dead"] > THRESHOLD, "the dead rows in the statistics")
    vacuums_before = task_table()["vacuums"]
    subject.maintain()
    assert not subject.vacuums.running and subject.vacuums.done == 0
    now[0] += 600
    subject.maintain()
    assert subject.vacuums.wait(120) and subject.vacuums.done == 1
    wait_for(lambda: task_table()["vacuums"] > vacuums_before, "the vacuum in the statistics")


@postgresql_only
def test_no_threshold_leaves_the_dead_rows_alone(poller: Callable[..., TimerPoller]) -> None:
    subject = poller(VACUUM_DEAD_ROWS=None)
    leave_dead_task_rows(THRESHOLD + 500)
    wait_for(lambda: task_table()["dead"] > THRESHOLD, "the dead rows in the statistics")
    subject.maintain()
    assert subject.vacuums.last == {} and not subject.vacuums.running and subject.vacuums.done == 0


@postgresql_only
def test_vacuum_refuses_to_run_inside_a_transaction_and_takes_only_hot_tables(transactional_db: None) -> None:
    with transaction.atomic(), pytest.raises(RuntimeError, match="inside a transaction"):
        maintenance.vacuum(TASKS)
    with pytest.raises(ValueError, match="not a hot table"):
        maintenance.vacuum("auth_user")


@postgresql_only
def test_a_role_that_does_not_own_the_tables_sees_none_to_vacuum(transactional_db: None) -> None:
    """PostgreSQL skips a table its owner's role does not hold (a warning, no error): the poller
    would log a vacuum that did nothing, every interval."""
    assert {health.table for health in maintenance.hot_table_health()} == set(maintenance.hot_tables())
    role = f"df_{os.environ.get('DURABLE_FLOW_TEST_ID', 'main')}_not_owner".replace("-", "_")
    with connection.cursor() as cursor:
        cursor.execute(f"DROP ROLE IF EXISTS {role}")
        cursor.execute(f"CREATE ROLE {role}")
        try:
            cursor.execute(f"SET ROLE {role}")
            assert maintenance.hot_table_health() == []
        finally:
            cursor.execute("RESET ROLE")
            cursor.execute(f"DROP ROLE {role}")


@postgresql_only
@pytest.mark.django_db
def test_the_migration_sets_autovacuum_thresholds_on_the_hot_tables() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, reloptions FROM pg_class WHERE relname = ANY(%s)", [list(maintenance.hot_tables())]
        )
        options = {table: set(values or ()) for table, values in cursor.fetchall()}
    assert options.keys() == set(maintenance.hot_tables())
    assert all("autovacuum_vacuum_threshold=1000" in values for values in options.values())
    assert "autovacuum_vacuum_scale_factor=0" in options[TASKS]
    assert "autovacuum_vacuum_scale_factor=0.02" in options["durable_flow_workflowrun"]
