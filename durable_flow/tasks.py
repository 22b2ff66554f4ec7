"""A backend for Django's tasks framework that runs each `@task` call as a durable run.

    TASKS = {"default": {"BACKEND": "durable_flow.tasks.DurableFlowBackend", "QUEUES": ["default", "emails"]}}

An enqueued task is a run of the built-in workflow `durable_flow.task` (see `task_runner`):
`run_after` is a durable sleep, then one step calls the task function through the flow-control
queue named by `queue_name` (its cap, rate window and fairness apply; an unregistered name is
not gated), at the task's `priority` (admission order, and the priority the transport gives the
step's job). The result id is the run id; `get_result` reads the run.

Written against the `django-tasks` backport (Django 5.2); on Django 6 the same class runs on
`django.tasks` through the import shim below.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.utils.crypto import get_random_string

from durable_flow import api, start_control
from durable_flow.declared_tasks import declare, declared_task
from durable_flow.exceptions import (
    ConcurrencyLimitError,
    InvalidInput,
    RegistrationError,
    RunNotFound,
    TaskNotDeclared,
)
from durable_flow.models import RunStatus, StepCheckpoint, StepKind, WorkflowRun
from durable_flow.quotas import ACTIVE_STATUSES, QuotaSpec
from durable_flow.task_runner import TASK_STEP, TASK_WORKFLOW
from durable_flow.validation import bounded_depth, max_length, storable_text

if TYPE_CHECKING:
    from collections.abc import Mapping

try:  # Django 6: the framework is in core.
    from django.tasks.backends.base import BaseTaskBackend  # type: ignore[import-not-found]
    from django.tasks.base import (  # type: ignore[import-not-found]
        Task,
        TaskContext,
        TaskError,
        TaskResult,
        TaskResultStatus,
    )
    from django.tasks.exceptions import InvalidTask as InvalidTaskError  # type: ignore[import-not-found]
    from django.tasks.exceptions import TaskResultDoesNotExist  # type: ignore[import-not-found]
except ImportError:  # Django 5.2: the `django-tasks` backport.
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist

__all__ = [
    "DurableFlowBackend",
    "InvalidTaskError",
    "TaskResultDoesNotExist",
    "debounce",
    "quota",
    "singleton",
    "task_context",
]

F = TypeVar("F")
QUOTA_ATTRIBUTE = "__durable_flow_quota__"
START_CONTROL_ATTRIBUTE = "__durable_flow_start_control__"


def quota(
    *,
    key: Callable[..., str | None] | str,
    limit: int | Callable[[str], Any],
    count_statuses: Iterable[str] = ACTIVE_STATUSES,
) -> Callable[[F], F]:
    """Declare a start quota on a task: over it, `enqueue` raises `ConcurrencyLimitError` at once
    and stores nothing, exactly as `start` does for a workflow's quota (see "Start quotas").

        @task(queue_name="reports")
        @quota(key=lambda tenant, **_: f"tenant:{tenant}", limit=2)
        def build_report(tenant, month): ...

    `key` is called like the task (with the enqueued, JSON-normalised args and kwargs), or is a
    CEL expression over `input`, the mapping `{"args": [...], "kwargs": {...}}`; None/null leaves
    that call unlimited. `limit` and `count_statuses` are those of a workflow quota. The quota is
    parsed here, at import: a bad one raises `InvalidQuota` naming the field. Stack it under or
    over `@task`.
    """
    by_call: Any = key
    if callable(key):

        def by_call(call: dict[str, Any]) -> str | None:
            return key(*call["args"], **call["kwargs"])

    spec = QuotaSpec.build({"key": by_call, "limit": limit, "count_statuses": count_statuses}, per_start=False)

    def declare(target: F) -> F:
        # `@task` keeps the function on `.func`; the `Task` itself is a frozen dataclass.
        setattr(getattr(target, "func", target), QUOTA_ATTRIBUTE, spec)
        return target

    return declare


def debounce(
    *, key: Callable[..., str] | str, period: timedelta, max_wait: timedelta | None = None
) -> Callable[[F], F]:
    """Debounce a task: calls with the same key within `period` collapse into one run, begun once
    `period` passes with no new call, with the latest call's args (see "Debounce and singleton").

        @task
        @debounce(key=lambda user_id: f"user:{user_id}", period=timedelta(seconds=5))
        def reindex(user_id): ...

    `key` is called with the call's args and kwargs (not a `takes_context` context), or is a CEL
    expression over `input` (`{"args", "kwargs"}`); keys are per task. `enqueue` returns the
    pending run's result (status `READY`). A bad declaration raises `RegistrationError` at
    import. Stack it under or over `@task`."""
    return _declare_start_control({"key": key, "period": period, "max_wait": max_wait}, None)


def singleton(*, key: Callable[..., str] | str, mode: str = "skip") -> Callable[[F], F]:
    """One run of the task per key in progress: `skip` returns the run in progress's result,
    `cancel` cancels it and starts this call (see "Debounce and singleton"). `key` as `debounce`."""
    return _declare_start_control(None, {"key": key, "mode": mode})


def _declare_start_control(debounced: dict[str, Any] | None, single: dict[str, Any] | None) -> Callable[[F], F]:
    options = debounced or single or {}
    key = options["key"]
    if callable(key):

        @functools.wraps(key)  # errors name the user's function, not this wrapper
        def by_call(call: dict[str, Any]) -> Any:
            return key(*call["args"], **call["kwargs"])

        options = {**options, "key": by_call}

    def declare(target: F) -> F:
        func = getattr(target, "func", target)
        name = f"{func.__module__}.{func.__qualname__}"
        if getattr(func, START_CONTROL_ATTRIBUTE, None) is not None:
            raise RegistrationError(f"task {name!r}: debounce and singleton cannot be combined")
        control = start_control.parse_start_control(
            name, options if debounced is not None else None, options if single is not None else None
        )
        setattr(func, START_CONTROL_ATTRIBUTE, control)
        return target

    return declare


def _start_gate(task: Task, args: Any, kwargs: Any, result_id: str) -> start_control.StartGate | None:
    """This call's debounce or singleton, its key evaluated (`InvalidInput` if not a string)."""
    control: start_control.StartControl | None = getattr(task.func, START_CONTROL_ATTRIBUTE, None)
    if control is None:
        return None
    call = {"args": list(args), "kwargs": dict(kwargs)}
    return start_control.evaluate(control, call, result_id, TASK_WORKFLOW, task=task.module_path)


def _start_quota(task: Task, args: Any, kwargs: Any) -> QuotaSpec | None:
    """The per-start quota of this call (its key resolved), or None when it is unlimited."""
    spec: QuotaSpec | None = getattr(task.func, QUOTA_ATTRIBUTE, None)
    if spec is None:
        return None
    key = spec.resolve_key({"args": list(args), "kwargs": dict(kwargs)})
    if key is None:
        return None
    return QuotaSpec(key=key, limit=spec.limit, count_statuses=spec.count_statuses)


def start_checks(
    task: Task, payload: Mapping[str, Any], run_id: str
) -> tuple[QuotaSpec | None, start_control.StartGate | None]:
    """The start quota and the debounce or singleton a new run `run_id` of this stored call
    passes (a re-run of a task run), as `enqueue` checks them for the call."""
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    return _start_quota(task, args, kwargs), _start_gate(task, args, kwargs, run_id)


class StoredTaskError(TaskError):
    """A failure read from a run. Its class path is stored text, so `exception_class` resolves
    it among the modules this process has already imported, by `vars()` (no module `__getattr__`
    runs), and imports nothing: the framework's `TaskError` would import any path a row holds."""

    __slots__ = ()

    @property
    def exception_class(self) -> type[BaseException]:
        module_name, _, name = self.exception_class_path.rpartition(".")
        module = sys.modules.get(module_name)
        found = vars(module).get(name) if module is not None else None
        if not (isinstance(found, type) and issubclass(found, BaseException)):
            raise ValueError(
                f"{self.exception_class_path!r} is no exception class of a module this process has "
                "imported (a stored class path is never imported)"
            )
        return found


STATUS_MAP: Mapping[str, Any] = {
    # Parked (admission, run_after sleep, backoff) or waiting for a worker: ready to run.
    RunStatus.PENDING: TaskResultStatus.READY,
    RunStatus.DEBOUNCED: TaskResultStatus.READY,
    RunStatus.SUSPENDED: TaskResultStatus.READY,
    RunStatus.RUNNING: TaskResultStatus.RUNNING,
    RunStatus.CANCELLING: TaskResultStatus.RUNNING,
    RunStatus.COMPLETED: TaskResultStatus.SUCCESSFUL,
    RunStatus.FAILED: TaskResultStatus.FAILED,
    RunStatus.CANCELLED: TaskResultStatus.FAILED,
}


class DurableFlowBackend(BaseTaskBackend):
    """`@task` calls as one-step durable runs, through durable_flow's transport, workers and queues."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def validate_task(self, task: Task) -> None:
        """The framework's checks, then the queue name, by `ctx.step(queue=...)`'s rule (non-empty,
        storable, at most the checkpoint column's length): `InvalidTaskError`, nothing stored.
        A valid task is declared: a task run may call it (`declared_tasks`)."""
        super().validate_task(task)
        try:
            storable_text(task.queue_name, "queue_name", max_length("StepCheckpoint", "queue"))
        except InvalidInput as exc:
            raise InvalidTaskError(str(exc)) from None
        declare(task)

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Start a `durable_flow.task` run for this call; the result id is the run id.

        Non-JSON args raise `TypeError`/`ValueError` from the framework's own normalisation,
        before anything is stored. A task declared with `@quota` refuses the call with
        `ConcurrencyLimitError` (naming the task) when its key is full; nothing is stored then.
        A task declared with `@debounce` or `@singleton` may return the result of the key's pending
        or in-progress run instead of a new one.
        """
        self.validate_task(task)
        # Before the framework's normalisation, which recurses a level at a time (a ValueError, as it raises).
        bounded_depth({"args": args, "kwargs": kwargs}, f"arguments of task {task.module_path!r}")
        result_id = get_random_string(32)  # the framework's own id length
        result = TaskResult(
            task=task,
            id=result_id,
            status=TaskResultStatus.READY,
            enqueued_at=None,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        payload = {
            "task": task.module_path,
            "args": result.args,
            "kwargs": result.kwargs,
            "queue": task.queue_name,
            "priority": task.priority,
            "run_after": task.run_after.isoformat() if task.run_after else None,
            "takes_context": task.takes_context,
            "backend": self.alias,
            "result_id": result_id,
        }
        from durable_flow.engine import get_engine

        try:
            # `start` is atomic on its own (run + first turn), and outside the caller's
            # transaction a refusal is counted in `QuotaRefusal` like any other.
            run = get_engine().start(
                TASK_WORKFLOW,
                payload,
                run_id=result_id,
                tags=[f"task:{task.module_path}"],
                quota=_start_quota(task, result.args, result.kwargs),
                gate=_start_gate(task, result.args, result.kwargs, result_id),
            )
        except ConcurrencyLimitError as exc:
            raise ConcurrencyLimitError(exc.key, exc.limit, exc.active, task.module_path) from None
        if run.pk != result_id:  # folded into a debounced call, or skipped by a singleton
            return self._result(run)
        object.__setattr__(result, "enqueued_at", run.created_at)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The task's state, read from its run; `TaskResultDoesNotExist` for an unknown id or
        a run that is not a task of this backend."""
        try:
            run = api.get_run(result_id)
        except RunNotFound:
            raise TaskResultDoesNotExist(result_id) from None
        if run.workflow != TASK_WORKFLOW or not isinstance(run.input, dict) or run.input.get("backend") != self.alias:
            raise TaskResultDoesNotExist(result_id)
        return self._result(run)

    def _result(self, run: WorkflowRun) -> TaskResult:
        payload: dict[str, Any] = run.input
        task = _task_for(payload)
        call = StepCheckpoint.objects.filter(run=run, kind=StepKind.STEP, name=TASK_STEP).first()
        errors = []
        if run.status == RunStatus.FAILED:
            error = (call.error if call is not None and call.error else None) or run.error or {}
            errors.append(
                StoredTaskError(
                    exception_class_path=str(error.get("type", "")), traceback=str(error.get("traceback", ""))
                )
            )
        attempts = call.attempt if call is not None else 0
        worker = (call.worker if call is not None else "") or self.alias
        started = call.dispatched_at if call is not None else None
        result = TaskResult(
            task=task,
            id=run.id,
            status=STATUS_MAP[run.status],
            enqueued_at=run.created_at,
            started_at=started,
            finished_at=run.finished_at,
            last_attempted_at=started,
            args=payload.get("args", []),
            kwargs=payload.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            # One entry per attempt (the framework counts attempts this way); the checkpoint
            # remembers only the last attempt's worker.
            worker_ids=[worker] * attempts,
        )
        if run.status == RunStatus.COMPLETED:
            object.__setattr__(result, "_return_value", run.output)
        return result


def _task_for(payload: Mapping[str, Any]) -> Task:
    """The `Task` as it was enqueued: the declared task with the call's queue and priority."""
    try:
        target = declared_task(payload.get("task"))
    except TaskNotDeclared as exc:
        raise TaskResultDoesNotExist(str(exc)) from None
    from datetime import datetime

    run_after = datetime.fromisoformat(payload["run_after"]) if payload.get("run_after") else None
    return target.using(priority=payload.get("priority"), queue_name=payload.get("queue"), run_after=run_after)


def task_context(result_id: str) -> TaskContext:
    """The context a `takes_context=True` task receives: its result as of now."""
    from durable_flow.models import WorkflowRun as Run

    run = Run.objects.get(pk=result_id)
    backend = _backend(run.input.get("backend", "default"))
    return TaskContext(task_result=backend._result(run))


def _backend(alias: str) -> DurableFlowBackend:
    try:
        from django.tasks import task_backends  # type: ignore[import-not-found]
    except ImportError:
        from django_tasks import task_backends
    backend = task_backends[alias]
    if not isinstance(backend, DurableFlowBackend):
        raise TaskResultDoesNotExist(f"TASKS[{alias!r}] is not a DurableFlowBackend")
    return backend
