"""Staff-only dashboard pages. Each renders complete without JavaScript; with it, the page
subscribes to its live topic (`dashboard/live.py`) and swaps in the fragments of every tick."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_POST

from durable_flow.exceptions import DurableFlowError, QueueNotFound
from durable_flow.observe.queues import stored_queue
from durable_flow.operations import api
from durable_flow.operations.audit import record_operation

from . import pages
from .access import staff_page
from .snapshot import snapshot

View = Callable[..., HttpResponse]
QUEUE_PERMISSION = "durable_flow.change_flowqueue"


#: The dashboard's pages share one staff gate (anonymous: login; not staff: 403).
staff_required = staff_page


@staff_required
def index(request: HttpRequest) -> HttpResponse:
    """The overview: problems, run counts, charts, queues, quotas and workers."""
    return render(request, "dashboard/index.html", pages.overview_context(snapshot()))


@staff_required
def snapshot_json(request: HttpRequest) -> HttpResponse:
    """The whole snapshot as JSON (what every live tick is computed from)."""
    return JsonResponse(snapshot())


FAVICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    '<rect width="16" height="16" rx="3" fill="#1d2330"/><circle cx="5" cy="8" r="2" fill="#9cc3ff"/>'
    '<circle cx="11" cy="8" r="2" fill="#2e9e5b"/></svg>'
)


def favicon(request: HttpRequest) -> HttpResponse:
    """The browser's /favicon.ico (a small SVG), so no page logs a 404 for it."""
    response = HttpResponse(FAVICON, content_type="image/svg+xml")
    response["Cache-Control"] = "max-age=86400"
    return response


def session_check(request: HttpRequest) -> HttpResponse:
    """204 while the session is a staff one. The live script asks this after its socket drops,
    to tell "the server is down" (no answer) from "your session expired" (401)."""
    if request.user.is_authenticated and request.user.is_staff:
        return HttpResponse(status=204)
    return JsonResponse({"login": reverse("admin:login")}, status=401)


@staff_required
def queues(request: HttpRequest) -> HttpResponse:
    """Every queue's numbers and what blocks it."""
    return render(request, "dashboard/queues.html", pages.queues_context(snapshot()))


@staff_required
def queue_detail(request: HttpRequest, name: str) -> HttpResponse:
    """One queue: its numbers, why calls wait, its keys and charts, and the steering forms."""
    context = pages.queue_context(snapshot(), name)
    if context is None:
        raise Http404(f"no queue named {name!r}")
    context |= {"can_change": request.user.has_perm(QUEUE_PERMISSION)}
    return render(request, "dashboard/queue.html", context)


@staff_required
def workers(request: HttpRequest) -> HttpResponse:
    """A card per worker, in a stable order."""
    return render(request, "dashboard/workers.html", pages.workers_context(snapshot()))


def _require_queue_permission(request: HttpRequest) -> None:
    if not request.user.has_perm(QUEUE_PERMISSION):
        raise PermissionDenied(f"needs the {QUEUE_PERMISSION} permission")


def _steer(request: HttpRequest, name: str, operation: Callable[[], Any], message: str) -> HttpResponse:
    """Run a queue operation for a permitted user, audit it, and go back to the queue's page."""
    _require_queue_permission(request)
    try:
        operation()
    except QueueNotFound as exc:
        raise Http404(str(exc)) from None
    except DurableFlowError as exc:
        messages.error(request, str(exc))
        return HttpResponseRedirect(reverse("dashboard:queue", args=[name]), status=303)
    queue = stored_queue(name)
    record_operation(request.user, queue, f"{message} from the dashboard: {queue.config}")
    messages.success(request, f"{message}: {name}")
    return HttpResponseRedirect(reverse("dashboard:queue", args=[name]), status=303)


@require_POST
@staff_required
def queue_pause(request: HttpRequest, name: str) -> HttpResponse:
    return _steer(request, name, lambda: api.pause_queue(name), "Paused")


@require_POST
@staff_required
def queue_resume(request: HttpRequest, name: str) -> HttpResponse:
    return _steer(request, name, lambda: api.resume_queue(name), "Resumed")


@require_POST
@staff_required
def queue_resize(request: HttpRequest, name: str) -> HttpResponse:
    """The resize form: a concurrency cap and a rate limit; a blank field removes that option."""
    _require_queue_permission(request)
    try:
        changes = pages.parse_resize_form(request.POST)
    except ValueError as exc:
        messages.error(request, f"Not resized: {exc}")
        return HttpResponseRedirect(reverse("dashboard:queue", args=[name]), status=303)
    return _steer(request, name, lambda: api.update_queue(name, **changes), "Resized")
