"""Debounce and singleton at start time: one start's evaluated gate (`StartGate`), applied under
the key's lock inside the transaction that INSERTs the run, and the singleton check a retry
passes. The declarations (`DebounceSpec`, `SingletonSpec`) live in
`durable_flow.definitions.start_control`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from durable_flow.definitions.keys import MAX_KEY_LENGTH, evaluate_key
from durable_flow.definitions.start_control import IN_PROGRESS, DebounceSpec, SingletonSpec, StartControl
from durable_flow.engine.locking import one
from durable_flow.exceptions import InvalidInput
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.store.counters import count_start
from durable_flow.store.quotas import lock_key

if TYPE_CHECKING:
    from durable_flow.definitions.registry import WorkflowDefinition


class Runs(Protocol):
    """What a gate asks of the engine starting the run (`engine.lifecycle.Lifecycle`)."""

    def now(self) -> datetime:
        """The engine's clock."""

    def cancel(self, run_id: str) -> object:
        """Cancel a run (a singleton's `cancel` mode replaces the run in progress)."""


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
