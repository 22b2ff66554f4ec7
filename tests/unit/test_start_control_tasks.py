"""Debounce and singleton on `django.tasks` tasks: `@debounce`/`@singleton` beside `@task`,
decided at `enqueue` exactly as at a workflow's start (tests/processes/test_start_control.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from durable_flow.contrib.task_runner import TASK_WORKFLOW
from durable_flow.contrib.tasks import debounce, singleton
from durable_flow.engine import Engine
from durable_flow.exceptions import InvalidInput, RegistrationError, RetryRefused
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.operations import api, bulk
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store.counters import start_outcomes
from tests import task_functions
from tests.conftest import MovableClock
from tests.engine_support import transport_of
from tests.tasks_framework import TaskResultStatus, default_task_backend


def test_calls_of_a_debounced_task_make_one_run_with_the_last_args(manual: Engine, clock: MovableClock) -> None:
    results = [task_functions.reindex.enqueue("ann", n) for n in range(5)]
    assert {r.id for r in results} == {results[0].id}
    assert results[-1].status == TaskResultStatus.READY and results[-1].args == ["ann", 4]
    other = task_functions.reindex.enqueue("bob", 9)
    assert other.id != results[0].id
    transport_of(manual).run_all()
    assert WorkflowRun.objects.get(pk=results[0].id).status == RunStatus.DEBOUNCED  # nothing ran yet

    clock.advance(seconds=5)
    assert sorted(TimerPoller(manual).tick()) == sorted([results[0].id, other.id])
    transport_of(manual).run_all()
    done = default_task_backend.get_result(results[0].id)
    # The task's context names the run that ran, not the folded call's own (never created) id.
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == {"id": results[0].id, "n": 4}
    assert start_outcomes()[("tests.task_functions.reindex", "debounced")] == 4


def test_a_singleton_task_skips_while_its_key_runs_and_keys_are_per_task(manual: Engine) -> None:
    first = task_functions.sync_account.enqueue("a1")
    assert task_functions.sync_account.enqueue("a1").id == first.id
    assert task_functions.other_sync.enqueue("a1").id != first.id  # another task, its own keys
    assert WorkflowRun.objects.count() == 2
    assert start_outcomes()[("tests.task_functions.sync_account", "skipped")] == 1
    from durable_flow.observe.start_control import usage

    row = next(row for row in usage() if row["workflow"] == "tests.task_functions.sync_account")
    assert (row["rule"], row["skipped"], row["debouncing"]) == ("task", 1, None)
    transport_of(manual).run_all()
    assert default_task_backend.get_result(first.id).status == TaskResultStatus.SUCCESSFUL
    assert task_functions.sync_account.enqueue("a1").id != first.id  # finished: a new run


def test_a_task_key_that_is_not_a_string_refuses_the_enqueue(manual: Engine) -> None:
    with pytest.raises(InvalidInput, match=r"task 'tests\.task_functions\.sync_account': singleton key"):
        task_functions.sync_account.enqueue(7)
    assert not WorkflowRun.objects.exists()


def test_a_bad_task_declaration_fails_at_import() -> None:
    def fn(account: str) -> None: ...

    with pytest.raises(RegistrationError, match="mode must be one of skip, cancel"):
        singleton(key="input.args[0]", mode="newest")(fn)
    with pytest.raises(RegistrationError, match="period must be a positive timedelta"):
        debounce(key="input.args[0]", period=timedelta(0))(fn)
    with pytest.raises(RegistrationError, match="cannot be combined"):
        singleton(key="input.args[0]")(debounce(key="input.args[0]", period=timedelta(seconds=1))(fn))


# -- retry: a retried task run passes its task's singleton ---------------------------------------
@pytest.mark.parametrize("task", [task_functions.sync_account, task_functions.sync_latest], ids=["skip", "cancel"])
def test_a_task_run_retry_is_refused_while_another_run_of_its_singleton_key_is_in_progress(
    manual: Engine, task: Any
) -> None:
    first = task.enqueue("a1")
    api.cancel(first.id)
    second = task.enqueue("a1")
    with pytest.raises(RetryRefused, match=second.id):
        api.retry(first.id)
    assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.CANCELLED
    transport_of(manual).run_all()  # the key's run finishes
    api.retry(first.id)
    assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.PENDING


def test_a_bulk_retry_of_two_runs_of_one_task_singleton_key_retries_one(manual: Engine) -> None:
    first = task_functions.sync_account.enqueue("a1")
    api.cancel(first.id)
    second = task_functions.sync_account.enqueue("a1")
    api.cancel(second.id)
    result = bulk.retry_matching(WorkflowRun.objects.filter(pk__in=[first.id, second.id]))
    assert result.done == 1 and len(result.refused) == 1 and "in progress" in result.refused[0]
    statuses = sorted(WorkflowRun.objects.filter(pk__in=[first.id, second.id]).values_list("status", flat=True))
    assert statuses == [RunStatus.CANCELLED, RunStatus.PENDING]


def test_a_retry_of_a_run_whose_task_is_not_declared_is_not_blocked(manual: Engine) -> None:
    """Whether the path declared a singleton cannot be known without importing it: the retry goes
    ahead, and the run fails at its step with `TaskNotDeclared` as before."""
    from tests.support.tasks import task_payload

    key = "tests.gone.sync:a1"
    first = manual.start(TASK_WORKFLOW, task_payload("tests.gone.sync", "a1"))
    api.cancel(first.pk)
    second = manual.start(TASK_WORKFLOW, task_payload("tests.gone.sync", "a1"))
    WorkflowRun.objects.filter(pk__in=[first.pk, second.pk]).update(start_key=key)
    api.retry(first.pk)
    assert WorkflowRun.objects.get(pk=first.pk).status == RunStatus.PENDING


def test_a_rerun_of_a_task_run_passes_its_task_singleton(manual: Engine) -> None:
    """A re-run is a new start of the task: it is skipped while the key's run is in progress."""
    first = task_functions.sync_account.enqueue("a1")
    again = api.rerun(first.id)
    assert again.pk == first.id and WorkflowRun.objects.count() == 1


def test_a_skipped_rerun_does_not_mark_the_run_in_progress_as_a_rerun(manual: Engine) -> None:
    first = task_functions.sync_account.enqueue("a1")
    transport_of(manual).run_all()
    second = task_functions.sync_account.enqueue("a1")
    again = api.rerun(first.id)
    assert (again.pk, getattr(again, "start_outcome", None)) == (second.id, "skipped")
    assert WorkflowRun.objects.get(pk=second.id).rerun_of == ""
