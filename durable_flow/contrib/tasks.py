"""A backend for Django's tasks framework that runs each `@task` call as a durable run.

    TASKS = {"default": {"BACKEND": "durable_flow.contrib.tasks.DurableFlowBackend", "QUEUES": ["default", "emails"]}}

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
from datetime import datetime, timedelta
from inspect import iscoroutinefunction
from traceback import format_exception
from typing import TYPE_CHECKING, Any, TypeVar

from asgiref.sync import async_to_sync
from django.utils import timezone
from django.utils.crypto import get_random_string

from durable_flow.config.limits import QUEUE_NAME_LENGTH
from durable_flow.config.settings import get_settings
from durable_flow.config.validation import bounded_depth, storable_text
from durable_flow.contrib.task_runner import (
    QUOTA_ATTRIBUTE,
    START_CONTROL_ATTRIBUTE,
    TASK_STEP,
    TASK_WORKFLOW,
    start_gate,
    start_quota,
)
from durable_flow.definitions import start_control
from durable_flow.definitions.current import StepInfo, step_or_none
from durable_flow.definitions.declared_tasks import declare, declared_task
from durable_flow.definitions.quotas import ACTIVE_STATUSES, QuotaSpec
from durable_flow.engine import get_engine
from durable_flow.exceptions import (
    InvalidInput,
    RegistrationError,
    RunNotFound,
    TaskNotDeclared,
)
from durable_flow.models import RunStatus, StepAttempt, StepCheckpoint, StepKind, WorkflowRun, dead_worker_cutoff
from durable_flow.operations import api
from durable_flow.store import queries

if TYPE_CHECKING:
    from collections.abc import Mapping

    from django.core.checks import CheckMessage

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
    from django.tasks.signals import task_enqueued, task_finished, task_started  # type: ignore[import-not-found]
    from django.utils.json import normalize_json  # type: ignore[import-not-found]
except ImportError:  # Django 5.2: the `django-tasks` backport.
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

__all__ = [
    "DurableFlowBackend",
    "InvalidTaskError",
    "TaskResultDoesNotExist",
    "debounce",
    "quota",
    "singleton",
]

F = TypeVar("F")


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
            storable_text(task.queue_name, "queue_name", QUEUE_NAME_LENGTH)
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
        # `start` is atomic on its own (run + first turn), and outside the caller's transaction
        # a refusal is recorded like any other, under the task's path (`TaskStartChecks.label`).
        run = get_engine().start(
            TASK_WORKFLOW,
            payload,
            run_id=result_id,
            tags=[f"task:{task.module_path}"],
            quota=start_quota(task, result.args, result.kwargs),
            gate=start_gate(task, result.args, result.kwargs, result_id),
            priority=task.priority,  # the first turn's: uncontended tasks run by priority too
        )
        if run.pk != result_id:  # folded into a debounced call, or skipped by a singleton
            return self._result(run)
        object.__setattr__(result, "enqueued_at", run.created_at)
        task_enqueued.send(type(self), task_result=result)
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

    def check(self, **kwargs: Any) -> Iterable[CheckMessage]:
        """`durable_flow.tasks.E001`: the `durable_flow` app is not installed, so nothing runs
        the enqueued runs (no models, no workflows, no worker command). Run by the framework's
        own check (`manage.py check`, with `django_tasks` installed on Django 5.2)."""
        from django.apps import apps
        from django.core import checks

        yield from super().check(**kwargs)
        if not apps.is_installed("durable_flow"):
            yield checks.Error(
                f"TASKS[{self.alias!r}] uses DurableFlowBackend but 'durable_flow' is not in INSTALLED_APPS.",
                hint="Add 'durable_flow' to INSTALLED_APPS: tasks run as its workflows, on its workers.",
                id="durable_flow.tasks.E001",
            )

    def call_declared_task(self, payload: Mapping[str, Any], func: Callable[..., Any]) -> Any:
        """Run one call of a task this backend declared, inside its run's step (the built-in
        workflow's, `task_runner`): `call_task_function`. Also what tells `declared_tasks` a
        task of this backend from another backend's."""
        return call_task_function(payload, func)

    def _result(self, run: WorkflowRun, running: StepInfo | None = None) -> TaskResult:
        """The task's result as `run`'s rows tell it; `running` is the attempt executing now in
        this thread (the worker's view: its rows may not record it yet)."""
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
        # One worker id per attempt (the framework counts attempts this way), from the attempts'
        # own rows; an attempt not recorded yet is this thread's (`running`) or one a live
        # worker lists in its heartbeat (an optimistic first step: `engine/optimistic.py`).
        workers = list(StepAttempt.objects.filter(checkpoint=call).values_list("worker", flat=True)) if call else []
        workers = [worker or self.alias for worker in workers]
        started = call.dispatched_at if call is not None else None
        status = STATUS_MAP[run.status]
        if running is not None:
            status, started = TaskResultStatus.RUNNING, started or timezone.now()
            workers += [self.alias] * (running.attempt - len(workers))
        elif status == TaskResultStatus.READY and call is None and (executing := _executing(run.id)) is not None:
            status, started = TaskResultStatus.RUNNING, executing[1]
            workers.append(executing[0])
        result = TaskResult(
            task=task,
            id=run.id,
            status=status,
            enqueued_at=run.created_at,
            started_at=started,
            finished_at=run.finished_at,
            last_attempted_at=started,
            args=payload.get("args", []),
            kwargs=payload.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            worker_ids=workers,
        )
        if run.status == RunStatus.COMPLETED:
            object.__setattr__(result, "_return_value", run.output)
        return result


def _executing(run_id: str) -> tuple[str, datetime] | None:
    """The live worker whose heartbeat lists `run_id`'s step as executing, and that heartbeat's
    time (the step started no later), or None: an optimistic first step, before any row
    records it (`queries.running_steps`)."""
    cutoff = dead_worker_cutoff(get_settings().heartbeat_ttl_s, timezone.now())
    for worker, running, seen in queries.live_workers(cutoff).values_list("worker_id", "running", "last_seen"):
        if any(queries.parse_running(item)[0] == run_id for item in running):
            return worker, seen
    return None


def _task_for(payload: Mapping[str, Any]) -> Task:
    """The `Task` as it was enqueued: the declared task with the call's queue and priority."""
    try:
        target = declared_task(payload.get("task"))
    except TaskNotDeclared as exc:
        raise TaskResultDoesNotExist(str(exc)) from None
    run_after = datetime.fromisoformat(payload["run_after"]) if payload.get("run_after") else None
    return target.using(priority=payload.get("priority"), queue_name=payload.get("queue"), run_after=run_after)


def _running_result(result_id: str) -> TaskResult:
    """The task's result as the worker running it sees it (inside the task's step)."""
    run = WorkflowRun.objects.get(pk=result_id)
    backend = _backend(run.input.get("backend", "default"))
    return backend._result(run, running=step_or_none())


def call_task_function(payload: Mapping[str, Any], func: Callable[..., Any]) -> Any:
    """Call a task's function as the framework's runners do: `task_started` before it, its
    return value normalised to JSON (a value JSON cannot hold fails the task with the framework's
    `TypeError`), `task_finished` after it with the outcome. The signals are sent by the worker
    (sender: the backend's class); `task_finished` goes out before the engine records the
    outcome, so a receiver reading the result back may still see it running.
    """
    result = _running_result(payload["result_id"])
    sender = type(_backend(result.backend))
    task_started.send(sender, task_result=result)
    args = list(payload.get("args", []))
    if payload.get("takes_context"):
        args.insert(0, TaskContext(task_result=result))
    call = async_to_sync(func) if iscoroutinefunction(func) else func
    try:
        value = normalize_json(call(*args, **payload.get("kwargs", {})))
    except BaseException as exc:  # the engine records any exception of user code as the failure
        error = TaskError(
            exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
            traceback="".join(format_exception(exc)),
        )
        result.errors.append(error)
        _finished(result, TaskResultStatus.FAILED)
        task_finished.send(sender, task_result=result)
        raise
    _finished(result, TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "_return_value", value)
    task_finished.send(sender, task_result=result)
    return value


def _finished(result: TaskResult, status: Any) -> None:
    object.__setattr__(result, "status", status)
    object.__setattr__(result, "finished_at", timezone.now())


def _backend(alias: str) -> DurableFlowBackend:
    try:
        from django.tasks import task_backends  # type: ignore[import-not-found]
    except ImportError:
        from django_tasks import task_backends
    backend = task_backends[alias]
    if not isinstance(backend, DurableFlowBackend):
        raise TaskResultDoesNotExist(f"TASKS[{alias!r}] is not a DurableFlowBackend")
    return backend
