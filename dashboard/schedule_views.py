"""The schedules page: every schedule's next and last ticks, and pause/resume (POST, CSRF,
staff with the `change_schedule` permission). Its table is live (topic `schedules`): rendered
for every tab alike, so the page's script gives its forms the CSRF token and disables its
buttons for a user without the permission; the server checks both on the POST."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.middleware.csrf import get_token
from django.shortcuts import render
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.http import require_POST

from durable_flow.exceptions import ScheduleNotFound
from durable_flow.models import Schedule
from durable_flow.observe.schedules import schedules as schedule_views
from durable_flow.operations.audit import record_operation
from durable_flow.operations.schedules import pause_schedule, resume_schedule

from .access import staff_page
from .live import register_topic

SCHEDULE_PERMISSION = "durable_flow.change_schedule"


@staff_page
def schedules(request: HttpRequest) -> HttpResponse:
    """Every stored schedule: its cron and timezone, next and last ticks, and the last tick's
    outcome, with a pause or resume button each."""
    context = {
        "schedules": schedule_views(),
        "can_change": request.user.has_perm(SCHEDULE_PERMISSION),
        "page_token": get_token(request),
    }
    return render(request, "dashboard/schedules.html", context)


def schedules_topic(_: Mapping[str, Any], __: str) -> dict[str, str]:
    """The `schedules` live topic: the table, with no user (see the module's docstring)."""
    table = render_to_string("dashboard/fragments/schedules-table.html", {"schedules": schedule_views()})
    return {"schedules-table": table}


register_topic("schedules", schedules_topic, uses_snapshot=False)  # reads only the schedules


def _steer(request: HttpRequest, workflow: str, paused: bool) -> HttpResponse:
    if not request.user.has_perm(SCHEDULE_PERMISSION):
        raise PermissionDenied(f"needs the {SCHEDULE_PERMISSION} permission")
    try:
        row: Schedule = pause_schedule(workflow) if paused else resume_schedule(workflow)
    except ScheduleNotFound as exc:
        raise Http404(str(exc)) from None
    verb = "Paused" if paused else "Resumed"
    record_operation(request.user, row, f"{verb} from the dashboard")
    messages.success(request, f"{verb}: {workflow}")
    return HttpResponseRedirect(reverse("dashboard:schedules"), status=303)


@require_POST
@staff_page
def schedule_pause(request: HttpRequest, workflow: str) -> HttpResponse:
    return _steer(request, workflow, paused=True)


@require_POST
@staff_page
def schedule_resume(request: HttpRequest, workflow: str) -> HttpResponse:
    return _steer(request, workflow, paused=False)
