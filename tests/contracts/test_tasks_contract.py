"""Django's tasks framework's contract for a backend, held by `DurableFlowBackend` with real
worker processes on the `db` transport, on Django 5.2 (the `django-tasks` backport) and on
Django 6 (`django.tasks`; `make test` runs this module on both).

The behaviours are ported from the framework's own backend tests: django-tasks
(`tests/tests/test_database_backend.py`, `test_immediate_backend.py`, `test_dummy_backend.py`,
`test_tasks.py`; Copyright (c) Jake Howard, BSD 3-Clause) and Django (`tests/tasks/`;
Copyright (c) Django Software Foundation and individual contributors, BSD 3-Clause). They are
rewritten for this backend: an enqueued task is a durable run that a `durable_worker` process
runs, so a test enqueues, then waits for the worker, then reads the result back. What only an
in-process backend can do (the immediate backend's synchronous results, the dummy backend's
result list) and the database backend's own worker command and table are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.test import override_settings
from django.utils import timezone

from durable_flow.contrib.tasks import DurableFlowBackend
from durable_flow.engine import Engine
from durable_flow.models import WorkerHeartbeat
from tests import contract_tasks
from tests.conftest import ManagedProcess, wait_for
from tests.tasks_framework import (
    LOGGER,
    InvalidTaskError,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
    default_task_backend,
    task_enqueued,
)

WORKER_ENV = {"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db"}


@pytest.fixture
def signals_file(tmp_path: Path) -> Path:
    return tmp_path / "signals"


@pytest.fixture
def start_worker(
    db_admission_engine: Engine, spawn: Callable[..., ManagedProcess], signals_file: Path
) -> Callable[..., ManagedProcess]:
    """Start a `durable_worker` (and a `durable_poller` for timers) on the test database; the
    worker's `task_started`/`task_finished` signals are written to `signals_file`."""

    def start(*args: str) -> ManagedProcess:
        env = {**WORKER_ENV, "DURABLE_FLOW_TEST_SIGNALS": str(signals_file)}
        spawn("durable_poller", env=env)
        return spawn("durable_worker", *args, env=env)

    return start


@pytest.fixture
def worker(start_worker: Callable[..., ManagedProcess]) -> ManagedProcess:
    return start_worker()


def finished(result: Any, timeout: float = 60) -> Any:
    """`result` refreshed once its task finished (the worker ran it)."""

    def done() -> bool:
        result.refresh()
        return bool(result.is_finished)

    wait_for(done, timeout=timeout, what=f"task {result.task.name} ({result.id}) to finish")
    return result


# -- enqueue -------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", [contract_tasks.noop, contract_tasks.noop_async], ids=["sync", "async"])
def test_enqueue_returns_a_ready_result_that_has_not_run(db_admission_engine: Engine, task: Any) -> None:
    result = task.enqueue(1, two=3)
    assert result.status == TaskResultStatus.READY
    assert not result.is_finished
    assert (result.started_at, result.last_attempted_at, result.finished_at) == (None, None, None)
    assert result.enqueued_at is not None
    with pytest.raises(ValueError, match="Task has not finished yet"):
        result.return_value  # noqa: B018
    assert result.task == task
    assert (result.args, result.kwargs, result.attempts) == ([1], {"two": 3}, 0)
    assert result.backend == "default"


def test_enqueue_sends_task_enqueued_with_the_backend_class_and_the_result(db_admission_engine: Engine) -> None:
    received: list[tuple[type, Any]] = []

    def receiver(sender: type, task_result: Any, **kwargs: Any) -> None:
        received.append((sender, task_result))

    task_enqueued.connect(receiver)
    try:
        result = contract_tasks.noop.enqueue()
    finally:
        task_enqueued.disconnect(receiver)
    assert received == [(DurableFlowBackend, result)]


def test_the_frameworks_logger_sees_the_enqueue(db_admission_engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger=LOGGER)
    result = contract_tasks.noop.enqueue()
    enqueued = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert enqueued == [f"Task id={result.id} path=tests.contract_tasks.noop enqueued backend=default"]


def test_aenqueue_and_aget_result_give_the_same_result(db_admission_engine: Engine) -> None:
    async def enqueue_and_read() -> tuple[Any, Any]:
        result = await contract_tasks.noop.aenqueue()
        return result, await default_task_backend.aget_result(result.id)

    result, fetched = async_to_sync(enqueue_and_read)()
    assert (fetched.id, fetched.status, fetched.task) == (result.id, TaskResultStatus.READY, contract_tasks.noop)


def test_get_result_reads_back_the_enqueued_result_until_a_worker_runs_it(db_admission_engine: Engine) -> None:
    result = default_task_backend.enqueue(contract_tasks.noop, (), {})
    assert default_task_backend.get_result(result.id) == result
    assert contract_tasks.noop.get_result(result.id) == result
    assert async_to_sync(contract_tasks.noop.aget_result)(result.id) == result


def test_a_tasks_get_result_refuses_the_result_of_another_task(db_admission_engine: Engine) -> None:
    result = contract_tasks.noop_async.enqueue()
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        contract_tasks.noop.get_result(result.id)
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        async_to_sync(contract_tasks.noop.aget_result)(result.id)


def test_arguments_that_are_not_json_are_refused_with_the_frameworks_type_error(db_admission_engine: Engine) -> None:
    from datetime import datetime

    with pytest.raises(TypeError, match="Unsupported type"):
        contract_tasks.noop.enqueue(datetime.now())


def test_a_queue_the_backend_does_not_list_is_refused_on_enqueue(db_admission_engine: Engine) -> None:
    backend = {"BACKEND": "durable_flow.contrib.tasks.DurableFlowBackend", "QUEUES": ["queue-1"]}
    with override_settings(TASKS={"default": backend}):
        with pytest.raises(InvalidTaskError, match="Queue 'default' is not valid for backend"):
            contract_tasks.noop.enqueue()
        with pytest.raises(InvalidTaskError, match="Queue 'default' is not valid for backend"):
            async_to_sync(contract_tasks.noop.aenqueue)()


def test_an_unknown_result_id_does_not_exist(db_admission_engine: Engine) -> None:
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("123")
    with pytest.raises(TaskResultDoesNotExist):
        async_to_sync(default_task_backend.aget_result)("123")


# -- a worker runs it ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "value"),
    [(contract_tasks.noop, None), (contract_tasks.noop_async, None), (contract_tasks.meaning_of_life, 42)],
    ids=["sync", "async", "value"],
)
def test_a_worker_runs_the_task_to_successful_with_its_return_value(
    worker: ManagedProcess, task: Any, value: Any
) -> None:
    result = finished(task.enqueue())
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == value
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.last_attempted_at == result.started_at
    assert result.attempts == 1 and result.errors == []
    (worker_id,) = result.worker_ids  # the worker's own id (`host:name`), as its heartbeat says
    assert WorkerHeartbeat.objects.get(pid=worker.proc.pid).worker_id == worker_id


def test_args_and_the_return_value_round_trip_as_json(worker: ManagedProcess) -> None:
    result = finished(contract_tasks.echo.enqueue((1, 2), b"three", key={"nested": (4,)}))
    assert (result.args, result.kwargs) == ([[1, 2], "three"], {"key": {"nested": [4]}})
    assert result.return_value == {"args": [[1, 2], "three"], "kwargs": {"key": {"nested": [4]}}}


def test_a_failing_task_is_failed_with_its_exception_class_and_traceback(worker: ManagedProcess) -> None:
    result = finished(contract_tasks.fail_with_value_error.enqueue())
    assert result.status == TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018
    assert result.enqueued_at <= result.started_at <= result.finished_at
    (error,) = result.errors
    assert error.exception_class is ValueError
    assert error.traceback.endswith("ValueError: This task failed due to ValueError\n")


def test_a_task_raising_system_exit_fails_and_the_worker_runs_on(worker: ManagedProcess) -> None:
    result = finished(contract_tasks.fail_with_system_exit.enqueue())
    assert result.status == TaskResultStatus.FAILED
    (error,) = result.errors
    assert error.exception_class is SystemExit
    assert error.traceback.endswith("SystemExit: This task failed due to SystemExit\n")
    assert finished(contract_tasks.meaning_of_life.enqueue()).return_value == 42
    assert worker.proc.poll() is None


def test_an_exception_wrapping_an_exception_is_recorded_whole(worker: ManagedProcess) -> None:
    result = finished(contract_tasks.fail_with_nested_exception.enqueue())
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class is ValueError
    assert 'ValueError(ValueError("This task failed"))' in result.errors[0].traceback


def test_a_return_value_that_is_not_json_fails_the_task_with_type_error(worker: ManagedProcess) -> None:
    result = finished(contract_tasks.return_unserialisable.enqueue())
    assert result.status == TaskResultStatus.FAILED
    assert result._return_value is None
    assert result.errors[0].exception_class is TypeError
    assert "Unsupported type" in result.errors[0].traceback


def test_the_result_reads_running_while_the_worker_runs_the_task(worker: ManagedProcess, tmp_path: Path) -> None:
    release = tmp_path / "release"
    result = contract_tasks.wait_for_file.enqueue(str(release))

    def running() -> bool:
        result.refresh()
        return bool(result.status == TaskResultStatus.RUNNING)

    wait_for(running, timeout=60, what="the result to read RUNNING")
    assert result.started_at is not None and result.attempts == 1 and not result.is_finished
    release.touch()
    assert finished(result).status == TaskResultStatus.SUCCESSFUL


def test_a_task_taking_context_gets_its_own_result(worker: ManagedProcess) -> None:
    result = finished(contract_tasks.own_id.enqueue())
    assert result.return_value == result.id


def test_the_context_counts_attempts_from_one_and_reads_running(worker: ManagedProcess) -> None:
    result = finished(contract_tasks.attempt_seen.enqueue())
    assert result.return_value == {"attempt": 1, "status": str(TaskResultStatus.RUNNING)}


def test_the_worker_sends_task_started_then_task_finished(worker: ManagedProcess, signals_file: Path) -> None:
    ok = finished(contract_tasks.noop.enqueue())
    failed = finished(contract_tasks.fail_with_value_error.enqueue())
    lines = signals_file.read_text().splitlines()
    assert lines == [
        f"started {ok.id} RUNNING 1",
        f"finished {ok.id} SUCCESSFUL 1",
        f"started {failed.id} RUNNING 1",
        f"finished {failed.id} FAILED 1",
    ]


def test_uncontended_tasks_run_in_priority_order_then_enqueue_order(
    start_worker: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    order = tmp_path / "order"
    calls = [("low", -20), ("first-zero", 0), ("high", 50), ("second-zero", 0), ("top", 100), ("bottom", -100)]
    results = [contract_tasks.mark.using(priority=priority).enqueue(str(order), label) for label, priority in calls]
    start_worker("--concurrency", "1")  # one at a time, all queued before it starts
    for result in results:
        finished(result)
    assert order.read_text().split() == ["top", "high", "first-zero", "second-zero", "low", "bottom"]


def test_run_after_holds_the_task_until_it_is_due(worker: ManagedProcess) -> None:
    due = timezone.now() + timedelta(seconds=3)
    result = finished(contract_tasks.noop.using(run_after=due).enqueue())
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.started_at >= due


# -- check ---------------------------------------------------------------------------------------


def test_check_finds_nothing_wrong_in_this_project() -> None:
    assert list(default_task_backend.check()) == []


def test_check_is_an_error_when_durable_flow_is_not_installed() -> None:
    with override_settings(INSTALLED_APPS=["django.contrib.contenttypes"]):
        errors = list(default_task_backend.check())
    assert [error.id for error in errors] == ["durable_flow.tasks.E001"]
    assert "durable_flow" in (errors[0].hint or "")
