"""Keys users declare on a workflow (step concurrency, debounce, singleton): a CEL expression
over the start's `input` (also named `event`, for a run an event triggered; with `run_id` and
`workflow`), or a callable of the input.

Parsed once, at registration, so a bad expression fails `@workflow` with a `RegistrationError`
naming the workflow; evaluated once per start, before anything is created, so a key that is not
a non-empty string refuses the start with `InvalidInput` and leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from durable_flow.definitions.cel import CelProgram, compile_cel, evaluate_cel
from durable_flow.exceptions import InvalidInput, RegistrationError

MAX_KEY_LENGTH = 200

KeyFn = Callable[[Any], Any]


@dataclass(frozen=True)
class CelExpression:
    """A CEL key expression compiled once; evaluated with `input`, `run_id` and `workflow`."""

    expression: str
    program: CelProgram

    @classmethod
    def compile(cls, expression: str) -> CelExpression:
        try:
            program = compile_cel(expression)
        except ValueError as exc:
            raise ValueError(f"key {exc}") from None
        return cls(expression=expression, program=program)

    def __call__(self, input: Any, run_id: str, workflow: str) -> Any:
        # `event` is the input too: a run an event triggered has the event as its input, so a key
        # reads `event.data.account_id`, as in the reference.
        return evaluate_cel(self.program, input=input, event=input, run_id=run_id, workflow=workflow)

    def __str__(self) -> str:
        return self.expression


Key = CelExpression | KeyFn


def parse_key(where: str, raw: object) -> Key:
    """A declared key: a string compiles as CEL, a callable is kept. `RegistrationError`
    prefixed with `where` (which names the workflow and the option) otherwise."""
    if isinstance(raw, str):
        try:
            return CelExpression.compile(raw)
        except ValueError as exc:
            raise RegistrationError(f"{where}: {exc}") from None
    if callable(raw):
        return raw
    raise RegistrationError(f"{where} key must be a CEL expression or a callable, got {type(raw).__name__}")


def describe_key(key: Key) -> str:
    """The key as written (for errors, the admin and the dashboard)."""
    if isinstance(key, CelExpression):
        return key.expression
    return getattr(key, "__qualname__", repr(key))


def evaluate_key(key: Key, where: str, input: Any, run_id: str, workflow: str) -> str:
    """The key's value for one start; `InvalidInput` (prefixed with `where`) when it fails on
    this input or does not give a non-empty string of at most `MAX_KEY_LENGTH` characters."""
    try:
        value = key(input, run_id, workflow) if isinstance(key, CelExpression) else key(input)
    except Exception as exc:  # noqa: BLE001 - a key that fails on this input refuses the start
        raise InvalidInput(f"{where} key {describe_key(key)!r} failed on this input: {exc}") from None
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_LENGTH:
        raise InvalidInput(
            f"{where} key {describe_key(key)!r} must evaluate to a non-empty string "
            f"of at most {MAX_KEY_LENGTH} characters, got {value!r}"
        )
    return value
