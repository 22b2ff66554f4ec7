"""The built-in workflow behind `durable_flow.tasks.DurableFlowBackend`: one `@task` call is one
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

from durable_flow.declared_tasks import declared_task
from durable_flow.exceptions import TaskNotDeclared
from durable_flow.registry import step, workflow

if TYPE_CHECKING:
    from durable_flow.start_control import StartControl
    from durable_flow.tasks import Task

TASK_WORKFLOW = "durable_flow.task"
TASK_STEP = "durable_flow.task.call"


def task_function(path: object) -> Any:
    """The function of the declared task at `path`; `TaskNotDeclared` (the run fails) otherwise."""
    return declared_task(path).func


def run_task_of(payload: object) -> Task | None:
    """The declared task a task run's input names, or None for a path no declared task has (the
    run fails at its step with `TaskNotDeclared`, whatever an operator's retry or re-run does)."""
    try:
        return declared_task(payload.get("task") if isinstance(payload, dict) else None)
    except TaskNotDeclared:
        return None


def task_start_control(payload: object) -> StartControl | None:
    """The debounce or singleton declared on the task a task run's input names
    (`tasks.singleton`), which a retry of the run passes again; None when the task declares none.

    A path no declared task has gives None too, so an operator's retry is never blocked by it:
    the retried run fails at its step with `TaskNotDeclared`, as the first attempt did."""
    task = run_task_of(payload)
    if task is None:
        return None
    # A declared task means the tasks framework imports, and `durable_flow.tasks` with it.
    from durable_flow.tasks import START_CONTROL_ATTRIBUTE

    control: StartControl | None = getattr(task.func, START_CONTROL_ATTRIBUTE, None)
    return control


@step(TASK_STEP)
def call_task(payload: dict[str, Any]) -> Any:
    """Run the task function with the enqueued args/kwargs, as the framework's runners do
    (`tasks.call_task_function`: its signals, a JSON return value); its exception fails the
    step (and the run), its return value is the run's output."""
    func = task_function(payload.get("task"))
    from durable_flow.tasks import call_task_function

    return call_task_function(payload, func)


@workflow(TASK_WORKFLOW, internal=True)
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
