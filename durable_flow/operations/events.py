"""Sending events: `send_event`, its one-line Django signal receiver `send_event_on`, and the
JSON API's form of it (`record_event`). Delivery is `durable_flow.runtime.events`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from django.db import transaction
from django.dispatch import Signal

from durable_flow.config.limits import EVENT_ID_LENGTH
from durable_flow.config.settings import get_settings
from durable_flow.config.validation import storable_text
from durable_flow.definitions.events import check_event_name
from durable_flow.definitions.serialization import ensure_json
from durable_flow.engine import get_engine
from durable_flow.exceptions import InvalidEvent, InvalidInput, UnknownEvent
from durable_flow.models import Event
from durable_flow.runtime.events import EventDeliverer
from durable_flow.store import events as store
from durable_flow.store import metric_counts

logger = logging.getLogger("durable_flow.operations.events")


def check_event(name: object, data: object, id: object) -> tuple[str, dict[str, Any], str]:
    """The event's name, data and id as they will be stored, or a typed error: `InvalidEvent`
    for a malformed name or id or data that is not a JSON object within `MAX_PAYLOAD_BYTES`,
    `UnknownEvent` for a name not in `DURABLE_FLOW["EVENTS"]`. No id: a fresh one."""
    settings = get_settings()
    name = check_event_name(name)
    if name not in settings.events:
        raise UnknownEvent(f'event {name!r} is not declared in DURABLE_FLOW["EVENTS"]')
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise InvalidEvent(f"data of event {name!r} must be a JSON object (a dict), got {type(data).__name__}")
    try:
        ensure_json(data, f"data of event {name!r}", settings.max_payload_bytes)
        event_id = uuid.uuid4().hex if id is None else storable_text(id, "event id", EVENT_ID_LENGTH)
    except InvalidEvent:
        raise
    except InvalidInput as exc:
        raise InvalidEvent(str(exc)) from None
    return name, dict(data), event_id


def record_event(name: str, data: Mapping[str, Any] | None = None, id: str | None = None) -> tuple[Event, bool]:
    """`send_event`, and whether this call recorded the event (False: its id was sent before)."""
    name, data, event_id = check_event(name, data, id)
    engine = get_engine()
    with transaction.atomic():
        event, created = store.record(event_id, name, data, engine.now())
        if created:
            metric_counts.count(metric_counts.EVENTS_RECEIVED, {"event": name})
    if event.pending:
        # Once the caller's transaction commits (at once outside one); robust: a delivery that
        # fails leaves the event pending, and the poller delivers it.
        transaction.on_commit(lambda: EventDeliverer(engine).deliver(event.id), robust=True)
    return event, created


def send_event(name: str, data: Mapping[str, Any] | None = None, id: str | None = None) -> Event:
    """Record the event `name` with `data` (a JSON object) and start, resume or cancel the runs
    it concerns: every workflow declaring `trigger=name` starts a run with the event as its
    input, every `ctx.wait_for_event(name, ...)` whose `match` holds resumes, every run whose
    `cancel_on` matches is cancelled.

        durable_flow.send_event("orders/created", {"order_id": 17, "total": 120}, id="order-17")

    Idempotent on `id`: an id sent before returns the event recorded then (its name and data,
    not these), and starts nothing again; without `id`, a fresh one. Inside a transaction the
    event is recorded with it and delivered once it commits (not at all if it rolls back).
    `InvalidEvent` for a malformed name, id or data, `UnknownEvent` for a name not declared in
    `DURABLE_FLOW["EVENTS"]`."""
    return record_event(name, data, id)[0]


def send_event_on(
    signal: Signal,
    name: str,
    *,
    data: Callable[..., Mapping[str, Any] | None],
    sender: Any = None,
    id: Callable[..., str | None] | None = None,
    dispatch_uid: str | None = None,
) -> Callable[..., None]:
    """Send the event `name` whenever `signal` is sent (by `sender`, if given): one line in an
    app's `ready()`.

        send_event_on(post_save, "orders/created", sender=Order,
                      data=lambda instance, created, **kw: {"order_id": instance.pk} if created else None)

    `data` (and `id`, for an idempotency key) are called with the signal's arguments; `data`
    returning None sends nothing. The event is recorded in the transaction that sent the signal
    (a `post_save` inside `atomic()` and its event commit together) and delivered after it
    commits. The name is checked now: `UnknownEvent` or `InvalidEvent` at start-up, not at the
    first save. Returns the receiver, connected strongly once per `dispatch_uid` (by default
    one per event name and sender): Django finds a receiver connected with a `dispatch_uid` only
    by that uid, so disconnect it with `signal.disconnect(sender=..., dispatch_uid=
    receiver.dispatch_uid)`."""
    check_event_name(name)
    if name not in get_settings().events:
        raise UnknownEvent(f'send_event_on: event {name!r} is not declared in DURABLE_FLOW["EVENTS"]')

    def receiver(sender: Any, **kwargs: Any) -> None:
        values = data(sender=sender, **kwargs)
        if values is None:
            return
        send_event(name, values, id(sender=sender, **kwargs) if id is not None else None)

    uid = dispatch_uid or f"durable_flow.send_event_on:{name}:{getattr(sender, '__qualname__', sender)!s}"
    signal.connect(receiver, sender=sender, weak=False, dispatch_uid=uid)
    receiver.dispatch_uid = uid  # type: ignore[attr-defined]
    return receiver
