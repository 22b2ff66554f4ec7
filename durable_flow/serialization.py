"""JSON checks for what durable_flow stores: inputs, outputs and payloads must round-trip."""

from __future__ import annotations

import json
from typing import Any

from durable_flow.exceptions import InvalidInput


def ensure_json(value: Any, what: str, max_bytes: int) -> Any:
    """Return `value` unchanged if it is JSON-serialisable and small enough; else `InvalidInput`.

    `what` names the thing in the message, e.g. "input of step 'charge'".
    """
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} is not JSON-serialisable: {exc}") from None
    if len(encoded) > max_bytes:
        raise InvalidInput(f"{what} is {len(encoded)} bytes of JSON, over MAX_PAYLOAD_BYTES ({max_bytes})")
    return value


def error_info(exc: BaseException) -> dict[str, Any]:
    """A JSON description of an exception, as stored on a failed step or run."""
    import traceback

    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:],
    }
