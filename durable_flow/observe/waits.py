"""Why calls wait, in operator words, from what the engine recorded when it parked each call
(`StepCheckpoint.wait_cause`/`wait_detail`, a queue wait's copy on `StepAttempt.waited`):
"cap 2/2", "rate window 20/20 until 08:14:03.127", "key `cust-7` limit 1", "queue paused",
"no worker free", "poller".

Two waits are not parked calls, so they are read from the times the engine wrote: a step
dispatched and not yet claimed waits for a worker (`no worker free`), and a call whose backoff
or sleep is over but which has not gone on yet waits for the poller's next pass (`poller`).
Times are UTC, with the date when it is not today's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db.models import Exists, OuterRef, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from durable_flow.models import (
    SETTLED_STEP_STATUSES,
    TERMINAL_RUN_STATUSES,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WaitCause,
    WorkflowRun,
)

SETTLED = list(SETTLED_STEP_STATUSES)
#: The recorded wait of a call that gave up waiting for admission (`engine.wait_causes.START_TIMEOUT`).
START_TIMEOUT = "start_timeout"

#: What "waiting because of" can filter the run list by: the recorded causes, and a step
#: dispatched but not yet claimed (`worker`).
FILTER_CHOICES = [
    ("cap", "the queue's cap"),
    ("rate", "a rate window"),
    ("key_rate", "a key's own rate limit"),
    ("key", "a key's step-concurrency limit"),
    ("paused", "a paused queue"),
    ("turn", "others ahead in line"),
    ("worker", "no worker free"),
    ("signal", "a signal"),
    ("event", "an event"),
    ("sleep", "a sleep"),
    ("backoff", "a retry backoff"),
]
#: Labels of the waits that are not a recorded cause.
NO_WORKER = "no worker free (dispatched, not yet claimed)"
POLLER = "poller (due, waiting for its next pass)"


def ms_clock(at: datetime) -> str:
    """A time of day to the millisecond: `08:14:03.127`."""
    return at.strftime("%H:%M:%S.") + f"{at.microsecond // 1000:03d}"


def when(at: datetime | str | None, now: datetime | None = None) -> str:
    """`08:14:03.127` today (UTC), `2026-12-08 01:06:05.541` on another day; "—" for none."""
    if isinstance(at, str):
        at = parse_datetime(at)
    if at is None:
        return "—"
    at = at.astimezone(UTC) if timezone.is_aware(at) else at
    today = (now or timezone.now()).astimezone(UTC).date()
    text = ms_clock(at)
    return text if at.date() == today else f"{at.date().isoformat()} {text}"


def _per(ms: Any) -> str:
    if not isinstance(ms, int | float) or ms <= 0:
        return ""
    return f" per {ms / 1000:g} s" if ms < 120_000 else f" per {ms / 60_000:g} min"


def describe(detail: dict[str, Any] | None, now: datetime | None = None, *, with_queue: bool = True) -> str:
    """One recorded wait (`wait_detail`) in operator words; "" for none."""
    if not isinstance(detail, dict):
        return ""
    cause = detail.get("cause")
    queue = detail.get("queue") or ""
    until = f" until {when(detail['until'], now)}" if detail.get("until") else ""
    limit = detail.get("limit")
    if cause == WaitCause.CAP:
        text = f"cap {limit}/{limit}" if limit is not None else "cap full"
    elif cause == WaitCause.RATE:
        text = (f"rate window {limit}/{limit}{_per(detail.get('period_ms'))}" if limit else "rate window full") + until
    elif cause == WaitCause.KEY_RATE:
        rate = f" limit {limit}{_per(detail.get('period_ms'))}" if limit else ""
        if detail.get("throttle"):
            rate = f" throttle {detail['throttle']}{_per(detail.get('period_ms'))}"
        text = f"key `{detail.get('key', '')}`{rate}{until}"
    elif cause == WaitCause.KEY:
        key = detail.get("key")
        scope = {"env": " (environment)", "account": " (account)"}.get(detail.get("scope", ""), "")
        name = f"key `{key}`" if key else "the workflow's step concurrency"
        text = f"{name}{scope} limit {limit}" if limit is not None else "step concurrency full"
    elif cause == WaitCause.PAUSED:
        text = "queue paused"
    elif cause == WaitCause.TURN:
        text = "others ahead in line"
    elif cause == WaitCause.SIGNAL:
        names = ", ".join(f"`{n}`" for n in detail.get("names") or [])
        timeout = f", times out {when(detail['until'], now)}" if detail.get("until") else ", no timeout"
        return f"signal {names}{timeout}"
    elif cause == WaitCause.EVENT:
        names = ", ".join(f"`{n}`" for n in detail.get("names") or [])
        match = f" where `{detail['match']}`" if detail.get("match") else ""
        timeout = f", times out {when(detail['until'], now)}" if detail.get("until") else ", no timeout"
        return f"event {names}{match}{timeout}"
    elif cause == WaitCause.SLEEP:
        return f"sleeping{until}"
    elif cause == WaitCause.BACKOFF:
        return f"retry backoff{until}"
    elif cause == START_TIMEOUT:
        outcome = "skipped" if detail.get("outcome") == "skipped" else "failed"
        reason = detail.get("held_by") or "no slot"
        text = f"gave up waiting after {_seconds(detail.get('waited_s'))}: {reason} ({outcome})"
    else:
        return ""
    if detail.get("gives_up_at"):
        text += f", gives up at {when(detail['gives_up_at'], now)}"
    return f"queue `{queue}`: {text}" if with_queue and queue else text


def _seconds(value: Any) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "its start timeout"
    return f"{round(value)} s" if value >= 10 else f"{value:.3g} s"


@dataclass(frozen=True)
class Wait:
    """One call of a run waiting now, and why."""

    key: str
    name: str
    kind: str
    queue: str
    cause: str
    text: str
    since: datetime | None


def current_waits(run: WorkflowRun, checkpoints: list[StepCheckpoint], now: datetime | None = None) -> list[Wait]:
    """What the run's unsettled calls wait for now (the run page's "Waiting for")."""
    if run.is_terminal:
        return []
    now = now or timezone.now()
    waits = []
    for cp in checkpoints:
        if cp.status in SETTLED:
            continue
        if cp.wait_cause:
            text = describe(cp.wait_detail, now, with_queue=False)  # the page names the queue beside it
            due = cp.wake_at is not None and cp.wake_at <= now
            if due and cp.wait_cause in (WaitCause.SLEEP, WaitCause.BACKOFF):
                text = f"{POLLER}; {text}"
            waits.append(Wait(cp.key, cp.name, cp.kind, cp.queue, cp.wait_cause, text, cp.dispatched_at))
        elif cp.kind == StepKind.STEP and cp.status == StepStatus.DISPATCHED and not cp.worker:
            waits.append(Wait(cp.key, cp.name, cp.kind, cp.queue, "worker", NO_WORKER, cp.dispatched_at))
    return waits


def awaited_signals(checkpoints: list[StepCheckpoint]) -> list[str]:
    """The signal names the run waits for now, in call order (the signal form offers them)."""
    names: list[str] = []
    for cp in checkpoints:
        if cp.kind == StepKind.SIGNAL and cp.status == StepStatus.DISPATCHED and cp.name not in names:
            names.append(cp.name)
    return names


def signal_names_awaited(run_id: str) -> list[str]:
    """`awaited_signals` of a run by id (one indexed read): what a signal's sender checks."""
    rows = StepCheckpoint.objects.filter(run_id=run_id, kind=StepKind.SIGNAL, status=StepStatus.DISPATCHED)
    return list(dict.fromkeys(rows.order_by("sequence").values_list("name", flat=True)))


def waiting_because(cause: str) -> Q:
    """The `WorkflowRun` filter of unfinished runs with a call waiting because of `cause` (a
    `FILTER_CHOICES` value): an `Exists` over the parked calls' partial index (no join, no
    DISTINCT). `worker`: a step dispatched and not yet claimed (no worker stamped on it)."""
    calls = StepCheckpoint.objects.filter(run_id=OuterRef("pk"))
    if cause == "worker":
        calls = calls.filter(kind=StepKind.STEP, status=StepStatus.DISPATCHED, worker="")
    else:
        calls = calls.filter(wait_cause=cause).exclude(status__in=SETTLED)
    return Q(Exists(calls)) & ~Q(status__in=TERMINAL_RUN_STATUSES)
