"""Options: every settings dict declares its keys, and one parser checks them.

A settings dict (`DURABLE_FLOW` itself, its `POLLER`, `HEARTBEAT` and `METRICS` sections, a
backend's `DURABLE_FLOW["ADMISSION"]` or `DURABLE_FLOW["TRANSPORT"]`, an adaptive `CONCURRENCY`)
is a table of `Option`s, and `parse_options` checks a value against it before anything is built:
a misspelt key or a bad value is an `ImproperlyConfigured` naming the key's whole path
(`DURABLE_FLOW["POLLER"]["BATCH_SIZE"]: must be an integer from 1 to 10000, got 0`) the same way
everywhere, and `manage.py check` reports it before any process starts. The validators read
`durable_flow.config.validation`, the one place that decides what a valid number or string is.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from django.core.exceptions import ImproperlyConfigured

from durable_flow.config.validation import number_problem, text_problem

Validator = Callable[[Any], str | None]
"""Returns what is wrong with a value, or None when it is fine."""


class Refusal(str):
    """A validator's problem that names its own error, for a part of an option's value that has
    a `manage.py check` id of its own (a queue's start timeout inside `QUEUES`):
    `Refusal("[0]...: must be ...", StartTimeoutMisconfigured)`. `parse_options` raises that
    error instead of the option's."""

    error: type[ImproperlyConfigured]

    def __new__(cls, problem: str, error: type[ImproperlyConfigured]) -> Refusal:
        refusal = super().__new__(cls, problem)
        refusal.error = error
        return refusal


def number(
    minimum: float, maximum: float, *, integer: bool = False, above_minimum: bool = False, unit: str = ""
) -> Validator:
    """A finite number within bounds (not a bool, NaN or an infinity): `number(0, 60,
    above_minimum=True, unit="seconds")` takes 0.1 and 60, refuses 0, 61 and `float("inf")`."""

    def validate(value: Any) -> str | None:
        return number_problem(
            value, minimum=minimum, maximum=maximum, integer=integer, above_minimum=above_minimum, unit=unit
        )

    return validate


def seconds(maximum: float) -> Validator:
    """A duration in seconds, above 0 and at most `maximum`: `number(0, maximum,
    above_minimum=True, unit="seconds")`."""
    return number(0, maximum, above_minimum=True, unit="seconds")


def boolean(value: Any) -> str | None:
    """True or False (not 0/1, not a string: "False" would read as true)."""
    if not isinstance(value, bool):
        return f"must be True or False, got {value!r}"
    return None


def text(*, min_length: int = 1, max_length: int | None = None, forbidden: str = "", secret: bool = False) -> Validator:
    """A string within lengths, without the `forbidden` characters (`validation.text_problem`):
    `text(max_length=100, forbidden=":")` takes "eu-1", refuses "", "a:b" and 3. A `secret`
    (a token) is never shown in the message, only its length."""

    def validate(value: Any) -> str | None:
        return text_problem(value, min_length=min_length, max_length=max_length, forbidden=forbidden, secret=secret)

    return validate


non_empty_str = text()
"""A string with something in it."""


def one_of(*choices: object) -> Validator:
    """One of a few values: `one_of("fifo", "lifo")` takes "lifo", refuses "LIFO"."""

    def validate(value: Any) -> str | None:
        if isinstance(value, bool) or value not in choices:  # True == 1: a bool is never a choice
            return f"must be one of {', '.join(map(repr, choices))}, got {reprlib.repr(value)}"
        return None

    return validate


def optional(validate: Validator) -> Validator:
    """None, or a value `validate` takes: `optional(text(min_length=16))` takes None and a
    16-character string, refuses "short" ("must be a string of at least 16 characters (or
    None), got ..."). The validator's message is "must be ..., got ..." (every one here is)."""

    def check(value: Any) -> str | None:
        if value is None:
            return None
        problem = validate(value)
        if problem is None:
            return None
        rule, _, shown = problem.partition(", got ")
        return f"{rule} (or None), got {shown}"

    return check


def list_of(item: Validator, what: str) -> Validator:
    """A list or tuple (not a string) whose every item `item` takes. A bad item is named by its
    index: `list_of(non_empty_str, "module paths")(["a", ""])` is
    "[1]: must be a non-empty string, got ''", which `parse_options` appends to the key's path."""

    def validate(value: Any) -> str | None:
        if isinstance(value, str) or not isinstance(value, list | tuple):
            return f"must be a list of {what}, got {reprlib.repr(value)}"
        for index, entry in enumerate(value):
            problem = item(entry)
            if problem:
                return f"[{index}]{problem}" if problem.startswith("[") else f"[{index}]: {problem}"
        return None

    return validate


def dictionary(value: Any) -> str | None:
    """A dict, of any keys: what is in it is checked where it is used (a burst's input)."""
    if not isinstance(value, Mapping):
        return f"must be a dict, got {type(value).__name__}"
    return None


@dataclass(frozen=True)
class Table:
    """A validator for a dict of its own options: `parse_options` checks the dict against
    `declared` (unknown keys, each value) and names a bad key by its whole path. Called alone,
    it only checks that the value is a dict."""

    declared: Mapping[str, Option]

    def __call__(self, value: Any) -> str | None:
        return dictionary(value)


def table(declared: Mapping[str, Option]) -> Table:
    """A dict checked by its own option table (`DURABLE_FLOW["POLLER"]`, `["METRICS"]`...)."""
    return Table(declared)


def anything(value: Any) -> str | None:
    """No check here: the backend validates the value itself (e.g. CONCURRENCY's forms)."""
    return None


@dataclass(frozen=True)
class Option:
    """One declared option: what it means, how a value is checked, and the error a bad value
    raises (a subclass of `ImproperlyConfigured` gives a key its own `manage.py check` id)."""

    help: str
    validate: Validator = anything
    error: type[ImproperlyConfigured] = ImproperlyConfigured


def parse_options(declared: Mapping[str, Option], raw: Mapping[str, Any], setting: str) -> dict[str, Any]:
    """Check `raw` against `declared`; return the given options as lower-case keyword arguments.

    Options left out are not filled in: the caller's defaults apply. A `Table` option is checked
    against its own table, and returned parsed the same way. A problem is reported as
    `{setting}["KEY"]: {problem}`; one that locates itself inside the value (a list item's
    `[1]: ...`) is appended to the path: `DURABLE_FLOW["WORKFLOWS"][1]: must be ...`.
    """
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"{setting}: must be a dict, got {type(raw).__name__}")
    unknown = sorted(map(str, set(raw) - set(declared)))
    if unknown:
        known = ", ".join(declared) or "none"
        raise ImproperlyConfigured(f"{setting}: unknown option(s) {', '.join(unknown)} (known: {known})")
    parsed: dict[str, Any] = {}
    for key, value in raw.items():
        option, where = declared[key], f'{setting}["{key}"]'
        problem = option.validate(value)
        if problem:
            error = problem.error if isinstance(problem, Refusal) else option.error
            raise error(f"{where}{problem}" if problem.startswith("[") else f"{where}: {problem}")
        if isinstance(option.validate, Table):
            value = parse_options(option.validate.declared, value, where)
        parsed[key.lower()] = value
    return parsed


class Configurable:
    """A backend built from a settings dict: declare `OPTIONS` (and `SETTING`, the dict's name).

    `from_options` rejects unknown keys and bad values, then calls the constructor with the
    options as lower-case keyword arguments. `check_options` does the same checks for
    `manage.py check` without building anything (no connection is opened).
    """

    SETTING: ClassVar[str] = "DURABLE_FLOW"
    OPTIONS: ClassVar[Mapping[str, Option]] = {}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """Build the backend from its settings dict; `ImproperlyConfigured` names a bad key."""
        return cls(**parse_options(cls.OPTIONS, options, cls.SETTING))

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Raise `ImproperlyConfigured` for what `from_options` would refuse. Backends with
        checks of their own beyond the declared validators extend this."""
        parse_options(cls.OPTIONS, options, cls.SETTING)
