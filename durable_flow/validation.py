"""One validator for every string and number that reaches the database or an admission backend.

PostgreSQL refuses a NUL character in text and a lone UTF-16 surrogate anywhere; a value it
refuses deep inside a turn becomes a poison turn that never finishes. So every name, id, tag
and key is checked here, at the edge of the public API, and refused with a typed error that
names it; numbers are bounded to what every backend stores (a PostgreSQL `bigint`, a Redis
Lua double) before they reach one.
"""

from __future__ import annotations

from functools import cache

from durable_flow.exceptions import InvalidInput

#: The largest count (concurrency, limit) any backend stores exactly: PostgreSQL `integer`.
MAX_COUNT = 2**31 - 1
#: The longest duration in milliseconds: ten years, well inside Lua's exact doubles (2**53).
MAX_DURATION_MS = 10 * 365 * 24 * 3600 * 1000


@cache
def max_length(model: str, field: str) -> int:
    """The `max_length` of a durable_flow model's field: `max_length("WorkflowRun", "id")`.

    A length limit is written once, on the model (and so in its migration); every check of a
    name, id or key reads it from there. Looked up on first use, not at import: queues and
    workflows are declared and checked by modules that load before the models may be imported.
    """
    from durable_flow import models

    length = getattr(models, model)._meta.get_field(field).max_length
    if length is None:
        raise TypeError(f"{model}.{field} has no max_length")
    return int(length)


def storable_text(value: object, what: str, max_length: int, *, allow_empty: bool = False) -> str:
    """`value` if it is a string the database can store under `max_length`; else `InvalidInput`.

    Refused: non-strings, empty strings (unless `allow_empty`), over-long strings, NUL
    characters and lone surrogates.
    """
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidInput(f"{what} must not be empty")
    if len(value) > max_length:
        raise InvalidInput(f"{what} must be at most {max_length} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL character, which the database cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{what} contains a lone surrogate, which is not valid Unicode") from None
    return value


def bounded_int(value: object, what: str, *, minimum: int, maximum: int) -> int:
    """`value` if it is an int (not a bool) within [minimum, maximum]; else `InvalidInput`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{what} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise InvalidInput(f"{what} must be between {minimum} and {maximum}, got {value}")
    return value
