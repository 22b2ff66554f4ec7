"""The events' read model: recent events with the runs each started, resumed or cancelled, for
the dashboard's events page, the admin and the JSON API."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from durable_flow.models import Event, EventDelivery

#: Events on the dashboard's page.
RECENT_EVENTS = 50


@dataclass(frozen=True)
class Delivery:
    """What an event did to one run: `action` is an `EventAction` value."""

    action: str
    action_label: str
    workflow: str
    run_id: str

    @property
    def has_run(self) -> bool:
        """Whether a run exists under `run_id` (a refused or invalid start created none)."""
        return self.action not in ("refused", "invalid")


@dataclass(frozen=True)
class EventView:
    """One event as a page shows it."""

    id: str
    name: str
    data: Any
    received_at: datetime
    pending: bool
    delivered_at: datetime | None
    deliveries: tuple[Delivery, ...]

    def count(self, action: str) -> int:
        return sum(1 for delivery in self.deliveries if delivery.action == action)


def _views(rows: list[Event]) -> list[EventView]:
    by_event: dict[str, list[Delivery]] = defaultdict(list)
    for delivery in EventDelivery.objects.filter(event_id__in=[row.pk for row in rows]).order_by("id"):
        by_event[delivery.event_id].append(
            Delivery(delivery.action, delivery.get_action_display(), delivery.workflow, delivery.run_id)
        )
    return [
        EventView(
            id=row.pk,
            name=row.name,
            data=row.data,
            received_at=row.received_at,
            pending=row.pending,
            delivered_at=row.delivered_at,
            deliveries=tuple(by_event[row.pk]),
        )
        for row in rows
    ]


def recent_events(limit: int = RECENT_EVENTS, name: str | None = None) -> list[EventView]:
    """The latest events, newest first (of one name, if given), with what each did: two queries."""
    rows = Event.objects.order_by("-received_at", "-id")
    if name:
        rows = rows.filter(name=name)
    return _views(list(rows[:limit]))


def event_view(event_id: str) -> EventView | None:
    """One event and what it did, or None."""
    row = Event.objects.filter(pk=event_id).first()
    return _views([row])[0] if row is not None else None


def event_json(view: EventView) -> dict[str, Any]:
    """An event as the JSON API answers it (`Event` in the OpenAPI document)."""
    return {
        "id": view.id,
        "name": view.name,
        "data": view.data,
        "received_at": view.received_at.isoformat(),
        "pending": view.pending,
        "runs": [
            {"action": d.action, "workflow": d.workflow, "run_id": d.run_id if d.has_run else None}
            for d in view.deliveries
        ],
    }
