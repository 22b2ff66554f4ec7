"""The Quotas and Keys pages: start quotas with their refusal history, and the busy keys of each
step-concurrency constraint. Staff only; each renders complete without JavaScript and subscribes
to its live topic (`quotas:<filter>`, `keys`)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from .access import staff_page
from .limit_pages import keys_context, quotas_context, refusal_filter
from .snapshot import snapshot


@staff_page
def quotas(request: HttpRequest) -> HttpResponse:
    """Every declared start quota with its limit and keys in use, debounce and singleton, and the
    refused starts kept, filtered by `?workflow=` and `?key=` (a bad filter: 400)."""
    form = refusal_filter(request.GET)
    if not form.is_valid():
        context = {**quotas_context(snapshot()), "errors": form.errors}
        return render(request, "dashboard/quotas.html", context, status=400)
    data = form.cleaned_data
    return render(request, "dashboard/quotas.html", quotas_context(snapshot(), data["workflow"], data["key"]))


@staff_page
def keys(request: HttpRequest) -> HttpResponse:
    """The busy keys of every declared step-concurrency constraint, linked to their runs."""
    return render(request, "dashboard/keys.html", keys_context(snapshot()))
