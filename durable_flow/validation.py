"""One validator for every string and number that reaches the database or an admission backend.

PostgreSQL refuses a NUL character in text and a lone UTF-16 surrogate anywhere; a value it
refuses deep inside a turn becomes a poison turn that never finishes. So every name, id, tag
and key is checked here, at the edge of the public API, and refused with a typed error that
names it; numbers are bounded to what every backend stores (a PostgreSQL `bigint`, a Redis
Lua double) before they reach one, and JSON values to a nesting depth every reader can decode.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any, TypeVar

from durable_flow.exceptions import InvalidInput

#: The largest count (concurrency, limit) any backend stores exactly: PostgreSQL `integer`.
MAX_COUNT = 2**31 - 1
#: The longest duration in milliseconds: ten years, well inside Lua's exact doubles (2**53).
MAX_DURATION_MS = 10 * 365 * 24 * 3600 * 1000
#: The deepest a JSON input, output or payload may nest, in lists and objects (`[]` is one level,
#: `{"a": [1]}` two). Far below Python's recursion limit (1000 by default): `json.dumps` and
#: `json.loads` recurse once a level, on top of a worker's or a view's own stack, and a value
#: they cannot read back would fail every turn of its run and every page that shows it.
MAX_JSON_DEPTH = 100

_CONTAINERS = (dict, list, tuple)  # what `json.dumps` writes as an array or an object
T = TypeVar("T")


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


def bounded_depth(value: T, what: str) -> T:
    """`value` if its lists and objects (tuples count as lists) nest at most `MAX_JSON_DEPTH`
    deep; else `InvalidInput`. `bounded_depth([[1]], "input") == [[1]]`.

    Walks without recursion, depth first, and stops at the first container over the limit, so
    a value of any depth (or a cycle) is refused without exhausting the stack.
    """
    if not isinstance(value, _CONTAINERS):
        return value
    path: list[Iterator[Any]] = [_items(value)]
    while path:
        for item in path[-1]:
            if isinstance(item, _CONTAINERS):
                if len(path) == MAX_JSON_DEPTH:
                    raise InvalidInput(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
                path.append(_items(item))
                break
        else:
            path.pop()
    return value


def _items(container: Any) -> Iterator[Any]:
    return iter(container.values()) if isinstance(container, dict) else iter(container)
