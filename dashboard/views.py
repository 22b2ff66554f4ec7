"""Staff-only dashboard pages; they render without JavaScript and update live with it."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from dashboard.snapshot import snapshot

View = Callable[[HttpRequest], HttpResponse]


def staff_required(view: View) -> View:
    """Anonymous users go to the admin login; signed-in users who are not staff get 403."""

    @wraps(view)
    def wrapper(request: HttpRequest) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not (request.user.is_active and request.user.is_staff):
            raise PermissionDenied("the dashboard is for staff")
        return view(request)

    return wrapper


@staff_required
def index(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/index.html", {"snap": snapshot()})


@staff_required
def snapshot_json(request: HttpRequest) -> HttpResponse:
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
