"""Module-level `@task` functions for tests/contracts/test_tasks_contract.py, after the task modules of
django-tasks' and Django's own test suites (`tests/tasks.py` in both).

A worker process imports this module (listed in the test settings' `WORKFLOWS`, so its tasks are
declared there: `durable_flow/definitions/declared_tasks.py`); the receivers below then record
the framework's `task_started`/`task_finished` signals in the file `DURABLE_FLOW_TEST_SIGNALS`
names, so a test reads what the worker sent.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tests.tasks_framework import TaskContext, task, task_finished, task_started


@task
def noop(*args: Any, **kwargs: Any) -> None:
    return None


@task
async def noop_async(*args: Any, **kwargs: Any) -> None:
    return None


@task
def meaning_of_life() -> int:
    return 42


@task
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"args": args, "kwargs": kwargs}


@task
def fail_with_value_error() -> None:
    raise ValueError("This task failed due to ValueError")


@task
def fail_with_nested_exception() -> None:
    raise ValueError(ValueError("This task failed"))


@task
def fail_with_system_exit() -> None:
    raise SystemExit("This task failed due to SystemExit")


@task
def return_unserialisable() -> Any:
    return {"value": object()}


@task(takes_context=True)
def own_id(context: TaskContext) -> str:
    return context.task_result.id


@task(takes_context=True)
def attempt_seen(context: TaskContext) -> dict[str, Any]:
    return {"attempt": context.attempt, "status": str(context.task_result.status)}


@task
def wait_for_file(path: str) -> str:
    """Runs until `path` exists (a test's release), at most a minute."""
    deadline = time.monotonic() + 60
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path


@task
def mark(path: str, label: str) -> str:
    """Appends `label` to the file `path`: the order in which a worker ran the calls."""
    with open(path, "a") as handle:
        handle.write(f"{label}\n")
    return label


def _record(name: str, task_result: Any) -> None:
    target = os.environ.get("DURABLE_FLOW_TEST_SIGNALS")
    if target and task_result.task.func.__module__ == __name__:
        with open(target, "a") as handle:
            handle.write(f"{name} {task_result.id} {task_result.status} {task_result.attempts}\n")


def _on_started(sender: type, task_result: Any, **kwargs: Any) -> None:
    _record("started", task_result)


def _on_finished(sender: type, task_result: Any, **kwargs: Any) -> None:
    _record("finished", task_result)


task_started.connect(_on_started, dispatch_uid="tests.contract_tasks.started")
task_finished.connect(_on_finished, dispatch_uid="tests.contract_tasks.finished")
