"""The workflow and step registries, filled by the `@workflow` and `@step` decorators.

Modules named in `DURABLE_FLOW["WORKFLOWS"]` are imported by `AppConfig.ready()`, so every
process (web, worker, poller) knows the same workflows and steps.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

from asgiref.sync import async_to_sync

from durable_flow.config.limits import STEP_NAME_LENGTH, VERSION_LENGTH, WORKFLOW_NAME_LENGTH
from durable_flow.config.validation import (
    HOUR_S,
    MAX_COUNT,
    MAX_DURATION,
    duration_problem,
    number_problem,
    storable_text,
)
from durable_flow.definitions.events import (
    CancelSpec,
    EventDeclarationError,
    TriggerSpec,
    parse_cancel_on,
    parse_triggers,
)
from durable_flow.definitions.quotas import QuotaSpec, parse_workflow_quota
from durable_flow.definitions.schedules import ScheduleError, ScheduleSpec, parse_schedule
from durable_flow.definitions.start_control import StartControl, parse_start_control
from durable_flow.definitions.step_concurrency import ConcurrencySpec, parse_concurrency
from durable_flow.exceptions import InvalidInput, RegistrationError, StepNotFound, WorkflowNotFound

P = ParamSpec("P")
R = TypeVar("R")

WorkflowFn = Callable[[Any, Any], Any]

#: The most retries a step (or one call of it) may ask for: its attempts are counted in an
#: integer column (`StepCheckpoint.max_attempts`), which a run retried by hand raises by a whole
#: budget again each time, so a budget stays far below the column's limit.
MAX_RETRIES = 1_000_000

DEFAULT_BACKOFF = timedelta(seconds=1)
DEFAULT_MAX_BACKOFF = timedelta(minutes=5)
#: Past this many doublings any backoff above zero (1 µs at least) is over `MAX_DURATION`, so capped.
MAX_DOUBLINGS = 64


@dataclass(frozen=True, eq=False)
class StepDefinition(Generic[R]):
    """A registered step: a plain function of one JSON input, run on a worker and checkpointed."""

    name: str
    fn: Callable[[Any], R]
    retries: int = 0
    backoff: timedelta = DEFAULT_BACKOFF
    max_backoff: timedelta = DEFAULT_MAX_BACKOFF
    timeout: timedelta | None = None

    def __call__(self, input: Any) -> R:
        """Call the function directly (outside a workflow, e.g. in a unit test)."""
        return self.fn(input)

    def backoff_for(self, attempt: int) -> timedelta:
        """Exponential backoff after failed attempt number `attempt` (1-based), capped."""
        return exponential_backoff(attempt, self.backoff, self.max_backoff)


def exponential_backoff(
    attempt: int, backoff: timedelta = DEFAULT_BACKOFF, max_backoff: timedelta = DEFAULT_MAX_BACKOFF
) -> timedelta:
    """`backoff` doubled after each failed attempt (1-based), capped at `max_backoff`.

    The doubling is compared in seconds first: `backoff * 2**n` overflows a timedelta by the
    48th attempt of a one-second backoff, long before a large `retries` runs out.
    """
    doublings = min(max(0, attempt - 1), MAX_DOUBLINGS)
    if backoff.total_seconds() * 2.0**doublings >= max_backoff.total_seconds():
        return max_backoff
    return min(backoff * 2**doublings, max_backoff)


def step_backoff(name: str, attempt: int) -> timedelta:
    """The wait before retrying step `name` after failed attempt `attempt`. A step no longer
    registered in this process gets the `@step` defaults, so it backs off as it would have."""
    try:
        return get_step(name).backoff_for(attempt)
    except StepNotFound:
        return exponential_backoff(attempt)


class StartChecks(Protocol):
    """The start rules of a workflow whose input names what it runs, so each run's rules are
    those of what it names: the tasks backend's workflow, whose every task declares its own
    quota, debounce or singleton (`durable_flow.contrib.task_runner`). Asked by the operations
    that make a stored run active again, a re-run and a retry, which know nothing of what the
    input names."""

    def control(self, input: Any) -> StartControl | None:
        """The debounce or singleton a run of `input` started under (a retry checks it again)."""
        ...

    def checks(self, input: Any, run_id: str) -> tuple[QuotaSpec | None, Any]:
        """The start quota (its key resolved) and the gate (a `durable_flow.engine.start_gate.
        StartGate`, or None) a new run `run_id` of `input` passes (a re-run passes them as
        `start` would). The gate is typed `Any` here: it is the engine's, a layer above."""
        ...

    def label(self, input: Any) -> str | None:
        """The name a run of `input` is counted under where starts are (a refused start's
        `StartRefusal`, the `durable_flow_starts_refused` counter): what it names, e.g. its
        task's path; None for the workflow's own name."""
        ...


@dataclass(frozen=True, eq=False)
class WorkflowDefinition:
    """A registered workflow: `fn(ctx, input)`, replayed from the top on every turn."""

    name: str
    fn: WorkflowFn
    version: str = "1"
    quota: QuotaSpec | None = None
    concurrency: tuple[ConcurrencySpec, ...] = ()
    start_control: StartControl | None = None
    internal: bool = False
    start_checks: StartChecks | None = None
    schedule: ScheduleSpec | None = None
    #: The events that start a run of it (`trigger=`), each with its `trigger_if`.
    triggers: tuple[TriggerSpec, ...] = ()
    #: The events that cancel a run of it in progress (`cancel_on=`).
    cancel_on: tuple[CancelSpec, ...] = ()
    #: How long a finished run of it is kept (None: `POLLER["RUN_RETENTION_S"]`).
    retention: timedelta | None = None

    def __call__(self, ctx: Any, input: Any) -> Any:
        return self.fn(ctx, input)

    def control_for(self, input: Any) -> StartControl | None:
        """The debounce or singleton a run of `input` starts under: the workflow's own, or
        the one its input names (`start_checks`)."""
        return self.start_control if self.start_checks is None else self.start_checks.control(input)

    def label_for(self, input: Any) -> str:
        """The name a start of `input` is counted and refused under: the workflow's, or what its
        input names (`start_checks`: a `django.tasks` task's path)."""
        label = self.start_checks.label(input) if self.start_checks is not None else None
        return label or self.name


_workflows: dict[str, WorkflowDefinition] = {}
_steps: dict[str, StepDefinition[Any]] = {}


def _sync(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An `async def` step, callable from a worker thread: asgiref's `async_to_sync` runs it
    to completion (and carries the caller's context variables, so `current_step()` works)."""
    if not inspect.iscoroutinefunction(fn):
        return fn
    runner = async_to_sync(fn)

    @functools.wraps(fn)
    def call(input: Any) -> Any:
        return runner(input)

    return call


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    # A module imported twice under the same name (autoreload, test re-import) is not a clash.
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


#: Where each kind of registered name is stored, so its length limit is that column's.
NAME_LENGTHS = {"workflow": WORKFLOW_NAME_LENGTH, "step": STEP_NAME_LENGTH}


def _check_name(name: object, what: str) -> str:
    longest = NAME_LENGTHS[what]
    if not isinstance(name, str) or not name.strip() or len(name) > longest:
        raise RegistrationError(
            f"a {what} name must be a non-empty string of at most {longest} characters, got {name!r}"
        )
    return name


def _check_version(workflow: str, version: object) -> None:
    # Stored as text on every run (`WorkflowRun.version`): a string that fits, or a whole number.
    where = f"workflow {workflow!r}: version"
    if isinstance(version, str):
        try:
            storable_text(version, where, VERSION_LENGTH)
        except InvalidInput as exc:
            raise RegistrationError(str(exc)) from None
    elif problem := number_problem(version, minimum=-MAX_COUNT, maximum=MAX_COUNT, integer=True):
        raise RegistrationError(f"{where} must be a string or {problem.removeprefix('must be ')}")


#: The shortest and longest `retention` a workflow declares (the bounds of `RUN_RETENTION_S`).
MIN_RETENTION = timedelta(seconds=HOUR_S)


def _check_retention(workflow: str, retention: object) -> None:
    # Subtracted from the clock by the poller's every pass: a timedelta within bounds, checked here.
    if retention is None:
        return
    rule = f"must be None or a timedelta from 1 hour to {MAX_DURATION.days} days"
    if not isinstance(retention, timedelta) or not MIN_RETENTION <= retention <= MAX_DURATION:
        raise RegistrationError(f"workflow {workflow!r}: retention {rule}, got {retention!r}")


def workflow(
    name: str,
    *,
    version: str | int = "1",
    quota: QuotaSpec | Mapping[str, Any] | None = None,
    concurrency: int | Mapping[str, Any] | list[Mapping[str, Any]] | None = None,
    debounce: Mapping[str, Any] | None = None,
    singleton: Mapping[str, Any] | None = None,
    internal: bool = False,
    start_checks: StartChecks | None = None,
    schedule: str | Mapping[str, Any] | None = None,
    retention: timedelta | None = None,
    trigger: str | list[str] | None = None,
    trigger_if: str | None = None,
    cancel_on: str | Mapping[str, Any] | list[Any] | None = None,
) -> Callable[[WorkflowFn], WorkflowDefinition]:
    """Declare `fn(ctx, input)` as the workflow `name`.

    Bump `version` when you change the order of its calls: runs started under the old
    version fail with a clear non-determinism error instead of replaying wrongly.
    `quota` (`{"key": fn(input), "limit": n, "count_statuses": [...]}`) refuses a start at once
    with `ConcurrencyLimitError` when `limit` runs of its key are in flight; see
    `durable_flow.definitions.quotas`. `concurrency` (`10`, `{"limit": 2, "key":
    "input.account_id"}`, or a list of two) caps the step attempts executing at once per
    evaluated key; see `durable_flow.definitions.step_concurrency`.
    `debounce` (`{"key": "input.user", "period": timedelta(seconds=5), "max_wait": ...}`) folds
    starts of one key into one later run with the latest input; `singleton` (`{"key": ...,
    "mode": "skip" | "cancel"}`) keeps one run per key in progress; see
    `durable_flow.definitions.start_control`.
    `internal` marks a built-in workflow that only durable_flow starts (the tasks backend's, whose
    input names the code it runs): `start()`, the JSON API and the start forms refuse it by name.
    `start_checks` gives a built-in workflow the start rules its input names (`StartChecks`).
    `schedule` (`"0 3 * * *"`, or `{"cron": ..., "timezone": "Europe/Paris", "catch_up":
    "latest", "max_catch_up": 10, "input": ...}`) starts a run once per cron tick across the
    fleet, from the timer poller; see `durable_flow.definitions.schedules`.
    `retention` (`timedelta(days=7)`) is how long a finished run of it is kept before the poller
    deletes it, in place of `POLLER["RUN_RETENTION_S"]`; see `durable_flow.store.retention`.
    `trigger` (`"orders/created"` or a list) starts a run for every such event `send_event`
    records, with the event as its input, if `trigger_if` (CEL over `event`) holds; `cancel_on`
    (`[{"event": "orders/cancelled", "match": "async.data.id == event.data.id"}]`) cancels a run
    in progress when a matching event arrives; see `durable_flow.definitions.events`.
    """
    _check_name(name, "workflow")
    _check_version(name, version)
    _check_retention(name, retention)
    quota_spec = parse_workflow_quota(name, quota)
    concurrency_specs = parse_concurrency(name, concurrency)
    control = parse_start_control(name, debounce, singleton)
    schedule_spec = parse_schedule(name, schedule)
    if schedule_spec is not None and internal:
        raise ScheduleError(f"workflow {name!r}: a built-in workflow cannot be scheduled", "E013")
    triggers = parse_triggers(name, trigger, trigger_if)
    cancels = parse_cancel_on(name, cancel_on)
    if (triggers or cancels) and internal:
        raise EventDeclarationError(f"workflow {name!r}: a built-in workflow cannot declare events", "E024")

    def decorate(fn: WorkflowFn) -> WorkflowDefinition:
        existing = _workflows.get(name)
        if existing is not None and not _same_function(existing.fn, fn):
            raise RegistrationError(f"workflow {name!r} is already registered by {existing.fn.__module__}")
        definition = WorkflowDefinition(
            name=name,
            fn=fn,
            version=str(version),
            quota=quota_spec,
            concurrency=concurrency_specs,
            start_control=control,
            internal=internal,
            start_checks=start_checks,
            schedule=schedule_spec,
            retention=retention,
            triggers=triggers,
            cancel_on=cancels,
        )
        _workflows[name] = definition
        return definition

    return decorate


def step(
    name: str,
    *,
    retries: int = 0,
    backoff: timedelta = DEFAULT_BACKOFF,
    max_backoff: timedelta = DEFAULT_MAX_BACKOFF,
    timeout: timedelta | None = None,
) -> Callable[[Callable[[Any], R]], StepDefinition[R]]:
    """Declare a plain (or `async def`) function of one JSON input as the step `name`.

    `retries` failed attempts are retried after `backoff`, doubling each time (up to
    `max_backoff`); `timeout` re-dispatches an attempt whose result has not landed in time.
    """
    _check_name(name, "step")
    # Each attempt's number is stored (`StepCheckpoint.max_attempts`, an integer column), each
    # wait is added to a date: both are bounded here, not left to overflow on a worker.
    problems = {
        "retries": number_problem(retries, minimum=0, maximum=MAX_RETRIES, integer=True),
        "backoff": duration_problem(backoff, minimum="zero"),
        "max_backoff": duration_problem(max_backoff, minimum="zero"),
        "timeout": None if timeout is None else duration_problem(timeout),
    }
    for argument, problem in problems.items():
        if problem:
            raise RegistrationError(f"step {name!r}: {argument} {problem}")

    def decorate(fn: Callable[[Any], R]) -> StepDefinition[R]:
        existing = _steps.get(name)
        if existing is not None and not _same_function(existing.fn, fn):
            raise RegistrationError(f"step {name!r} is already registered by {existing.fn.__module__}")
        definition = StepDefinition(
            name=name, fn=_sync(fn), retries=retries, backoff=backoff, max_backoff=max_backoff, timeout=timeout
        )
        _steps[name] = definition
        return definition

    return decorate


def get_workflow(name: str) -> WorkflowDefinition:
    """The workflow registered as `name`, or `WorkflowNotFound`."""
    try:
        return _workflows[name]
    except KeyError:
        raise WorkflowNotFound(f"no workflow named {name!r} is registered") from None


def get_step(name: str) -> StepDefinition[Any]:
    """The step registered as `name`, or `StepNotFound`."""
    try:
        return _steps[name]
    except KeyError:
        raise StepNotFound(f"no step named {name!r} is registered") from None


def resolve_workflow(target: str | WorkflowDefinition) -> WorkflowDefinition:
    """Accept a workflow by name or definition; the definition must be the registered one."""
    if isinstance(target, WorkflowDefinition):
        return get_workflow(target.name)
    if isinstance(target, str):
        return get_workflow(target)
    # A typed refusal, like every other bad argument of the public API (it is a ValueError).
    raise InvalidInput(f"expected a workflow name or a @workflow function, got {type(target).__name__}")


def startable_workflow(target: str | WorkflowDefinition) -> WorkflowDefinition:
    """`resolve_workflow` for a start by a person or a caller's code: an internal workflow is
    refused with `WorkflowNotFound`, as an unknown one is."""
    definition = resolve_workflow(target)
    if definition.internal:
        raise WorkflowNotFound(
            f"workflow {definition.name!r} is built in and is not started by name (enqueue a @task instead)"
        )
    return definition


def workflows() -> dict[str, WorkflowDefinition]:
    """Every registered workflow, by name."""
    return dict(_workflows)


def startable_workflows() -> dict[str, WorkflowDefinition]:
    """The workflows `start()` and the start forms accept (every one but the internal ones)."""
    return {name: definition for name, definition in _workflows.items() if not definition.internal}


def scheduled_workflows() -> dict[str, WorkflowDefinition]:
    """The workflows that declare a `schedule=`, by name."""
    return {name: definition for name, definition in _workflows.items() if definition.schedule is not None}


def triggered_by(event: str) -> list[WorkflowDefinition]:
    """The workflows an event of this name starts, in name order (the order a delivery starts them)."""
    return sorted((d for d in _workflows.values() if any(t.event == event for t in d.triggers)), key=lambda d: d.name)


def cancelled_by(event: str) -> list[WorkflowDefinition]:
    """The workflows whose runs an event of this name may cancel, in name order."""
    return sorted((d for d in _workflows.values() if any(c.event == event for c in d.cancel_on)), key=lambda d: d.name)


def step_concurrency_declared() -> bool:
    """Whether any registered workflow declares step concurrency."""
    return any(definition.concurrency for definition in workflows().values())
