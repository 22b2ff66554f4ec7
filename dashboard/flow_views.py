"""The flow page and its burst button (staff with the start permission, POST + CSRF)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_POST

from durable_flow.config.limits import QUEUE_NAME_LENGTH
from durable_flow.config.validation import storable_text
from durable_flow.contrib.http import error_response
from durable_flow.exceptions import DurableFlowError, InvalidInput
from durable_flow.observe.queues import queue_flow, queue_names
from durable_flow.operations import api
from durable_flow.operations.audit import record_operation

from .access import allowed, require, staff_page
from .flow import DEFAULT_BURST, MAX_BURST, burst_config, burst_inputs


def _shown_burst() -> dict[str, Any]:
    """The burst the page offers. A malformed `DASHBOARD_BURST` (reported by `manage.py check`
    as `durable_flow_dashboard.E005`, refused by the burst button) still lets the page draw, with the defaults."""
    try:
        return burst_config()
    except ImproperlyConfigured:
        return DEFAULT_BURST


def _queue(request: HttpRequest) -> str:
    """The `?queue=` to show; `InvalidInput` for a name no queue can have (a NUL, over-long)."""
    queue = request.GET.get("queue") or _shown_burst()["QUEUE"]
    return storable_text(queue, "queue", QUEUE_NAME_LENGTH)


@staff_page
def flow(request: HttpRequest) -> HttpResponse:
    try:
        queue = _queue(request)
    except InvalidInput as exc:
        return error_response(exc)
    context = {
        "snap": queue_flow(queue),
        "queue": queue,
        "queues": queue_names(),
        "burst": _shown_burst(),
        **allowed(request),
    }
    return render(request, "dashboard/flow.html", context)


@staff_page
def flow_json(request: HttpRequest) -> HttpResponse:
    try:
        queue = _queue(request)
    except InvalidInput as exc:
        return error_response(exc)
    return JsonResponse(queue_flow(queue))


@staff_page
@require_POST
def burst(request: HttpRequest) -> HttpResponse:
    """Start N runs of the configured burst workflow (into its throttled queue) at once."""
    require(request, "start")
    try:
        config = burst_config()
    except ImproperlyConfigured as exc:
        return JsonResponse({"error": "ImproperlyConfigured", "message": str(exc)}, status=400)
    try:
        size = int(request.POST.get("size") or config["SIZE"])
    except ValueError:
        return JsonResponse({"error": "InvalidInput", "message": "size must be an integer"}, status=400)
    if not 1 <= size <= MAX_BURST:
        return JsonResponse({"error": "InvalidInput", "message": f"size must be 1..{MAX_BURST}"}, status=400)
    started = []
    try:
        for payload in burst_inputs(size):
            started.append(api.start(config["WORKFLOW"], payload, tags=["burst"]).pk)
    except DurableFlowError as exc:
        return JsonResponse({"error": type(exc).__name__, "message": str(exc), "started": len(started)}, status=400)
    if started:
        record_operation(request.user, api.get_run(started[0]), f"Burst of {len(started)} runs (dashboard)")
    if request.headers.get("accept", "").startswith("application/json"):
        return JsonResponse({"started": len(started), "queue": config["QUEUE"]}, status=201)
    messages.success(request, f"Started {len(started)} runs into {config['QUEUE']}.")
    return HttpResponseRedirect(f"{reverse('dashboard:flow')}?queue={config['QUEUE']}")
