"""Backend options: each backend declares the keys it takes, and one parser checks them.

A backend's settings dict (`DURABLE_FLOW["ADMISSION"]`, `DURABLE_FLOW["TRANSPORT"]`) is checked
against its declared `OPTIONS` before the backend is built, so a misspelt key or a bad value is
an `ImproperlyConfigured` naming the key (`DURABLE_FLOW["ADMISSION"]["INSTANCE_TTL_MS"]: ...`) on
every backend alike, and `manage.py check` reports it before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from django.core.exceptions import ImproperlyConfigured

from durable_flow.config.validation import number_problem

Validator = Callable[[Any], str | None]
"""Returns what is wrong with a value, or None when it is fine."""


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


def boolean(value: Any) -> str | None:
    """True or False (not 0/1, not a string: "False" would read as true)."""
    if not isinstance(value, bool):
        return f"must be True or False, got {value!r}"
    return None


def non_empty_str(value: Any) -> str | None:
    """A string with something in it."""
    if not isinstance(value, str) or not value:
        return f"must be a non-empty string, got {value!r}"
    return None


def anything(value: Any) -> str | None:
    """No check here: the backend validates the value itself (e.g. CONCURRENCY's forms)."""
    return None


@dataclass(frozen=True)
class Option:
    """One declared option: what it means, and how a value is checked."""

    help: str
    validate: Validator = anything


def parse_options(declared: Mapping[str, Option], raw: Mapping[str, Any], setting: str) -> dict[str, Any]:
    """Check `raw` against `declared`; return the given options as lower-case keyword arguments.

    Options left out are not filled in: the backend's constructor defaults apply.
    """
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"{setting}: expected a dict of options, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(declared))
    if unknown:
        known = ", ".join(declared) or "none"
        raise ImproperlyConfigured(f"{setting}: unknown option(s) {', '.join(unknown)} (known: {known})")
    for key, value in raw.items():
        problem = declared[key].validate(value)
        if problem:
            raise ImproperlyConfigured(f'{setting}["{key}"]: {problem}')
    return {key.lower(): value for key, value in raw.items()}


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
