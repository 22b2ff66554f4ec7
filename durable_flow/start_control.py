"""Debounce and singleton: decided when a run starts, like start quotas (`quotas.py`).

`@workflow(..., debounce={"key": ..., "period": timedelta(seconds=5), "max_wait": ...})`:
starts with the same key inside `period` collapse into one run, which begins when `period` has
passed with no new start, with the latest start's input. The pending run is an ordinary
`WorkflowRun` in status `debounced` whose `wake_at` is when it begins: the timer poller wakes it
like a sleeping run, so it survives any process dying. A start that finds the key's debounced
run (not yet due) overwrites its input and pushes `wake_at` back by `period`, never past
`debounce_until` (first start + `max_wait`). A start after the run is due opens a new one.

`@workflow(..., singleton={"key": ..., "mode": "skip" | "cancel"})`: at most one run per key
in progress (`pending`, `running`, `suspended`; a run `cancelling` is no longer in progress:
its last step's result will be ignored). `skip` returns the run in progress and creates
nothing; `cancel` cancels it and starts the new run.

Keys are scoped to the workflow, stored in `WorkflowRun.start_key`, and declared as for step
concurrency (`keys.py`: CEL over `input`, or a callable of the input). Race safety is the start
quota's: the lookup and the INSERT run under the key's lock (`quotas.lock_key`: a PostgreSQL
advisory transaction lock; SQLite's IMMEDIATE transaction is already the database's write lock),
so concurrent starts of one key never make two debounced or two in-progress runs. The poller
takes a due debounced run `FOR UPDATE SKIP LOCKED`, and a start updates the run under its row
lock, so a run is either pushed back or started, never both.

Scope: top-level starts (`start`, `rerun`, the HTTP API, the tasks backend). A child run is part
of its parent's deterministic replay and is neither debounced nor skipped. `retry` of a failed or
cancelled singleton run is refused while another run of its key is in progress (`retry_conflict`):
either mode, as a retry resumes an old run rather than starting a new one; a task run's
singleton is its task's (the built-in workflow's `start_checks`, `task_runner.TaskStartChecks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol

from durable_flow.exceptions import InvalidInput, RegistrationError
from durable_flow.keys import MAX_KEY_LENGTH, Key, evaluate_key, parse_key
from durable_flow.quotas import lock_key
from durable_flow.validation import duration_problem

if TYPE_CHECKING:
    from durable_flow.models import WorkflowRun
    from durable_flow.registry import WorkflowDefinition

SingletonMode = Literal["skip", "cancel"]
SINGLETON_MODES: tuple[SingletonMode, ...] = ("skip", "cancel")
#: A singleton's run "in progress": literal names, as this module is imported before the models.
IN_PROGRESS: tuple[str, ...] = ("pending", "running", "suspended")
#: `StartCounter.outcome` values: a start folded into a debounced run, skipped by a singleton,
#: or one that cancelled the singleton's run in progress.
OUTCOMES: tuple[str, ...] = ("debounced", "skipped", "replaced")


class Runs(Protocol):
    """What a gate asks of the engine starting the run (`engine.lifecycle.Lifecycle`)."""

    def now(self) -> datetime:
        """The engine's clock."""

    def cancel(self, run_id: str) -> object:
        """Cancel a run (a singleton's `cancel` mode replaces the run in progress)."""


@dataclass(frozen=True)
class DebounceSpec:
    """A parsed `debounce=`: starts of one key within `period` of each other make one run,
    begun at most `max_wait` after the first of them (None: no cap)."""

    key: Key
    period: timedelta
    max_wait: timedelta | None = None


@dataclass(frozen=True)
class SingletonSpec:
    """A parsed `singleton=`: one run per key in progress; `mode` says what a new start does."""

    key: Key
    mode: SingletonMode = "skip"


StartControl = DebounceSpec | SingletonSpec


def _positive(where: str, value: object) -> timedelta:
    # Bounded above too: a run's wake time is `now + period`, which a huge timedelta overflows.
    problem = duration_problem(value)
    if problem:
        raise RegistrationError(f"{where} {problem}")
    return value  # type: ignore[return-value]  # a timedelta, checked above


def _fields(where: str, value: object, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RegistrationError(f"{where} must be a dict, got {type(value).__name__}")
    unknown = sorted(set(map(str, value)) - allowed)
    if unknown:
        raise RegistrationError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if "key" not in value:
        raise RegistrationError(f"{where} needs a 'key'")
    return value


def parse_start_control(workflow: str, debounce: object, singleton: object) -> StartControl | None:
    """Parse `@workflow(..., debounce=..., singleton=...)` once, at registration; every error is
    a `RegistrationError` naming the workflow and the field."""
    if debounce is not None and singleton is not None:
        raise RegistrationError(f"workflow {workflow!r}: debounce and singleton cannot be combined")
    if debounce is not None:
        where = f"workflow {workflow!r}: debounce"
        value = _fields(where, debounce, {"key", "period", "max_wait"})
        if "period" not in value:
            raise RegistrationError(f"{where} needs a 'period'")
        period = _positive(f"{where} period", value["period"])
        max_wait = value.get("max_wait")
        if max_wait is not None and _positive(f"{where} max_wait", max_wait) < period:
            raise RegistrationError(f"{where} max_wait ({max_wait}) must be at least the period ({period})")
        return DebounceSpec(key=parse_key(where, value["key"]), period=period, max_wait=max_wait)
    if singleton is not None:
        where = f"workflow {workflow!r}: singleton"
        value = _fields(where, singleton, {"key", "mode"})
        mode = value.get("mode", "skip")
        if mode not in SINGLETON_MODES:
            raise RegistrationError(f"{where} mode must be one of {', '.join(SINGLETON_MODES)}, got {mode!r}")
        return SingletonSpec(key=parse_key(where, value["key"]), mode=mode)
    return None


@dataclass(frozen=True)
class StartGate:
    """One start's evaluated debounce or singleton: what `apply` does inside its transaction.
    `label` names the declaring workflow or task in the counts (`StartCounter.workflow`)."""

    control: StartControl
    key: str
    workflow: str
    label: str

    @property
    def lock_name(self) -> str:
        kind = "debounce" if isinstance(self.control, DebounceSpec) else "singleton"
        return f"{kind}:{self.workflow}:{self.key}"

    def apply(self, runs: Runs, fields: dict[str, Any]) -> WorkflowRun | None:
        """Under the key's lock: the run this start resolves to without creating one (a
        debounced run it was folded into, or the singleton's run in progress when skipping),
        or None, having set in `fields` what the new run needs (its key; `debounced` status and
        wake time). Must run in the transaction that INSERTs the run. A run returned carries
        `start_outcome` (`"debounced"` or `"skipped"`), so a caller can tell it was not created."""
        lock_key(self.lock_name)
        fields["start_key"] = self.key
        if isinstance(self.control, DebounceSpec):
            return self._debounce(runs, self.control, fields)
        return self._singleton(runs, self.control)

    def _debounce(self, runs: Runs, spec: DebounceSpec, fields: dict[str, Any]) -> WorkflowRun | None:
        from durable_flow.counters import count_start
        from durable_flow.engine.locking import one
        from durable_flow.models import RunStatus, WorkflowRun

        now = runs.now()
        waiting = WorkflowRun.objects.select_for_update().filter(
            start_key=self.key, status=RunStatus.DEBOUNCED, workflow=self.workflow, wake_at__gt=now
        )
        run = one(waiting)
        if run is None:
            until = now + spec.max_wait if spec.max_wait is not None else None
            fields.update(status=RunStatus.DEBOUNCED, wake_at=_capped(now + spec.period, until), debounce_until=until)
            return None
        run.input = fields["input"]
        run.step_concurrency = fields["step_concurrency"]
        run.wake_at = _capped(now + spec.period, run.debounce_until)
        run.save(update_fields=["input", "step_concurrency", "wake_at", "updated_at"])
        count_start(self.label, "debounced")
        run.start_outcome = "debounced"  # type: ignore[attr-defined]
        return run

    def _singleton(self, runs: Runs, spec: SingletonSpec) -> WorkflowRun | None:
        from durable_flow.counters import count_start
        from durable_flow.models import WorkflowRun

        current = list(
            WorkflowRun.objects.filter(start_key=self.key, workflow=self.workflow, status__in=IN_PROGRESS).order_by(
                "created_at"
            )
        )
        if not current:
            return None
        if spec.mode == "skip":
            count_start(self.label, "skipped")
            current[0].start_outcome = "skipped"  # type: ignore[attr-defined]
            return current[0]
        for run in current:
            runs.cancel(run.pk)
        count_start(self.label, "replaced")
        return None


def retry_conflict(control: StartControl | None, run: WorkflowRun) -> str | None:
    """Under the key's lock: the id of another run of `run`'s singleton key in progress, which a
    retry of `run` would make two of, or None. `control` is the one `run` started under (its
    workflow's, or its task's). Must run in the retry's transaction."""
    from durable_flow.models import WorkflowRun

    if not isinstance(control, SingletonSpec) or not run.start_key:
        return None
    gate = StartGate(control=control, key=run.start_key, workflow=run.workflow, label=run.workflow)
    lock_key(gate.lock_name)
    others = WorkflowRun.objects.filter(start_key=run.start_key, workflow=run.workflow, status__in=IN_PROGRESS)
    return others.exclude(pk=run.pk).values_list("pk", flat=True).first()


def _capped(wake_at: Any, until: Any) -> Any:
    return wake_at if until is None else min(wake_at, until)


def plan(definition: WorkflowDefinition, input: Any, run_id: str) -> StartGate | None:
    """The gate a start of `definition` passes, its key evaluated now (before any transaction):
    `InvalidInput` when the key is not a non-empty string, and nothing is created."""
    if definition.start_control is None:
        return None
    return evaluate(definition.start_control, input, run_id, definition.name)


def evaluate(control: StartControl, input: Any, run_id: str, workflow: str, task: str | None = None) -> StartGate:
    """`control`'s gate for one start of `workflow`. A `task` (its module path) declared it on a
    `django.tasks` task: every task runs as the workflow `durable_flow.task`, so the stored key
    is `<task>:<key>`, keeping each task's keys apart. `InvalidInput` for a bad key."""
    kind = "debounce" if isinstance(control, DebounceSpec) else "singleton"
    label = workflow if task is None else task
    where = f"{'workflow' if task is None else 'task'} {label!r}: {kind}"
    key = evaluate_key(control.key, where, input, run_id, workflow)
    if task is not None:
        key = f"{task}:{key}"
        if len(key) > MAX_KEY_LENGTH:
            raise InvalidInput(f"{where} key {key!r} is over {MAX_KEY_LENGTH} characters with the task's path")
    return StartGate(control=control, key=key, workflow=workflow, label=label)


def usage() -> list[dict[str, Any]]:
    """Per workflow declaring debounce or singleton: its settings, the runs waiting out a debounce
    now, and the starts debounced, skipped and replaced so far (the dashboard's overview)."""
    from django.db.models import Count

    from durable_flow.counters import start_outcomes
    from durable_flow.keys import describe_key
    from durable_flow.models import RunStatus, WorkflowRun
    from durable_flow.registry import workflows

    declared = {name: d.start_control for name, d in workflows().items() if d.start_control is not None}
    counts = start_outcomes()
    if not declared and not counts:
        return []
    waiting = dict(
        WorkflowRun.objects.filter(status=RunStatus.DEBOUNCED, workflow__in=list(declared))
        .values("workflow")
        .annotate(n=Count("id"))
        .values_list("workflow", "n")
    )
    rows = []
    for name, control in sorted(declared.items()):
        if isinstance(control, DebounceSpec):
            rule = f"debounce {control.period.total_seconds():g} s"
            if control.max_wait is not None:
                rule += f", max wait {control.max_wait.total_seconds():g} s"
        else:
            rule = f"singleton, {control.mode}"
        rows.append(
            {
                "workflow": name,
                "rule": rule,
                "key": describe_key(control.key),
                "debouncing": waiting.get(name, 0),
                **{outcome: counts.get((name, outcome), 0) for outcome in OUTCOMES},
            }
        )
    # Tasks (`tasks.debounce`/`tasks.singleton`) are declared on functions no registry lists:
    # they show once they have counted a start.
    for label in sorted({label for label, _ in counts} - set(declared)):
        outcomes = {outcome: counts.get((label, outcome), 0) for outcome in OUTCOMES}
        rows.append({"workflow": label, "rule": "task", "key": "", "debouncing": None, **outcomes})
    return rows
