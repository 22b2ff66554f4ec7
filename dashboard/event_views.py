"""The events page: the latest events with the runs each started, resumed or cancelled, and
those still pending (being delivered, or left for the poller by a process that died). Read
only; its table is live (topic `events`), the same for every tab."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string

from durable_flow.observe.events import recent_events

from .access import staff_page
from .live import register_topic


@staff_page
def events(request: HttpRequest) -> HttpResponse:
    """The latest events, newest first, each with what it did to runs."""
    return render(request, "dashboard/events.html", {"events": recent_events()})


def events_topic(_: Mapping[str, Any], __: str) -> dict[str, str]:
    """The `events` live topic: the table."""
    return {"events-table": render_to_string("dashboard/fragments/events-table.html", {"events": recent_events()})}


register_topic("events", events_topic, uses_snapshot=False)  # reads only the events
