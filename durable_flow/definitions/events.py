"""Events: what a workflow declares about them, and the pure rules every event follows.

    @workflow("fulfil", trigger="orders/created", trigger_if="event.data.total > 100",
              cancel_on=[{"event": "orders/cancelled", "match": "async.data.id == event.data.id"}])
    def fulfil(ctx, event): ...

An event is a name, a JSON object of `data`, an `id` (its sender's idempotency key) and `ts`, the
epoch milliseconds it was received: `{"name": "orders/created", "data": {...}, "id": "o-17",
"ts": 1767261600000}`, the shape a triggered run gets as its input and `ctx.wait_for_event`
returns. Expressions are CEL (`durable_flow.definitions.cel`), as keys are: `event` is the
triggering event (a run's input), `async` the incoming one (the event a wait or a cancel is
matched against), as in the reference.

The names a project uses are declared once, in `DURABLE_FLOW["EVENTS"]`: `manage.py check`
fails a trigger or a `cancel_on` naming another (`durable_flow.E021`, `E023`), and `send_event`
and `ctx.wait_for_event` refuse one with `UnknownEvent`. A declaration that does not parse (a
`trigger_if` or a `match` that does not compile, a malformed `trigger` or `cancel_on`) fails
`@workflow` at import, with its check id (`E022`, `E024`), as a bad schedule does.

This module holds the declarations (`TriggerSpec`, `CancelSpec`) and the pure rules (names, the
payload, a triggered run's id, matching); `durable_flow.runtime.events` delivers events.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from durable_flow.config.limits import EVENT_NAME_LENGTH, RUN_ID_LENGTH
from durable_flow.config.validation import event_name_problem
from durable_flow.definitions.cel import CelProgram, compile_cel, evaluate_cel
from durable_flow.exceptions import InvalidEvent, InvalidInput, RegistrationError

HINT = (
    'hint: trigger="orders/created" (or a list), trigger_if="event.data.total > 100", '
    'cancel_on=[{"event": "orders/cancelled", "match": "async.data.id == event.data.id"}], each event named in '
    'DURABLE_FLOW["EVENTS"]; see docs/events.md'
)
CANCEL_FIELDS = {"event", "match"}
#: The most compiled `match` expressions a process keeps (waits name theirs in the workflow's code).
MATCH_CACHE_SIZE = 1024


class EventDeclarationError(RegistrationError):
    """A `trigger=`, `trigger_if=` or `cancel_on=` that does not parse: `check_id` names the rule
    it breaks (`E022` an expression that does not compile, `E024` a malformed declaration), and
    the message ends with a hint."""

    def __init__(self, message: str, check_id: str) -> None:
        super().__init__(f"{message} [durable_flow.{check_id}] ({HINT})")
        self.check_id = check_id


@dataclass(frozen=True)
class Condition:
    """A compiled CEL expression that must hold: a trigger's `trigger_if`, a wait's or a
    cancel's `match`."""

    expression: str
    program: CelProgram

    def holds(self, *, event: Any, incoming: Any = None) -> bool:
        """Whether the expression is true for `event` (and `async`, the `incoming` event). An
        expression that fails on these values (a missing field) or gives anything but true does
        not hold: an event that lacks the field simply does not match."""
        try:
            return evaluate_cel(self.program, event=event, **{"async": incoming}) is True
        except LookupError:
            return False


@dataclass(frozen=True)
class TriggerSpec:
    """One event a workflow starts on, and the condition (`trigger_if`) the event must meet."""

    event: str
    condition: Condition | None = None


@dataclass(frozen=True)
class CancelSpec:
    """An event that cancels a run in progress when `match` holds (`async`: the event,
    `event`: the run's input)."""

    event: str
    match: Condition | None = None


def check_event_name(name: object, what: str = "event name") -> str:
    """`name` if it is a well-formed event name; else `InvalidEvent` naming `what`."""
    if problem := event_name_problem(name, EVENT_NAME_LENGTH):
        raise InvalidEvent(f"{what} {problem}")
    assert isinstance(name, str)
    return name


def compile_condition(expression: str) -> Condition:
    """A compiled `match` or `trigger_if`; `ValueError` naming it when it does not compile."""
    return _compiled(expression)


@lru_cache(maxsize=MATCH_CACHE_SIZE)
def _compiled(expression: str) -> Condition:
    return Condition(expression=expression, program=compile_cel(expression))


def condition_for(expression: object, what: str) -> Condition | None:
    """A wait's `match` at the call: None, or a compiled expression; `InvalidInput` otherwise."""
    if expression is None:
        return None
    if not isinstance(expression, str):
        raise InvalidInput(f"{what} must be a CEL expression (a string), got {type(expression).__name__}")
    try:
        return compile_condition(expression)
    except ValueError as exc:
        raise InvalidInput(f"{what}: {exc}") from None


def _declared_name(where: str, name: object) -> str:
    if problem := event_name_problem(name, EVENT_NAME_LENGTH):
        raise EventDeclarationError(f"{where} {problem}", "E024")
    assert isinstance(name, str)
    return name


def _declared_condition(where: str, expression: object) -> Condition | None:
    if expression is None:
        return None
    if not isinstance(expression, str):
        raise EventDeclarationError(f"{where} must be a CEL expression, got {type(expression).__name__}", "E024")
    try:
        return compile_condition(expression)
    except ValueError as exc:
        raise EventDeclarationError(f"{where}: {exc}", "E022") from None


def parse_triggers(workflow: str, trigger: object, trigger_if: object) -> tuple[TriggerSpec, ...]:
    """Parse `@workflow(trigger=..., trigger_if=...)` once, at registration: an event name or a
    list of them, and one condition every triggering event must meet."""
    where = f"workflow {workflow!r}:"
    if trigger is None:
        if trigger_if is not None:
            raise EventDeclarationError(f"{where} trigger_if needs a trigger", "E024")
        return ()
    names = [trigger] if isinstance(trigger, str) else trigger
    if not isinstance(names, list | tuple) or not names:
        raise EventDeclarationError(f"{where} trigger must be an event name or a list of them, got {trigger!r}", "E024")
    condition = _declared_condition(f"{where} trigger_if", trigger_if)
    declared = [_declared_name(f"{where} trigger", name) for name in names]
    if len(set(declared)) != len(declared):
        raise EventDeclarationError(f"{where} trigger names an event twice: {declared!r}", "E024")
    return tuple(TriggerSpec(event=name, condition=condition) for name in declared)


def parse_cancel_on(workflow: str, value: object) -> tuple[CancelSpec, ...]:
    """Parse `@workflow(cancel_on=...)` once: a list of `{"event": name, "match": cel}` (or one
    such dict, or an event name alone, which cancels every run in progress)."""
    if value is None:
        return ()
    entries = [value] if isinstance(value, str | Mapping) else value
    if not isinstance(entries, list | tuple):
        raise EventDeclarationError(
            f"workflow {workflow!r}: cancel_on must be a list of {{'event', 'match'}} dicts, got {value!r}", "E024"
        )
    specs = []
    for index, entry in enumerate(entries):
        where = f"workflow {workflow!r}: cancel_on[{index}]"
        if isinstance(entry, str):
            entry = {"event": entry}
        if not isinstance(entry, Mapping):
            raise EventDeclarationError(f"{where} must be a dict with 'event' and 'match', got {entry!r}", "E024")
        unknown = sorted(set(map(str, entry)) - CANCEL_FIELDS)
        if unknown:
            raise EventDeclarationError(f"{where}: unknown field(s) {', '.join(unknown)}", "E024")
        name = _declared_name(f"{where} event", entry.get("event"))
        specs.append(CancelSpec(event=name, match=_declared_condition(f"{where} match", entry.get("match"))))
    return tuple(specs)


def epoch_ms(at: datetime) -> int:
    """An aware datetime as epoch milliseconds (an event's `ts`)."""
    return int(at.astimezone(UTC).timestamp() * 1000)


def payload(name: str, data: Any, event_id: str, received_at: datetime) -> dict[str, Any]:
    """The event as a run sees it: its input when it triggered the run, what a wait returns."""
    return {"name": name, "data": data, "id": event_id, "ts": epoch_ms(received_at)}


def triggered_run_id(workflow: str, event_id: str) -> str:
    """The id of the run event `event_id` starts of `workflow`: `"fulfil@event:o-17"`, the same
    however often the event is delivered, so a delivery repeated after a crash finds the run it
    started. A name too long for the column is cut and followed by a digest of the whole."""
    full = f"{workflow}@event:{event_id}"
    if len(full) <= RUN_ID_LENGTH:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:32]
    return f"{full[: RUN_ID_LENGTH - 33]}~{digest}"
