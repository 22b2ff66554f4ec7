"""Debounce and singleton: decided when a run starts, like start quotas (`quotas`).

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
concurrency (`keys`: CEL over `input`, or a callable of the input). Race safety is the start
quota's: the lookup and the INSERT run under the key's lock (`durable_flow.store.quotas.lock_key`:
a PostgreSQL advisory transaction lock; SQLite's IMMEDIATE transaction is already the database's
write lock), so concurrent starts of one key never make two debounced or two in-progress runs.
The poller takes a due debounced run `FOR UPDATE SKIP LOCKED`, and a start updates the run under
its row lock, so a run is either pushed back or started, never both.

Scope: top-level starts (`start`, `rerun`, the HTTP API, the tasks backend). A child run is part
of its parent's deterministic replay and is neither debounced nor skipped. `retry` of a failed or
cancelled singleton run is refused while another run of its key is in progress
(`retry_conflict`): either mode, as a retry resumes an old run rather than starting a new one; a
task run's singleton is its task's (the built-in workflow's `start_checks`,
`durable_flow.contrib.task_runner.TaskStartChecks`).

This module holds the declarations (`DebounceSpec`, `SingletonSpec`, parsed at registration);
`durable_flow.engine.start_gate` applies them when a run starts (`StartGate`, `retry_conflict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from durable_flow.config.validation import duration_problem
from durable_flow.definitions.keys import Key, parse_key
from durable_flow.exceptions import RegistrationError

if TYPE_CHECKING:
    pass

SingletonMode = Literal["skip", "cancel"]
SINGLETON_MODES: tuple[SingletonMode, ...] = ("skip", "cancel")
#: A singleton's run "in progress": literal names, as this module is imported before the models.
IN_PROGRESS: tuple[str, ...] = ("pending", "running", "suspended")
#: `StartCounter.outcome` values: a start folded into a debounced run, skipped by a singleton,
#: or one that cancelled the singleton's run in progress.
OUTCOMES: tuple[str, ...] = ("debounced", "skipped", "replaced")


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
