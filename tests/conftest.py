"""Shared fixtures: an in-process engine on a movable clock, and real worker/poller processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from durable_flow.admission.base import AdmissionBackend
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import DurableFlowSettings, get_settings, reset_settings
from durable_flow.engine import Engine, build_backend, set_engine
from durable_flow.models import Task
from durable_flow.store import metric_counts
from durable_flow.transports.inline import InlineTransport
from tests import workflows
from tests.support.engine_pairs import DB_DB, ENGINE_PAIRS, INLINE_LOCAL, db_engine

ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = [
    "tests.support.fixtures",
    "tests.support.held",
    "tests.support.redis_admission",
    "tests.support.redis_cluster",
    "tests.support.workers",
    "tests.support.admission_backends",
    "tests.support.rq",
]

#: The tests whose verdict depends on the database, marked `postgresql`: `make test` runs the
#: whole suite on SQLite, then only these on PostgreSQL (`-m postgresql`). They exercise what
#: differs between the two: row locks and `SKIP LOCKED` (claims, pollers, quotas, admission,
#: bulk operations), the server clock, the SQL the hot path and the metrics collector send,
#: several threads or processes on one database, outages and the soak. The rest (pure logic,
#: views and the JSON API through the same ORM calls, settings checks, the Redis backend, the
#: browser) runs on SQLite only; `DATABASE_URL=... pytest` without `-m` runs everything on
#: PostgreSQL. An entry is a node-id prefix: a module, a class or a test.
POSTGRESQL_PASS = (
    "tests/contracts/test_admission_contract.py::TestDatabaseAdmissionBackend",
    "tests/contracts/test_tasks_contract.py",
    "tests/integration/test_admission_db_clock.py",
    "tests/integration/test_admission_db_row_lock.py",
    "tests/integration/test_admission_redis_outage.py",
    "tests/integration/test_admission_resources_equivalence.py",
    "tests/integration/test_api_list.py",
    "tests/integration/test_bulk_operations.py",
    "tests/integration/test_dashboard_pages.py::test_a_db_admission_line_longer_than_the_cap_is_sampled_up_to_the_cap",
    "tests/integration/test_dashboard_pages.py::test_a_sampling_pass_takes_as_many_statements_with_eight_queues_as_with_one",
    "tests/integration/test_dashboard_pages.py::test_samples_count_each_failed_attempt_apart_from_steps_failed_for_good",
    "tests/integration/test_engine_statements.py",
    "tests/integration/test_events.py",
    "tests/integration/test_flow_control.py",
    "tests/integration/test_hot_path.py",
    "tests/integration/test_inline_handoff.py",
    "tests/integration/test_key_limits.py",
    "tests/integration/test_keys_page.py::test_a_busy_keys_link_lists_exactly_its_runs",
    "tests/integration/test_metric_counts.py",
    "tests/integration/test_number_bounds.py",
    "tests/integration/test_operations.py",
    "tests/integration/test_quota_pages.py::test_a_refused_start_is_kept_with_its_workflow_key_time_and_count",
    "tests/integration/test_release_order.py",
    "tests/integration/test_run_bells.py",
    "tests/integration/test_schedules.py",
    "tests/integration/test_start_timeout.py",
    "tests/integration/test_start_timeout_races.py",
    "tests/integration/test_step_concurrency.py",
    "tests/integration/test_surfaces_at_scale.py",
    "tests/integration/test_task_notifications.py",
    "tests/integration/test_url_input.py",
    "tests/integration/test_vacuum.py",
    "tests/integration/test_wait_causes.py",
    "tests/processes/test_base_exceptions.py",
    "tests/processes/test_current_step.py",
    "tests/processes/test_events_processes.py",
    "tests/processes/test_flow_control_processes.py",
    "tests/processes/test_handoff_processes.py",
    "tests/processes/test_schedules_processes.py",
    "tests/processes/test_key_limits_processes.py",
    "tests/processes/test_metric_counters.py::test_counters_and_histograms_follow_real_runs",
    "tests/processes/test_metrics.py",
    "tests/processes/test_nesting_limit.py",
    "tests/processes/test_outages.py",
    "tests/processes/test_patch_deploys.py",
    "tests/processes/test_processes.py",
    "tests/processes/test_push_wakeups.py",
    "tests/processes/test_queue_operations.py",
    "tests/processes/test_quotas.py",
    "tests/processes/test_retention.py",
    "tests/processes/test_start_control.py",
    "tests/processes/test_start_timeout_processes.py",
    "tests/processes/test_step_concurrency_processes.py",
    "tests/processes/test_task_declarations.py::test_a_stored_run_naming_a_non_task_fails_on_a_worker_without_importing_it",
    "tests/processes/test_task_declarations.py::test_starting_the_built_in_workflow_through_the_json_api_runs_nothing_on_a_worker",
    "tests/processes/test_tasks.py::test_a_real_worker_process_runs_tasks_in_priority_order_on_the_db_transport",
    "tests/processes/test_timers.py",
    "tests/reliability/test_soak.py",
    "tests/reliability/test_soak_hosts.py",
    "tests/reliability/test_soak_outages.py",
    "tests/unit/test_engine_cancel.py",
    "tests/unit/test_engine_fanout.py",
    "tests/unit/test_engine_lifecycle.py",
    "tests/unit/test_engine_recovery.py",
    "tests/unit/test_engine_robustness.py",
    "tests/unit/test_optimistic_first_step.py",
    "tests/unit/test_patches.py",
    "tests/unit/test_start_control_tasks.py",
)


#: Process tests run on PostgreSQL on the `db` stack only: what differs between the databases is
#: the SQL of the engine and of the `db` admission backend and transport, which the `db` stack
#: runs; a Redis-backed stack's cases (and the RQ transport's own module) run on SQLite. The
#: outage tests keep every stack: their PostgreSQL outages are the database's own. The chaos
#: soak is not a process test here: its `rq` case runs on PostgreSQL only (it skips on SQLite).
REDIS_STACKS = frozenset({"redis", "redis+rq", "rq"})
PROCESS_TESTS = ("tests/processes/",)
OUTAGE_TESTS = ("tests/processes/test_outages.py",)


def on_a_redis_stack(item: pytest.Item) -> bool:
    """A process test's case on a Redis-backed stack (its parameters name one)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or not item.nodeid.startswith(PROCESS_TESTS) or item.nodeid.startswith(OUTAGE_TESTS):
        return False
    return any(isinstance(value, str) and value in REDIS_STACKS for value in callspec.params.values())


#: `DURABLE_FLOW_TEST_LISTS=<prefix>`: the session writes the node ids it collected to
#: `<prefix>.collected` and those it runs to `<prefix>.selected`, so .ci/test-passes can check
#: that the SQLite pass's shards (pytest-split) ran every collected test exactly once. Taken out
#: of the environment, so no child process inherits it.
TEST_LISTS = os.environ.pop("DURABLE_FLOW_TEST_LISTS", "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of `POSTGRESQL_PASS` (the PostgreSQL pass selects them with `-m postgresql`;
    of an engine-pair test, its `db-db` case);
    leave out the `db-db` case of a test marked `inline_only` (it is about the inline pair)."""
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        pair = callspec.params.get("engine") if callspec is not None else None
        # An engine-pair test's `db-db` case goes to the PostgreSQL pass (the embedded default,
        # whose SQL is what differs between the databases); its `inline-local` case runs on SQLite.
        if item.nodeid.startswith(POSTGRESQL_PASS) and pair != INLINE_LOCAL and not on_a_redis_stack(item):
            item.add_marker(pytest.mark.postgresql)
        on_db = pair == DB_DB
        (dropped if on_db and item.get_closest_marker("inline_only") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


class CollectedList:
    """With `DURABLE_FLOW_TEST_LISTS`, writes `<prefix>.collected`: the tests this session
    selects before pytest-split keeps its shard of them, so after `-m` (the PostgreSQL shards
    select by marker, which this module's hook above adds first). Registered before pytest-split
    registers its plugin (`pytest_configure` below, tryfirst): of two trylast hooks, the one
    registered first runs first."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        write_node_ids(f"{TEST_LISTS}.collected", items)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if TEST_LISTS:
        config.pluginmanager.register(CollectedList(), "durable-flow-collected-list")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse a collection that left workflows declaring events registered: a test module that
    imports such a workflow module at its top registers it for the whole session, and its triggers
    then fail every other test's `manage.py check` under settings that declare no events, in
    whichever shard the two meet (the `declare` fixture and `tests.support.fixtures.registered`
    register for one test).

    With `DURABLE_FLOW_TEST_LISTS=<prefix>`, write the node ids this session runs to
    `<prefix>.selected`, one a line (those it collected are in `<prefix>.collected`)."""
    from durable_flow.definitions import registry

    with_events = sorted(
        f"{name} ({definition.fn.__module__})"
        for name, definition in registry.workflows().items()
        if definition.triggers or definition.cancel_on
    )
    if with_events:
        raise pytest.UsageError(
            "workflows declaring events were registered at collection: "
            + ", ".join(with_events)
            + "; register them for one test (tests.support.fixtures.registered or the declare fixture)"
        )
    if TEST_LISTS:
        write_node_ids(f"{TEST_LISTS}.selected", session.items)


def write_node_ids(path: str, items: list[pytest.Item]) -> None:
    Path(path).write_text("".join(f"{item.nodeid}\n" for item in items))


def use_redis_admission(settings: Any) -> AdmissionBackend:
    """Point this process's settings at the `redis` admission backend the worker processes of a
    process test use (same key prefix, a short instance TTL) and build it."""
    settings.DURABLE_FLOW = {
        **settings.DURABLE_FLOW,
        "ADMISSION": {
            "BACKEND": "redis",
            "CONNECTION": "default",
            "INSTANCE_TTL_MS": 3000,
            "KEY_PREFIX": f"df:test:{os.environ.get('DURABLE_FLOW_TEST_ID', 'main')}",
        },
    }
    reset_settings()
    return build_backend(get_settings().admission)


class MovableClock:
    """A datetime clock for the engine that tests move by hand."""

    def __init__(self) -> None:
        now = timezone.now()  # whole milliseconds, the admission backends' resolution
        self._now = now.replace(microsecond=now.microsecond // 1000 * 1000)
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, **kwargs: float) -> datetime:
        with self._lock:
            self._now += timedelta(**kwargs)
            return self._now

    @property
    def ms(self) -> int:
        return int(self().timestamp() * 1000)


@pytest.fixture(scope="session", autouse=True)
def _close_stray_connections(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Threads that touched the database (pub/sub listeners, worker threads under test) keep
    persistent connections; end them before the test database is dropped."""
    yield
    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


@pytest.fixture(autouse=True)
def _fresh_durable_flow_settings() -> Iterator[None]:
    """Forget the cached `DURABLE_FLOW` settings after each test: a test that overrides them
    and resets the cache (`reset_settings`) would otherwise leave its values to the tests after
    it in the session (a default retention, say), which Django's own restore does not clear."""
    yield
    reset_settings()


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    workflows.EXECUTIONS.clear()
    workflows.FAILURES_LEFT.clear()
    metric_counts.discard()  # counts a previous test made belong to its database, not this one's
    yield
    set_engine(None)
    metric_counts.discard()
    metric_counts.set_process(None)  # an in-process worker named this process's metric rows


@pytest.fixture
def clock() -> MovableClock:
    return MovableClock()


def local_engine(clock: MovableClock, transport: Any, settings: DurableFlowSettings | None = None) -> Engine:
    """An engine on `transport` with in-process admission on the test's clock, installed as
    this process's engine (the public API uses it)."""
    engine = Engine(
        admission=LocalAdmissionBackend(clock=lambda: clock.ms),
        transport=transport,
        settings=settings or get_settings(),
        clock=clock,
    )
    set_engine(engine)
    return engine


@pytest.fixture(params=ENGINE_PAIRS)
def engine(request: pytest.FixtureRequest, clock: MovableClock, transactional_db: None) -> Iterator[Engine]:
    """The engine a test runs on, once per pair: `inline-local` (the inline transport runs
    turns and steps in this process on commit; local admission) and `db-db` (the embedded
    default: `db` admission and transport, its tasks run by a real burst worker in this process
    on commit, `tests.support.engine_pairs`). A test about the inline pair only is marked
    `@pytest.mark.inline_only("why")`."""
    if request.param != DB_DB:
        yield local_engine(clock, InlineTransport())
        return
    yield db_engine(clock)
    # The burst workers ran every task the test's work sent: none is left behind.
    assert not Task.objects.exists(), "db-db: tasks left unrun"


@pytest.fixture
def manual(clock: MovableClock, transactional_db: None) -> Engine:
    """An engine whose turns and steps wait until the test runs them (`tests.engine_support`)."""
    from tests.engine_support import ManualTransport

    return local_engine(clock, ManualTransport())


def executed(name: str) -> list[Any]:
    """The inputs a step ran with in this process, in order."""
    return [value for step, value in workflows.EXECUTIONS if step == name]


def database_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process that must share the test database."""
    env = dict(os.environ)
    env.update({"DJANGO_SETTINGS_MODULE": "settings.test", "DURABLE_FLOW_SUBPROCESS": "1", "PYTHONUNBUFFERED": "1"})
    if connection.vendor == "postgresql" and "DATABASE_URL" not in env:
        raise RuntimeError("PostgreSQL tests need DATABASE_URL")
    env.update(extra or {})
    return env


class ManagedProcess:
    """A `manage.py` subprocess that is always reaped."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        log: Path,
        *,
        module: str | None = None,
        process_group: int | None = None,
    ) -> None:
        """`process_group`: 0 starts the process in a group of its own (it leads it), a pid puts
        it in that leader's group (`os.killpg` then kills them together); None, the test's."""
        self.log_path = log
        self._log = open(log, "wb")
        program = ["-m", module] if module else [str(ROOT / "manage.py")]
        self.proc = subprocess.Popen(
            [sys.executable, *program, *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=process_group,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def stop(self) -> None:
        self.kill()
        self._log.close()

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., ManagedProcess]]:
    """Start `manage.py <args>` (or `python -m <module> <args>`) in a child process on the test
    database; all are killed at the end."""
    started: list[ManagedProcess] = []

    def start(
        *args: str, env: dict[str, str] | None = None, module: str | None = None, process_group: int | None = None
    ) -> ManagedProcess:
        log = tmp_path / f"proc-{len(started)}-{module or args[0]}.log"
        process = ManagedProcess(list(args), database_env(env), log, module=module, process_group=process_group)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll until `predicate()` is truthy; fail the test with `what` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
