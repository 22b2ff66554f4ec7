"""JSON checks for what durable_flow stores: inputs, outputs and payloads must round-trip."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from durable_flow.config.validation import MAX_JSON_DEPTH, TooDeep, bounded_depth
from durable_flow.exceptions import InvalidInput

T = TypeVar("T")


def readable(value: T, what: str) -> T:
    """`value`, read from the database, unless it is `TOO_DEEP`: then `InvalidInput` naming it."""
    if isinstance(value, TooDeep):
        raise InvalidInput(f"{what} is stored nested more than {MAX_JSON_DEPTH} levels deep and cannot be read")
    return value


def nested_too_deep(text: str) -> bool:
    """Whether JSON `text` may nest deeper than `MAX_JSON_DEPTH`: it holds more brackets than
    that (brackets inside strings count too, so this only says when a closer look is needed)."""
    return text.count("[") + text.count("{") > MAX_JSON_DEPTH


def ensure_json(value: Any, what: str, max_bytes: int) -> Any:
    """Return `value` unchanged if it is JSON-serialisable, small enough and at most
    `MAX_JSON_DEPTH` deep; else `InvalidInput`.

    `what` names the thing in the message, e.g. "input of step 'charge'".
    """
    readable(value, what)
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} is not JSON-serialisable: {exc}") from None
    except RecursionError:
        bounded_depth(value, what)  # names the limit
        raise InvalidInput(f"{what} is nested too deeply to store as JSON") from None
    if nested_too_deep(encoded):
        bounded_depth(value, what)
    if "\\u0000" in encoded and _has_nul(value):
        raise InvalidInput(f"{what} contains a NUL character (\\u0000), which the database cannot store")
    if "\\ud" in encoded:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput(f"{what} contains a lone surrogate, which PostgreSQL cannot store") from None
    if len(encoded) > max_bytes:
        raise InvalidInput(f"{what} is {len(encoded)} bytes of JSON, over MAX_PAYLOAD_BYTES ({max_bytes})")
    return value


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(item) for item in value)
    return False


def error_info(exc: BaseException) -> dict[str, Any]:
    """A JSON description of an exception, as stored on a failed step or run."""
    import traceback

    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc).replace("\x00", "\\0"),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:].replace(
            "\x00", "\\0"
        ),
    }
