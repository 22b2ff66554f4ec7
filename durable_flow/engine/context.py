"""`ctx`: what a workflow function calls. Each call is checkpointed under a deterministic key.

A turn replays the workflow from the top. A call whose checkpoint has settled returns the
recorded result at once; the first call that cannot (a step in flight, a sleep not yet due, a
blocked admission) raises `Suspend`, which unwinds the function: no thread or process waits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, Literal

from durable_flow.config.limits import FAIRNESS_KEY_LENGTH, QUEUE_NAME_LENGTH, SIGNAL_NAME_LENGTH
from durable_flow.config.settings import get_settings
from durable_flow.config.validation import (
    MAX_COUNT,
    MAX_DURATION,
    duration_problem,
    number_problem,
    start_timeout_outcome_problem,
    start_timeout_problem,
    storable_text,
)
from durable_flow.definitions.events import Condition, check_event_name, condition_for
from durable_flow.definitions.registry import (
    MAX_RETRIES,
    StepDefinition,
    WorkflowDefinition,
    get_step,
    resolve_workflow,
)
from durable_flow.definitions.serialization import readable
from durable_flow.engine.turn import PENDING, EngineUnavailable, StepOptions, Suspend, TurnEngine, engine_call
from durable_flow.engine.wait_causes import event_wait, signal_wait, timed
from durable_flow.exceptions import (
    ChildFailed,
    InvalidInput,
    NonDeterminismError,
    SignalTimeout,
    StartTimeoutError,
    StepFailed,
    UnknownEvent,
)
from durable_flow.models import (
    SETTLED_STEP_STATUSES,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WaitCause,
    WorkflowRun,
)
from durable_flow.store import quotas as quota_store

__all__ = ["PENDING", "EngineUnavailable", "StepOptions", "Suspend", "WorkflowContext", "engine_call"]

logger = logging.getLogger("durable_flow.engine")


PRIORITY_LIMIT = MAX_COUNT  # the database's integer column

PATCH_KEY_PREFIX = "patch:"
"""A `ctx.patched` marker's checkpoint key: `patch:<id>`, never a call's position, so adding or
removing a `ctx.patched` call moves no other call's key."""
PATCH_ID_LENGTH = 100 - len(PATCH_KEY_PREFIX)  # the checkpoint's key column


def _position(key: str) -> int:
    """The top-level call position of a checkpoint key (`3` for `3` and `3.17`); 0 for a marker."""
    head = key.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def _check_number(argument: str, value: object, *, minimum: int, maximum: int) -> None:
    """`InvalidInput` naming `argument` unless `value` is a whole number in range: a workflow's
    bad number fails its run at the call, never as an overflow inside the engine."""
    problem = number_problem(value, minimum=minimum, maximum=maximum, integer=True)
    if problem:
        raise InvalidInput(f"{argument} {problem}")


def _check_duration(argument: str, value: object, *, minimum: Literal["positive", "any"] = "positive") -> None:
    """`InvalidInput` naming `argument` unless `value` is a timedelta of at most ten years, so
    `now + value` is a date the engine can store."""
    problem = duration_problem(value, minimum=minimum)
    if problem:
        raise InvalidInput(f"{argument} {problem}")


class WorkflowContext:
    """The `ctx` handed to a workflow function for one turn."""

    def __init__(self, engine: TurnEngine, run: WorkflowRun, checkpoints: dict[str, StepCheckpoint]) -> None:
        self._engine = engine
        self._run = run
        self._checkpoints = checkpoints
        self._counter = 0
        self._next_sequence = max((cp.sequence for cp in checkpoints.values()), default=0) + 1
        self.now: datetime = engine.now()
        #: The earliest time something this turn waits on comes due (None: only results).
        self.wake_at: datetime | None = None
        #: Whether a step is executing somewhere (the run shows as running, not suspended).
        self.in_flight = False

    # -- identity -----------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self._run.id

    @property
    def input(self) -> Any:
        return self._run.input

    # -- public calls ---------------------------------------------------------------------
    def step(
        self,
        step: StepDefinition[Any],
        input: Any = None,
        *,
        queue: str | None = None,
        priority: int = 0,
        fairness_key: str | None = None,
        retries: int | None = None,
        timeout: timedelta | None = None,
        start_timeout: timedelta | float | None = None,
        on_start_timeout: str | None = None,
    ) -> Any:
        """Run `step(input)` on a worker, once, and return its result.

        `queue` subjects the call to a flow-control queue; `priority` and `fairness_key` decide
        who gets a contended slot. `retries`/`timeout` override the step's own defaults.
        `start_timeout` (a timedelta or seconds; default: the queue's `start_timeout_s`) bounds
        how long the call may wait for admission: then it gives up its place in line and, with
        `on_start_timeout="fail"` (the default), raises `StartTimeoutError` here; with
        `"skip"`, returns None.
        """
        options = self._options(step, queue, priority, fairness_key, retries, timeout, start_timeout, on_start_timeout)
        key = self._next_key()
        with engine_call():
            result = self._drive_step(key, step, input, options, group="")
        if result is PENDING:
            raise Suspend
        return result

    def all(
        self,
        target: StepDefinition[Any] | WorkflowDefinition | str,
        inputs: Sequence[Any],
        *,
        concurrency: int | None = None,
        queue: str | None = None,
        **step_options: Any,
    ) -> list[Any]:
        """Fan out over `inputs` and return the results in input order.

        Over a step: waves of `concurrency` steps, the next sent once the previous settled.
        Over a child workflow: two waves of `concurrency // 2` children in flight, the next
        going out as soon as one settles. Each settled wave costs the parent one turn.
        """
        if concurrency is not None:
            _check_number("ctx.all: concurrency", concurrency, minimum=1, maximum=MAX_COUNT)
        if isinstance(inputs, str | bytes) or not isinstance(inputs, Sequence):
            raise TypeError("ctx.all: inputs must be a list")
        base = self._next_key()
        if isinstance(target, StepDefinition):
            if queue is not None:
                raise ValueError(
                    "ctx.all: a step fan does not accept a queue; fan out over a child workflow whose "
                    "ctx.step names the queue, or enforce the limit in the step"
                )
            options = self._options(  # also checks that `target` is the registered step
                target,
                None,
                step_options.pop("priority", 0),
                None,
                step_options.pop("retries", None),
                step_options.pop("timeout", None),
                step_options.pop("start_timeout", None),
                step_options.pop("on_start_timeout", None),
            )
            if step_options:
                raise TypeError(f"ctx.all: unexpected option(s) {', '.join(sorted(step_options))}")
            with engine_call():
                return self._step_fan(base, target, list(inputs), concurrency or max(1, len(inputs)), options)
        if queue is not None or step_options:
            raise TypeError("ctx.all over a child workflow takes only inputs and concurrency")
        definition = resolve_workflow(target)
        with engine_call():
            return self._child_fan(base, definition, list(inputs), concurrency)

    def child(self, workflow: WorkflowDefinition | str, input: Any = None) -> Any:
        """Start a child run and return its output once it completes.

        The parent holds nothing while it waits. A child that fails or is cancelled raises
        `ChildFailed` here.
        """
        definition = resolve_workflow(workflow)
        key = self._next_key()
        with engine_call():
            result = self._drive_child(key, definition, input, group="")
        if result is PENDING:
            raise Suspend
        return result

    def sleep(self, duration: timedelta) -> None:
        """Suspend the run for `duration`; durable (the wake time is persisted)."""
        if not isinstance(duration, timedelta):
            raise TypeError("ctx.sleep takes a datetime.timedelta")
        _check_duration("ctx.sleep: duration", duration, minimum="any")  # zero or less returns at once
        key = self._next_key()
        with engine_call():
            self._drive_sleep(key, "sleep", lambda: self.now + duration)

    def sleep_until(self, when: datetime) -> None:
        """Suspend the run until `when` (an aware datetime)."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise TypeError("ctx.sleep_until takes a timezone-aware datetime")
        if when - self.now > MAX_DURATION:  # also keeps its UTC form (stored) inside datetime's range
            raise InvalidInput(
                f"ctx.sleep_until: when must be at most {MAX_DURATION.days} days from now, got {when.isoformat()}"
            )
        key = self._next_key()
        with engine_call():
            self._drive_sleep(key, "sleep_until", lambda: when)

    def wait_for_signal(self, name: str, timeout: timedelta | None = None) -> Any:
        """Suspend until `send_signal(run_id, name, payload)` arrives; return the payload.

        A signal sent before the wait is kept and consumed here. With `timeout`, raise
        `SignalTimeout` if none arrived in time.
        """
        storable_text(name, "ctx.wait_for_signal: signal name", SIGNAL_NAME_LENGTH)
        if timeout is not None:
            _check_duration("ctx.wait_for_signal: timeout", timeout)
        key = self._next_key()
        with engine_call():
            return self._drive_signal(key, name, timeout)

    def _drive_signal(self, key: str, name: str, timeout: timedelta | None) -> Any:
        cp = self._checkpoint(key, StepKind.SIGNAL, name) or self._new_wait(
            key, StepKind.SIGNAL, name, self.now + timeout if timeout is not None else None
        )
        if cp.status == StepStatus.DISPATCHED:
            payload = readable(self._engine.consume_signal(self._run, name, key), f"payload of signal {name!r}")
            if payload is not PENDING:
                self._engine.settle(cp, StepStatus.COMPLETED, output=payload)
            elif cp.wake_at is not None and cp.wake_at <= self.now:
                self._engine.settle(cp, StepStatus.FAILED, error={"type": "SignalTimeout", "message": name})
            else:
                self._wait_until(cp.wake_at)
                raise Suspend
        if cp.status == StepStatus.FAILED:
            raise SignalTimeout(f"signal {name!r} did not arrive in time")
        return cp.output

    def wait_for_event(self, name: str, *, match: str | None = None, timeout: timedelta | None = None) -> Any:
        """Suspend until an event `name` arrives after this call, for which the CEL expression
        `match` holds (`async`: the incoming event, `event`: this run's input, the triggering
        event of a run an event started); return the event (`{"name", "data", "id", "ts"}`), or
        None once `timeout` has passed without one. The run holds no slot while it waits.

            paid = ctx.wait_for_event("orders/paid", match="async.data.order_id == event.data.id",
                                      timeout=timedelta(days=1))

        An event recorded before the call never counts, as in the reference: send the event
        after the wait began (a signal, `wait_for_signal`, is kept for a wait to come)."""
        check_event_name(name, "ctx.wait_for_event: event name")
        if name not in get_settings().events:
            raise UnknownEvent(f'ctx.wait_for_event: event {name!r} is not declared in DURABLE_FLOW["EVENTS"]')
        condition = condition_for(match, "ctx.wait_for_event: match")
        if timeout is not None:
            _check_duration("ctx.wait_for_event: timeout", timeout)
        key = self._next_key()
        with engine_call():
            return self._drive_event(key, name, condition, timeout)

    def _drive_event(self, key: str, name: str, match: Condition | None, timeout: timedelta | None) -> Any:
        cp = self._checkpoint(key, StepKind.EVENT, name)
        if cp is None:
            spec = {"match": match.expression if match is not None else None}
            found = self._engine.find_event(name, match, self.now, self._run.input)
            if found is not PENDING:  # arrived since this turn began, before the wait was written
                fields = {"status": StepStatus.COMPLETED, "output": found, "finished_at": self.now}
            else:
                until = self.now + timeout if timeout is not None else None
                cause, detail = event_wait(name, spec["match"], until)
                fields = {"status": StepStatus.DISPATCHED, "wake_at": until, "wait_cause": cause, "wait_detail": detail}
            cp = self._engine.create_checkpoint(
                self._run,
                key=key,
                sequence=self._take_sequence(),
                kind=StepKind.EVENT,
                name=name,
                input=spec,
                dispatched_at=self.now,  # when the wait began: only events recorded since count
                **fields,
            )
            self._checkpoints[key] = cp
        if cp.status == StepStatus.DISPATCHED:
            if cp.wake_at is not None and cp.wake_at <= self.now:
                self._engine.settle(cp, StepStatus.COMPLETED, output=None)  # timed out
                return None
            self._wait_until(cp.wake_at)
            raise Suspend
        return cp.output

    def patched(self, patch_id: str) -> bool:
        """Whether this run takes the new side of the change named `patch_id`.

        True for a run that reaches this point under code that has the call: a new run, or one
        started before the change that had not got this far. False for a run that had already
        recorded a call past this point without the call (started under the old code and past
        the change): it keeps the old path its history was written by. The answer is recorded
        the first time (a `patch` checkpoint keyed `patch:<id>`, which takes no call position),
        so every later turn, and every later `patched` call with the same id, gets the same.
        """
        storable_text(patch_id, "ctx.patched: patch id", PATCH_ID_LENGTH)
        key = PATCH_KEY_PREFIX + patch_id
        cp = self._checkpoints.get(key)
        if cp is None:
            new_path = not any(_position(k) > self._counter for k in self._checkpoints)
            with engine_call():
                cp = self._engine.create_checkpoint(
                    self._run,
                    key=key,
                    sequence=self._take_sequence(),
                    kind=StepKind.PATCH,
                    name=patch_id,
                    status=StepStatus.COMPLETED,
                    output=new_path,
                    finished_at=self.now,
                )
            self._checkpoints[key] = cp
        elif cp.kind != StepKind.PATCH:
            raise NonDeterminismError(f"run {self._run.id}: checkpoint {key!r} is a {cp.kind}, not a patch marker")
        return cp.output is True

    # -- the machinery ----------------------------------------------------------------------
    def _next_key(self) -> str:
        self._counter += 1
        return str(self._counter)

    def _take_sequence(self) -> int:
        sequence = self._next_sequence
        self._next_sequence += 1
        return sequence

    def _wait_until(self, when: datetime | None) -> None:
        if when is not None and (self.wake_at is None or when < self.wake_at):
            self.wake_at = when

    def _registered_step(self, step: object) -> StepDefinition[Any]:
        if not isinstance(step, StepDefinition):
            raise TypeError(f"ctx.step needs a function decorated with @step, got {step!r}")

        if get_step(step.name) is not step:
            raise TypeError(f"step {step.name!r} is not the registered step of that name")
        return step

    def _options(
        self,
        step: StepDefinition[Any],
        queue: str | None,
        priority: int,
        fairness_key: str | None,
        retries: int | None,
        timeout: timedelta | None,
        start_timeout: timedelta | float | None = None,
        on_start_timeout: str | None = None,
    ) -> StepOptions:
        self._registered_step(step)
        if start_timeout is not None and (problem := start_timeout_problem(start_timeout)):
            raise InvalidInput(f"start_timeout {problem}")
        if on_start_timeout is not None and (problem := start_timeout_outcome_problem(on_start_timeout)):
            raise InvalidInput(f"on_start_timeout {problem}")
        if start_timeout is not None and not isinstance(start_timeout, timedelta):
            start_timeout = timedelta(seconds=start_timeout)
        if queue is not None:
            storable_text(queue, "queue", QUEUE_NAME_LENGTH)
        _check_number("priority", priority, minimum=-PRIORITY_LIMIT, maximum=PRIORITY_LIMIT)
        if timeout is not None:
            _check_duration("timeout", timeout)
        if fairness_key is not None:
            storable_text(fairness_key, "fairness_key", FAIRNESS_KEY_LENGTH, allow_empty=True)
        if retries is not None:
            _check_number("retries", retries, minimum=0, maximum=MAX_RETRIES)
        return StepOptions(
            queue=queue or "",
            priority=priority,
            fairness_key=fairness_key or "",
            retries=retries,
            timeout=timeout,
            start_timeout=start_timeout,
            on_start_timeout=on_start_timeout,
        )

    def _checkpoint(self, key: str, kind: str, name: str) -> StepCheckpoint | None:
        cp = self._checkpoints.get(key)
        if cp is not None and (cp.kind != kind or cp.name != name):
            raise NonDeterminismError(
                f"run {self._run.id}: call #{key} is now {kind} {name!r} but the history recorded "
                f"{cp.kind} {cp.name!r}; the workflow's code changed under a running run "
                f"(branch the change with ctx.patched, or bump its version for new runs)"
            )
        if cp is not None:
            readable(cp.output, f"output of call #{key} ({cp.kind} {cp.name!r})")
        return cp

    def _drive_step(
        self,
        key: str,
        step: StepDefinition[Any],
        input: Any,
        options: StepOptions,
        group: str,
    ) -> Any:
        cp = self._checkpoint(key, StepKind.STEP, step.name)
        if cp is None:
            cp = self._engine.create_step_checkpoint(
                self._run,
                key=key,
                sequence=self._take_sequence(),
                step=step,
                input=input,
                options=options,
                group=group,
            )
            self._checkpoints[key] = cp
            return self._admit(cp, options)
        status = cp.status
        if status == StepStatus.COMPLETED:
            return cp.output
        if status == StepStatus.FAILED:
            error = cp.error or {}
            if error.get("type") == StartTimeoutError.__name__:
                raise StartTimeoutError(step.name, error)
            raise StepFailed(step.name, error)
        if status == StepStatus.WAITING:
            if cp.start_deadline is not None and cp.start_deadline <= self.now and not cp.holds_slot:
                # Gave up waiting (a call a grant has given a slot to runs instead).
                if self._engine.give_up(cp):
                    raise StartTimeoutError(step.name, cp.error or {})
                return None
            return self._admit(cp, options)
        if status == StepStatus.RETRYING:
            if cp.wake_at is not None and cp.wake_at > self.now:
                self._wait_until(cp.wake_at)
                return PENDING
            return self._admit(cp, options)
        # DISPATCHED: in flight. Past its deadline, re-dispatch (the slot stays held).
        if cp.wake_at is not None and cp.wake_at <= self.now:
            logger.warning(
                "run %s: re-dispatched 1 step(s): step %r (attempt %d): timed out at %s",
                self.run_id,
                key,
                cp.attempt,
                cp.wake_at,
            )
            self._engine.dispatch(cp, timeout_redispatch=True)
        self.in_flight = True
        self._wait_until(cp.wake_at)
        return PENDING

    def _admit(self, cp: StepCheckpoint, options: StepOptions) -> Any:
        if not self._engine.admit(cp, options):
            # Parked in the queue's line: a grant dispatches it; the turn comes back only to
            # give it up, when its start timeout runs out.
            self._wait_until(cp.start_deadline)
            return PENDING
        self._engine.dispatch(cp, from_turn=True)
        self.in_flight = True
        self._wait_until(cp.wake_at)
        return PENDING

    def _new_wait(self, key: str, kind: str, name: str, wake_at: datetime | None) -> StepCheckpoint:
        """Checkpoint a sleep or a signal wait: pending until `wake_at` (or forever, if None),
        with why it waits (the signal's name and its timeout; a sleep's end) in the same INSERT."""
        cause, detail = signal_wait([name], wake_at) if kind == StepKind.SIGNAL else timed(WaitCause.SLEEP, wake_at)
        cp = self._engine.create_checkpoint(
            self._run,
            key=key,
            sequence=self._take_sequence(),
            kind=kind,
            name=name,
            status=StepStatus.DISPATCHED,
            wake_at=wake_at,
            wait_cause=cause,
            wait_detail=detail,
        )
        self._checkpoints[key] = cp
        return cp

    def _drive_sleep(self, key: str, name: str, due: Any) -> None:
        cp = self._checkpoint(key, StepKind.SLEEP, name) or self._new_wait(key, StepKind.SLEEP, name, due())
        if cp.status in SETTLED_STEP_STATUSES:
            return
        if cp.wake_at is None or cp.wake_at <= self.now:
            self._engine.settle(cp, StepStatus.COMPLETED)
            return
        self._wait_until(cp.wake_at)
        raise Suspend

    def _drive_child(self, key: str, definition: WorkflowDefinition, input: Any, group: str) -> Any:
        cp = self._checkpoint(key, StepKind.CHILD, definition.name)
        if cp is None:
            cp = self._engine.start_child(
                self._run, key=key, sequence=self._take_sequence(), definition=definition, input=input, group=group
            )
            self._checkpoints[key] = cp
        if cp.status == StepStatus.COMPLETED:
            return cp.output
        if cp.status in (StepStatus.FAILED, StepStatus.CANCELLED):
            quota_store.raise_if_refused(cp)
            error = cp.error or {}
            raise ChildFailed(cp.child_run_id, str(error.get("status", cp.status)), error.get("error"))
        return PENDING

    def _step_fan(
        self, base: str, step: StepDefinition[Any], inputs: list[Any], wave_size: int, options: StepOptions
    ) -> list[Any]:
        results: list[Any] = []
        for wave_start in range(0, len(inputs), wave_size):
            group = f"{base}/w{wave_start // wave_size}"
            wave: list[Any] = []
            failure: StepFailed | None = None
            for index in range(wave_start, min(wave_start + wave_size, len(inputs))):
                try:
                    wave.append(self._drive_step(f"{base}.{index}", step, inputs[index], options, group))
                except StepFailed as exc:
                    failure = failure or exc
                    wave.append(None)
            if any(item is PENDING for item in wave):
                raise Suspend
            if failure is not None:
                raise failure
            results.extend(wave)
        return results

    def _child_fan(
        self, base: str, definition: WorkflowDefinition, inputs: list[Any], concurrency: int | None
    ) -> list[Any]:
        wave_size = max(1, concurrency // 2) if concurrency else max(1, len(inputs))
        waves = [range(s, min(s + wave_size, len(inputs))) for s in range(0, len(inputs), wave_size)]
        results: list[Any] = [None] * len(inputs)
        unsettled_waves = 0
        # Two waves in flight, unless two would exceed the limit (concurrency=1: waves of one).
        max_waves_in_flight = min(2, concurrency // wave_size) if concurrency else len(waves)
        for number, wave in enumerate(waves):
            started = f"{base}.{wave[0]}" in self._checkpoints
            if not started and unsettled_waves >= max_waves_in_flight:
                break
            group = f"{base}/w{number}"
            pending = False
            for index in wave:
                value = self._drive_child(f"{base}.{index}", definition, inputs[index], group)
                if value is PENDING:
                    pending = True
                else:
                    results[index] = value
            unsettled_waves += pending
        if unsettled_waves or any(f"{base}.{i}" not in self._checkpoints for i in range(len(inputs))):
            raise Suspend
        return results
