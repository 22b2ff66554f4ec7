"""The built-in workflow behind `durable_flow.contrib.tasks.DurableFlowBackend`: one `@task` call is one
durable run of `durable_flow.task`, whose single step calls the declared task its input names
(`declared_tasks`: the path is looked up, never imported). The workflow is internal: only the
backend starts it, never `start()`, the JSON API or a start form (its input would choose what runs).

Imported by `AppConfig.ready()` in every process (worker, poller, web), so a worker can run a
task's step whether or not its process ever touched the tasks backend. It needs neither
`django_tasks` nor `django.tasks` until a task runs.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from durable_flow.definitions import start_control
from durable_flow.definitions.declared_tasks import declared_task
from durable_flow.definitions.quotas import QuotaSpec
from durable_flow.definitions.registry import step, workflow
from durable_flow.engine import start_gate as gates
from durable_flow.exceptions import TaskNotDeclared

if TYPE_CHECKING:
    from django_tasks.base import Task

TASK_WORKFLOW = "durable_flow.task"
TASK_STEP = "durable_flow.task.call"
#: Where `tasks.quota` keeps a task's start quota: on its function (a `Task` is frozen).
QUOTA_ATTRIBUTE = "__durable_flow_quota__"
#: Where `tasks.debounce` and `tasks.singleton` keep a task's debounce or singleton.
START_CONTROL_ATTRIBUTE = "__durable_flow_start_control__"


def run_task_of(payload: object) -> Task | None:
    """The declared task a task run's input names, or None for a path no declared task has (the
    run fails at its step with `TaskNotDeclared`, whatever an operator's retry or re-run does)."""
    try:
        return declared_task(payload.get("task") if isinstance(payload, dict) else None)
    except TaskNotDeclared:
        return None


def declared_control(task: Task) -> start_control.StartControl | None:
    """The debounce or singleton `tasks.debounce` / `tasks.singleton` declared on `task`, if any."""
    control: start_control.StartControl | None = getattr(task.func, START_CONTROL_ATTRIBUTE, None)
    return control


def start_gate(task: Task, args: Any, kwargs: Any, result_id: str) -> gates.StartGate | None:
    """This call's debounce or singleton, its key evaluated (`InvalidInput` if not a string)."""
    control = declared_control(task)
    if control is None:
        return None
    call = {"args": list(args), "kwargs": dict(kwargs)}
    return gates.evaluate(control, call, result_id, TASK_WORKFLOW, task=task.module_path)


def start_quota(task: Task, args: Any, kwargs: Any) -> QuotaSpec | None:
    """The per-start quota of this call (its key resolved), or None when it is unlimited."""
    spec: QuotaSpec | None = getattr(task.func, QUOTA_ATTRIBUTE, None)
    if spec is None:
        return None
    key = spec.resolve_key({"args": list(args), "kwargs": dict(kwargs)})
    if key is None:
        return None
    return QuotaSpec(key=key, limit=spec.limit, count_statuses=spec.count_statuses)


class TaskStartChecks:
    """A task run starts under its task's quota, debounce or singleton (`tasks.quota`,
    `tasks.debounce`, `tasks.singleton`), which a retry and a re-run of the run pass again.

    A path no declared task has gives none, so an operator's retry or re-run is never blocked
    by it: the run fails at its step with `TaskNotDeclared`, as the first attempt did."""

    def control(self, input: Any) -> start_control.StartControl | None:
        """The debounce or singleton declared on the task the input names; None when it declares none."""
        task = run_task_of(input)
        return declared_control(task) if task is not None else None

    def checks(self, input: Any, run_id: str) -> tuple[QuotaSpec | None, gates.StartGate | None]:
        """The start quota and the debounce or singleton a new run `run_id` of this stored call
        passes, as `enqueue` checks them for the call."""
        task = run_task_of(input)
        if task is None:
            return None, None
        args, kwargs = input.get("args", []), input.get("kwargs", {})
        return start_quota(task, args, kwargs), start_gate(task, args, kwargs, run_id)

    def label(self, input: Any) -> str | None:
        """The declared task's path: a refused start is recorded under its task, not under
        `durable_flow.task` (every task's workflow)."""
        task = run_task_of(input)
        return task.module_path if task is not None else None


@step(TASK_STEP)
def call_task(payload: dict[str, Any]) -> Any:
    """Run the task function with the enqueued args/kwargs through the backend that declared it,
    as the framework's runners do (`DurableFlowBackend.call_declared_task`: its signals, a JSON
    return value); its exception fails the step (and the run), its return value is the run's
    output."""
    task = declared_task(payload.get("task"))
    return task.get_backend().call_declared_task(payload, task.func)


@workflow(TASK_WORKFLOW, internal=True, start_checks=TaskStartChecks())
def run_task(ctx: Any, payload: dict[str, Any]) -> Any:
    """`run_after` is a durable sleep; the call goes through the flow-control queue named by
    the task's `queue_name`, at the task's priority (admission order and broker priority)."""
    if payload.get("run_after"):
        ctx.sleep_until(datetime.fromisoformat(payload["run_after"]))
    call = {key: payload[key] for key in ("task", "args", "kwargs", "takes_context") if key in payload}
    # The run's own id, not the payload's: a debounced task's run keeps the latest call's payload,
    # whose result id was never created.
    return ctx.step(
        call_task,
        {**call, "result_id": ctx.run_id},
        queue=payload.get("queue") or None,
        priority=payload.get("priority", 0),
    )
