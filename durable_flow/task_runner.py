"""The built-in workflow behind `durable_flow.tasks.DurableFlowBackend`: one `@task` call is one
durable run of `durable_flow.task`, whose single step imports the task function by path and
calls it.

Imported by `AppConfig.ready()` in every process (worker, poller, web), so a worker can run a
task's step whether or not its process ever touched the tasks backend. It needs neither
`django_tasks` nor `django.tasks` until a task runs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils.module_loading import import_string

from durable_flow.registry import step, workflow

TASK_WORKFLOW = "durable_flow.task"
TASK_STEP = "durable_flow.task.call"


def task_function(path: str) -> Any:
    """The function behind a task's module path (`@task` replaces the name with a `Task`)."""
    target = import_string(path)
    return getattr(target, "func", target)


@step(TASK_STEP)
def call_task(payload: dict[str, Any]) -> Any:
    """Run the task function with the enqueued args/kwargs, as the framework's runners do
    (`tasks.call_task_function`: its signals, a JSON return value); its exception fails the
    step (and the run), its return value is the run's output."""
    func = task_function(payload["task"])
    from durable_flow.tasks import call_task_function

    return call_task_function(payload, func)


@workflow(TASK_WORKFLOW)
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
