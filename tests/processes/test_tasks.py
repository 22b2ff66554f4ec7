"""`durable_flow.contrib.tasks.DurableFlowBackend`: Django's tasks framework on durable runs.

The framework's expectations for a backend (enqueue, results, statuses, priority, run_after,
validation) through the engine, plus one task run by a real `durable_worker` process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync

from durable_flow import register_queue, start
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.contrib.tasks import DurableFlowBackend, quota
from durable_flow.engine import Engine, set_engine
from durable_flow.exceptions import ConcurrencyLimitError, InvalidQuota
from durable_flow.models import QuotaRefusal, RunStatus, StartRefusal, WorkflowRun
from durable_flow.operations import api
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store import metric_counts
from durable_flow.transports.db.transport import DatabaseTransport
from durable_flow.transports.runner import EngineRunner
from tests import task_functions
from tests.conftest import ManagedProcess, MovableClock, wait_for
from tests.engine_support import transport_of
from tests.tasks_framework import (
    InvalidTaskError,
    TaskResultDoesNotExist,
    TaskResultStatus,
    default_task_backend,
    task_backends,
)


@pytest.fixture(autouse=True)
def _forget_calls() -> None:
    task_functions.CALLS.clear()


def test_the_backend_declares_what_it_supports() -> None:
    backend = task_backends["default"]
    assert isinstance(backend, DurableFlowBackend)
    assert (backend.supports_defer, backend.supports_get_result, backend.supports_priority) == (True, True, True)
    assert backend.supports_async_task


def test_enqueue_runs_the_task_as_a_durable_run_and_get_result_reads_it(engine: Engine) -> None:
    result = task_functions.add.enqueue(2, b=3)
    run = WorkflowRun.objects.get(pk=result.id)
    assert (run.workflow, run.status, run.output) == ("durable_flow.task", RunStatus.COMPLETED, 5)
    fetched = task_functions.add.get_result(result.id)
    assert fetched.status == TaskResultStatus.SUCCESSFUL
    assert fetched.return_value == 5
    assert (fetched.args, fetched.kwargs) == ([2], {"b": 3})
    assert fetched.attempts == 1 and fetched.errors == []
    assert fetched.enqueued_at is not None and fetched.started_at is not None and fetched.finished_at is not None
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5


def test_a_raising_task_fails_with_its_exception_class_and_traceback(engine: Engine) -> None:
    result = task_functions.explode.enqueue("boom")
    fetched = default_task_backend.get_result(result.id)
    assert fetched.status == TaskResultStatus.FAILED
    (error,) = fetched.errors
    assert error.exception_class is ValueError
    assert "boom" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        fetched.return_value  # noqa: B018


def test_an_async_task_function_runs(engine: Engine) -> None:
    result = task_functions.async_greet.enqueue("ada")
    assert task_functions.async_greet.get_result(result.id).return_value == "hello ada"


def test_a_task_taking_context_sees_its_own_result(engine: Engine) -> None:
    result = task_functions.with_context.enqueue(n=4)
    assert task_functions.with_context.get_result(result.id).return_value == {"id": result.id, "attempt": 1, "n": 4}


def test_aenqueue_and_aget_result(engine: Engine) -> None:
    async def enqueue_and_read() -> int | None:
        result = await task_functions.add.aenqueue(1, 1)
        return (await task_functions.add.aget_result(result.id)).return_value

    assert async_to_sync(enqueue_and_read)() == 2


def test_statuses_follow_the_run_ready_running_successful(manual: Engine) -> None:
    transport = transport_of(manual)
    result = task_functions.add.enqueue(1, 2)
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.READY
    transport.run_turns()
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.RUNNING
    transport.execute(transport.take())
    transport.run_turns()
    fetched = default_task_backend.get_result(result.id)
    assert fetched.status == TaskResultStatus.SUCCESSFUL
    assert fetched.worker_ids == ["manual"]


def test_a_cancelled_run_reads_as_failed(manual: Engine) -> None:
    from durable_flow import cancel

    result = task_functions.add.enqueue(1, 2)
    cancel(result.id)
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.FAILED


def test_run_after_is_a_durable_sleep_before_the_step(engine: Engine, clock: MovableClock) -> None:
    later = task_functions.add.using(run_after=clock() + timedelta(minutes=5), queue_name="later")
    result = later.enqueue(4, 4)
    assert WorkflowRun.objects.get(pk=result.id).status == RunStatus.SUSPENDED
    assert later.get_result(result.id).status == TaskResultStatus.READY
    assert task_functions.CALLS == []
    clock.advance(minutes=4)
    assert TimerPoller(engine).drain() == 0
    clock.advance(minutes=2)
    TimerPoller(engine).drain()
    assert later.get_result(result.id).return_value == 8
    assert task_functions.CALLS == [("add", 4, 4)]


def test_priority_orders_tasks_contending_for_a_capped_queue(manual: Engine, clock: MovableClock) -> None:
    transport = transport_of(manual)
    register_queue("capped", concurrency=1, retry_ms=1000)
    holder = task_functions.record.enqueue("holder")
    results = {
        label: task_functions.record.using(priority=priority).enqueue(label)
        for label, priority in (("low", -50), ("mid", 0), ("high", 50), ("top", 100))
    }
    transport.run_turns()
    ran = []
    for _ in range(5):
        (job,) = transport.steps  # the cap lets exactly one through at a time
        transport.execute(transport.take())
        ran.append(WorkflowRun.objects.get(pk=job.run_id).input["args"][0])
        transport.run_turns()
        clock.advance(seconds=1)
        TimerPoller(manual).drain()
        transport.run_turns()
    assert ran == ["holder", "top", "high", "mid", "low"]
    assert all(task_functions.record.get_result(r.id).status == TaskResultStatus.SUCCESSFUL for r in results.values())
    assert holder.id not in {r.id for r in results.values()}


def test_priority_rides_onto_the_dispatched_step(manual: Engine) -> None:
    transport = transport_of(manual)
    task_functions.add.using(priority=42).enqueue(1, 1)
    transport.run_turns()
    assert transport.steps[0].priority == 42


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"priority": 101}, "priority must be a whole number between -100 and 100"),
        ({"queue_name": "nope"}, "Queue 'nope' is not valid for backend"),
    ],
)
def test_invalid_task_options_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidTaskError, match=message):
        task_functions.add.using(**change)


def test_a_naive_run_after_is_refused() -> None:
    from datetime import datetime

    with pytest.raises(InvalidTaskError, match="run_after must be an aware datetime"):
        task_functions.add.using(run_after=datetime(2030, 1, 1))


def test_non_json_arguments_are_refused_before_anything_is_stored(engine: Engine) -> None:
    with pytest.raises(TypeError):
        task_functions.add.enqueue(object(), 1)
    assert not WorkflowRun.objects.exists()


def test_an_unknown_result_id_does_not_exist(engine: Engine) -> None:
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("no-such-run")


def test_a_plain_workflow_run_is_not_a_task_result(engine: Engine) -> None:
    run = start("tests.three_steps", 1)
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(run.id)


def test_a_result_belongs_to_the_backend_that_enqueued_it(engine: Engine) -> None:
    result = task_functions.on_other.enqueue(7)
    assert task_backends["other"].get_result(result.id).return_value == 7
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(result.id)


def test_a_real_worker_process_runs_tasks_in_priority_order_on_the_db_transport(
    transactional_db: None, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    transport = DatabaseTransport()
    engine = Engine(admission=DatabaseAdmissionBackend(), transport=transport, settings=get_settings())
    set_engine(engine)
    register_queue("capped", concurrency=1, retry_ms=200)
    marker = tmp_path / "order"
    results = [task_functions.record.using(priority=100).enqueue("first")]
    env = {"DURABLE_FLOW_ADMISSION": "db", "DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_TEST_MARKER": str(marker)}
    results += [
        task_functions.record.using(priority=priority).enqueue(label)
        for label, priority in (("low", -10), ("high", 90), ("mid", 10))
    ]
    # The four first turns run here, highest priority first: "first" takes the only slot and
    # the rest park in its line. (A worker claims step tasks ahead of turns, so left to the
    # worker, "first" would finish before the others asked, and nothing would contend.)
    source, runner = transport.source(), EngineRunner(engine, "test")
    for turn in source.claim("test", 10, 0):
        source.execute(runner, turn)
        source.done("test", turn)
    spawn("durable_poller", env=env)
    spawn("durable_worker", "--concurrency", "1", env=env)
    wait_for(
        lambda: all(task_functions.record.get_result(r.id).is_finished for r in results),
        timeout=60,
        what="all four tasks to finish",
    )
    assert [task_functions.record.get_result(r.id).return_value for r in results] == ["first", "low", "high", "mid"]
    # "first" held the only slot while the others waited; they were granted it by priority.
    assert marker.read_text().split() == ["first", "high", "mid", "low"]


def refused_under() -> dict[str, int]:
    """Refused starts by the name they are recorded under: the `StartRefusal` rows, which must
    agree with this process's `durable_flow_starts_refused_total` counts."""
    rows = Counter(StartRefusal.objects.values_list("workflow", flat=True))
    counted = {
        dict(labels)["workflow"]: int(value)
        for (metric, labels), value in metric_counts.pending().items()
        if metric == metric_counts.STARTS_REFUSED
    }
    assert counted == dict(rows)
    return counted


def test_a_task_declared_with_a_quota_refuses_enqueue_when_its_key_is_full(manual: Engine) -> None:
    first = task_functions.per_tenant.enqueue("acme", 1)
    with pytest.raises(ConcurrencyLimitError) as refused:
        task_functions.per_tenant.enqueue("acme", 2)
    assert (refused.value.key, refused.value.limit, refused.value.active) == ("tenant:acme", 1, 1)
    assert refused.value.workflow == "tests.task_functions.per_tenant"
    assert WorkflowRun.objects.count() == 1  # nothing stored for the refused call
    assert QuotaRefusal.objects.get(key="tenant:acme").refusals == 1
    assert refused_under() == {"tests.task_functions.per_tenant": 1}  # the task, not `durable_flow.task`
    task_functions.per_tenant.enqueue("globex", 3)  # another key has its own quota
    transport_of(manual).run_all()
    assert default_task_backend.get_result(first.id).status == TaskResultStatus.SUCCESSFUL
    assert task_functions.per_tenant.enqueue("acme", 4).status == TaskResultStatus.READY  # a slot freed


def test_a_rerun_of_a_task_run_passes_its_task_quota(manual: Engine) -> None:
    """A re-run is a new start of the task: over the task's quota it is refused like `enqueue`."""
    first = task_functions.per_tenant.enqueue("acme", 1)
    with pytest.raises(ConcurrencyLimitError) as refused:
        api.rerun(first.id)
    assert (refused.value.key, refused.value.active) == ("tenant:acme", 1)
    assert refused.value.workflow == "tests.task_functions.per_tenant"
    assert WorkflowRun.objects.count() == 1
    assert refused_under() == {"tests.task_functions.per_tenant": 1}


def test_a_retry_of_a_task_run_refused_by_its_task_quota_is_recorded_under_the_task(manual: Engine) -> None:
    first = task_functions.per_tenant.enqueue("acme", 1)
    api.cancel(first.id)  # its slot frees: another call takes it
    task_functions.per_tenant.enqueue("acme", 2)
    with pytest.raises(ConcurrencyLimitError) as refused:
        api.retry(first.id)
    assert (refused.value.key, refused.value.workflow) == ("tenant:acme", "tests.task_functions.per_tenant")
    assert refused_under() == {"tests.task_functions.per_tenant": 1}


def test_a_cel_quota_key_sees_args_and_kwargs_and_null_is_unlimited(manual: Engine) -> None:
    task_functions.per_team.enqueue()
    task_functions.per_team.enqueue()  # no team: no key, no limit
    task_functions.per_team.enqueue(team="red")
    with pytest.raises(ConcurrencyLimitError):
        task_functions.per_team.enqueue(team="red")
    assert WorkflowRun.objects.count() == 3


def test_a_bad_task_quota_fails_at_declaration() -> None:
    with pytest.raises(InvalidQuota, match="limit"):
        quota(key=lambda: "k", limit="eight")
    with pytest.raises(InvalidQuota, match="CEL"):
        quota(key="input.args[", limit=1)
