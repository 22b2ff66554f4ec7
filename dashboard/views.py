"""Staff-only dashboard pages; they render without JavaScript and update live with it."""

from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from dashboard.snapshot import snapshot


@staff_member_required
def index(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/index.html", {"snap": snapshot()})


@staff_member_required
def snapshot_json(request: HttpRequest) -> JsonResponse:
    return JsonResponse(snapshot())
