"""Why a call waits, recorded by the engine in the statement that parks it: the checkpoint's
`wait_cause` (one of `WaitCause`) and `wait_detail` (the same cause with its figures: the
queue, the limit that was full, until when, the key, the signal names).

Admission's answer (`AdmissionDecision`: its reason, the queue's limits it decided with, the
step-concurrency constraint that was full) is turned into a cause here, at the moment of the
decision, so the pages read what the engine knew then instead of guessing later. Every value is
bounded (`WAIT_DETAIL_TEXT` characters a text), so a detail stays a few hundred bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from durable_flow.admission.base import AdmissionDecision
from durable_flow.definitions.step_concurrency import Constraint
from durable_flow.models import WaitCause
from durable_flow.models.runs import WAIT_DETAIL_TEXT

Cause = tuple[str, dict[str, Any]]


def _text(value: str) -> str:
    return value[:WAIT_DETAIL_TEXT]


def _at(ms: int | None) -> str | None:
    """Epoch milliseconds as an ISO 8601 UTC instant (to the millisecond), or None."""
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _iso(at: datetime | None) -> str | None:
    return at.astimezone(UTC).isoformat(timespec="milliseconds") if at is not None else None


def key_of(resource: str, workflow: str) -> tuple[str, str]:
    """A step-concurrency resource in user terms: (scope, the key's value; "" for none).
    `sc:fn:<workflow>:<key>`, `sc:env:<environment>:<key>`, `sc:acct:<key>`."""
    own = f"sc:fn:{workflow}"
    if resource == own:
        return "fn", ""
    if resource.startswith(own + ":"):
        return "fn", resource[len(own) + 1 :]
    if resource.startswith("sc:env:"):
        return "env", resource.removeprefix("sc:env:").partition(":")[2]
    if resource.startswith("sc:acct:"):
        return "account", resource.removeprefix("sc:acct:")
    return "fn", resource


def admission_cause(
    decision: AdmissionDecision,
    queue: str,
    workflow: str,
    fairness_key: str,
    constraints: Sequence[Constraint] = (),
) -> Cause:
    """Why admission left the call waiting, from its decision (`constraints`: the call's; a
    backend that does not name the full one is known to mean the only one, if there is one)."""
    detail: dict[str, Any] = {"queue": _text(queue)}
    limits = decision.limits
    if decision.reason == "step_concurrency":
        full = decision.full or (constraints[0] if len(constraints) == 1 else None)
        if full is not None:
            scope, key = key_of(full.resource, workflow)
            detail |= {"resource": _text(full.resource), "key": _text(key), "scope": scope, "limit": full.limit}
        return WaitCause.KEY, detail
    if decision.reason == "rate_limited":
        detail["until"] = _at(decision.retry_at_ms)
        if limits is not None and limits.rate_limit is not None:
            window = limits.rate_limit
            detail |= {"limit": window.limit, "period_ms": window.period_ms}
            return WaitCause.RATE, detail
        detail["key"] = _text(fairness_key)
        if limits is not None and limits.key_rate_limit is not None:
            detail |= {"limit": limits.key_rate_limit.limit, "period_ms": limits.key_rate_limit.period_ms}
        elif limits is not None and limits.throttle is not None:
            detail |= {"throttle": limits.throttle.limit, "period_ms": limits.throttle.period_ms}
        return (WaitCause.KEY_RATE if limits is not None else WaitCause.RATE), detail
    if decision.reason == "concurrency":
        if limits is not None and limits.concurrency is not None:
            detail["limit"] = limits.concurrency
        return WaitCause.CAP, detail
    return WaitCause.TURN, detail


def paused_cause(queue: str) -> Cause:
    return WaitCause.PAUSED, {"queue": _text(queue)}


def signal_wait(names: Sequence[str], until: datetime | None) -> tuple[str, dict[str, Any]]:
    """A signal wait: the names it waits for and its timeout (None: none)."""
    detail = {"cause": WaitCause.SIGNAL.value, "names": [_text(n) for n in names[:5]], "until": _iso(until)}
    return WaitCause.SIGNAL, detail


def event_wait(name: str, match: str | None, until: datetime | None) -> tuple[str, dict[str, Any]]:
    """An event wait: the event's name, its `match` expression and its timeout (None: none)."""
    detail = {
        "cause": WaitCause.EVENT.value,
        "names": [_text(name)],
        "match": _text(match) if match is not None else None,
        "until": _iso(until),
    }
    return WaitCause.EVENT, detail


def timed(cause: str, until: datetime | None) -> tuple[str, dict[str, Any]]:
    """A sleep or a retry's backoff until `until`: the checkpoint's `wait_cause` and `wait_detail`."""
    return cause, {"cause": cause, "until": _iso(until)}


def backoff(until: datetime | None) -> tuple[str, dict[str, Any]]:
    return timed(WaitCause.BACKOFF, until)


#: A call that gave up waiting for admission (its start timeout): the `type` of its error, and
#: the `cause` of the record of its wait kept on its checkpoint (`wait_detail`), skipped or failed.
START_TIMEOUT = "start_timeout"


def held_by(detail: dict[str, Any] | None) -> str:
    """What kept a parked call waiting, from its recorded detail, as the end of a sentence:
    "its cap of 2 was full". Written into a start timeout's error, so the run's error reads on
    its own wherever it is shown."""
    detail = detail or {}
    cause, limit, key = detail.get("cause"), detail.get("limit"), detail.get("key")
    if cause == WaitCause.CAP:
        return f"its cap of {limit} was full" if limit is not None else "its cap was full"
    if cause == WaitCause.RATE:
        per = f" of {limit} per {detail.get('period_ms')} ms" if limit else ""
        return f"its rate window{per} was full"
    if cause == WaitCause.KEY_RATE:
        return f"key {key!r} had used its own rate limit"
    if cause == WaitCause.KEY:
        name = f"step-concurrency key {key!r}" if key else "the workflow's step concurrency"
        return f"{name} (limit {limit}) was full" if limit is not None else f"{name} was full"
    if cause == WaitCause.PAUSED:
        return "the queue was paused"
    return "other calls were ahead of it in line"


def seconds_text(seconds: float) -> str:
    """A wait in seconds as a message shows it: "30 s", "2.5 s"."""
    return f"{round(seconds)} s" if seconds >= 10 else f"{seconds:.3g} s"
