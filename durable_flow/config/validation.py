"""One validator for every string and number that reaches the database or an admission backend.

PostgreSQL refuses a NUL character in text and a lone UTF-16 surrogate anywhere; a value it
refuses deep inside a turn becomes a poison turn that never finishes. So every name, id, tag
and key is checked here, at the edge of the public API, and refused with a typed error that
names it; numbers are bounded to what every backend stores (a PostgreSQL `bigint`, a Redis
Lua double) before they reach one, and JSON values to a nesting depth every reader can decode.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal, TypeVar

from durable_flow.exceptions import InvalidInput

#: The largest count (concurrency, limit) any backend stores exactly: PostgreSQL `integer`.
MAX_COUNT = 2**31 - 1
#: The longest duration in milliseconds: ten years, well inside Lua's exact doubles (2**53).
MAX_DURATION_MS = 10 * 365 * 24 * 3600 * 1000
#: `MAX_DURATION_MS` as a timedelta: the longest period, timeout, backoff or sleep a workflow or
#: step declares. Far inside `datetime`'s range, so `now + duration` never overflows.
MAX_DURATION = timedelta(milliseconds=MAX_DURATION_MS)
#: The deepest a JSON input, output or payload may nest, in lists and objects (`[]` is one level,
#: `{"a": [1]}` two). Far below Python's recursion limit (1000 by default): `json.dumps` and
#: `json.loads` recurse once a level, on top of a worker's or a view's own stack, and a value
#: they cannot read back would fail every turn of its run and every page that shows it.
MAX_JSON_DEPTH = 100

_CONTAINERS = (dict, list, tuple)  # what `json.dumps` writes as an array or an object
T = TypeVar("T")
#: Durations in seconds, for the settings' documented maxima.
MINUTE_S, HOUR_S, DAY_S, WEEK_S = 60, 3600, 86_400, 7 * 86_400


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


#: An event name: a letter or digit first, then letters, digits and `_ . : / -` (no spaces),
#: e.g. `orders/created` or `app/user.signed-up`.
EVENT_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*")


def event_name_problem(value: object, max_length: int) -> str | None:
    """What is wrong with `value` as an event name, or None: `event_name_problem("orders/created",
    200)` is None, `event_name_problem("orders created", 200)` says which characters it may hold."""
    if not isinstance(value, str) or not value or len(value) > max_length:
        return f"must be a non-empty string of at most {max_length} characters, got {reprlib.repr(value)}"
    if not EVENT_NAME_PATTERN.fullmatch(value):
        return (
            "must start with a letter or digit and hold only letters, digits and '_', '.', ':', '/', '-', "
            f"got {reprlib.repr(value)}"
        )
    return None


def text_problem(
    value: object, *, min_length: int = 1, max_length: int | None = None, forbidden: str = "", secret: bool = False
) -> str | None:
    """What is wrong with `value` as a string of `min_length` to `max_length` characters with
    none of the `forbidden` characters, or None when it is fine.

    The string counterpart of `number_problem`, for settings: one message that gives the whole
    rule, `text_problem("a:b", max_length=100, forbidden=":")` is "must be a non-empty string of
    at most 100 characters without ':', got 'a:b'". A NUL character or a lone surrogate is never
    allowed (the database refuses both). `secret` (a token) shows the value's length, not the value.
    """
    if min_length > 1:
        kind = (
            f"a string of {min_length} to {max_length} characters"
            if max_length
            else f"a string of at least {min_length} characters"
        )
    else:
        kind = "a non-empty string" if min_length else "a string"
        kind += f" of at most {max_length} characters" if max_length else ""
    kind += f" without {', '.join(map(repr, forbidden))}" if forbidden else ""
    shown = f"a string of {len(value)} characters" if secret and isinstance(value, str) else reprlib.repr(value)
    problem = f"must be {kind}, got {shown}"
    if not isinstance(value, str) or len(value) < min_length or (max_length and len(value) > max_length):
        return problem
    if any(character in value for character in forbidden):
        return problem
    if "\x00" in value or not _encodable(value):
        return f"{problem} (a NUL character or a lone surrogate, which the database cannot store)"
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def number_problem(
    value: object,
    *,
    minimum: float,
    maximum: float,
    integer: bool = False,
    above_minimum: bool = False,
    unit: str = "",
) -> str | None:
    """What is wrong with `value` as a bounded number, or None when it is fine.

    The one check of every number in the settings, backend options, queue specs and quotas: a
    bool is not a number, an `integer` must be an int, and NaN and the infinities are never
    within bounds (NaN compares false to everything, so a bare `value <= 0` test lets it
    through). `above_minimum` makes the lower bound exclusive:
    `number_problem(0, minimum=0, maximum=60, above_minimum=True)` is "must be a number above 0
    and at most 60, got 0". The message starts with "must be" and gives the whole range, for the
    caller to prefix with the setting's name.
    """
    kind = "an integer" if integer else "a number"
    low = f"above {_shown(minimum)} and at most" if above_minimum else f"from {_shown(minimum)} to"
    problem = f"must be {kind} {low} {_shown(maximum)}{f' ({unit})' if unit else ''}, got {reprlib.repr(value)}"
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        return problem
    if isinstance(value, float) and not math.isfinite(value):
        return problem
    if value > maximum or value < minimum or (above_minimum and value == minimum):
        return problem
    return None


def _shown(bound: float) -> str:
    """A bound as written in the docs: `86400`, not `86400.0` or `8.64e+04`."""
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def duration_problem(value: object, *, minimum: Literal["positive", "zero", "any"] = "positive") -> str | None:
    """What is wrong with `value` as a duration, or None when it is fine.

    A duration is a `timedelta` of at most `MAX_DURATION` (ten years) either way: `minimum` is
    `"positive"` (above zero), `"zero"` (zero allowed) or `"any"` (a negative one too, as
    `ctx.sleep` takes). `duration_problem(timedelta(0))` is "must be a positive timedelta of at
    most 3650 days, got datetime.timedelta(0)". Checked by `number_problem` on its seconds.
    """
    kind = {"positive": "a positive timedelta", "zero": "a timedelta from 0", "any": "a timedelta"}[minimum]
    longest = MAX_DURATION.total_seconds()
    problem = f"must be {kind} of at most {MAX_DURATION.days} days, got {reprlib.repr(value)}"
    if not isinstance(value, timedelta):
        return problem
    low = -longest if minimum == "any" else 0
    if number_problem(value.total_seconds(), minimum=low, maximum=longest, above_minimum=minimum == "positive"):
        return problem
    return None


#: The longest a step call may wait for admission before it gives up (`start_timeout`): a week.
#: Queued work still useful after a week is a backlog to size, not a deadline.
MAX_START_TIMEOUT_S = WEEK_S
#: What a call that gave up waiting does: fail at its `ctx.step` (`StartTimeoutError`) or
#: return None there and let the workflow go on.
START_TIMEOUT_OUTCOMES = ("fail", "skip")


def start_timeout_problem(value: object, *, seconds_only: bool = False) -> str | None:
    """What is wrong with `value` as a start timeout, or None when it is fine: a `timedelta` (not
    when `seconds_only`: a queue's setting) or a number of seconds, above 0 and at most
    `MAX_START_TIMEOUT_S`. NaN, the infinities, a bool and a negative or zero wait are refused:
    `start_timeout_problem(-1)` is "must be a timedelta or a number of seconds above 0 and at
    most 604800 (a week), got -1"."""
    seconds = value.total_seconds() if isinstance(value, timedelta) and not seconds_only else value
    if number_problem(seconds, minimum=0, maximum=MAX_START_TIMEOUT_S, above_minimum=True) is None:
        return None
    kind = "a number of seconds" if seconds_only else "a timedelta or a number of seconds"
    longest = _shown(MAX_START_TIMEOUT_S)
    return f"must be {kind} above 0 and at most {longest} (a week), got {reprlib.repr(value)}"


def start_timeout_outcome_problem(value: object) -> str | None:
    """What is wrong with `value` as `on_start_timeout`: "fail" or "skip"."""
    if isinstance(value, str) and value in START_TIMEOUT_OUTCOMES:
        return None
    return f"must be 'fail' or 'skip', got {reprlib.repr(value)}"


def bounded_int(value: object, what: str, *, minimum: int, maximum: int) -> int:
    """`value` if it is an int (not a bool) within [minimum, maximum]; else `InvalidInput`."""
    problem = number_problem(value, minimum=minimum, maximum=maximum, integer=True)
    if problem:
        raise InvalidInput(f"{what} {problem}")
    return value  # type: ignore[return-value]  # an int, checked above


class StrictJSONDecoder(json.JSONDecoder):
    """A decoder of strict JSON for what people and clients send (request bodies, form fields):
    `NaN`, `Infinity` and `-Infinity`, which Python's `json` reads by default, raise
    `ValueError("NaN is not a JSON number")`, so a number no validator can bound is refused with
    the text it came in. `json.loads("[NaN]", cls=StrictJSONDecoder)` raises."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "parse_constant": _not_a_number})


def _not_a_number(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


class TooDeep(str):
    """What a stored JSON value nested deeper than `MAX_JSON_DEPTH` reads as (one stored before
    the limit, or written by hand): `TOO_DEEP`, a placeholder text that pages and the JSON API
    show as it is. Decoding the value itself may fail (`RecursionError`) and fail every query
    that loads its row; the engine refuses the placeholder (`definitions.serialization.readable`)
    rather than run on it."""


TOO_DEEP = TooDeep("(too deeply nested to display)")


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
