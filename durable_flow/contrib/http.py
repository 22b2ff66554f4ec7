"""HTTP mapping of durable_flow's typed errors: a bad request answers 4xx, never 500.

`DurableFlowErrorMiddleware` turns an uncaught `DurableFlowError` raised by any view into a
JSON error with the right status: an unknown workflow, run, step, queue or schedule → 404,
refused by a quota → 429, any other bad input → 400. The 429 carries `Retry-After` only when the quota knows when a slot
frees (a run holding one is parked until a known time); a slot held by a running run has no
known end, and then the header is left out rather than guessed.

For a project that does not install the middleware, `quota_limited` does the quota part for
one view: a start refused by its quota answers 429 and a JSON body naming the key, limit and
active count (`respond_429` builds that response for a hand-written
`except ConcurrencyLimitError`). The JSON API (`durable_flow.urls`) answers its errors itself,
with or without the middleware.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from durable_flow.exceptions import (
    ConcurrencyLimitError,
    DurableFlowError,
    QueueNotFound,
    RunNotFound,
    ScheduleNotFound,
    StepNotFound,
    WorkflowNotFound,
)


def retry_after_s(retry_at: datetime, now: datetime) -> int:
    """`Retry-After` in whole seconds until `retry_at`, rounded up; at least 1 (a time already
    past is a wake the poller is about to make)."""
    return max(1, math.ceil((retry_at - now).total_seconds()))


def error_response(exc: DurableFlowError) -> JsonResponse:
    """The JSON response for a typed error."""
    body: dict[str, object] = {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, WorkflowNotFound | RunNotFound | StepNotFound | QueueNotFound | ScheduleNotFound):
        return JsonResponse(body, status=404)
    if isinstance(exc, ConcurrencyLimitError):
        return respond_429(exc)
    return JsonResponse(body, status=400)


def respond_429(exc: ConcurrencyLimitError, now: datetime | None = None) -> JsonResponse:
    """The 429 for a refused start: key, limit, active, workflow and `retry_at`, and
    `Retry-After` when a slot's freeing is known (`ConcurrencyLimitError.retry_at`); without
    it the header is left out rather than guessed."""
    body: dict[str, object] = {
        "error": type(exc).__name__,
        "message": str(exc),
        "key": exc.key,
        "limit": exc.limit,
        "active": exc.active,
        "workflow": exc.workflow,
        "retry_at": exc.retry_at.isoformat() if exc.retry_at else None,
    }
    response = JsonResponse(body, status=429)
    if exc.retry_at is not None:
        response["Retry-After"] = str(retry_after_s(exc.retry_at, now or timezone.now()))
    return response


def quota_limited(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Decorate a view that starts runs so a full quota answers 429 instead of a 500."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except ConcurrencyLimitError as exc:
            return respond_429(exc)

    return wrapper


class DurableFlowErrorMiddleware:
    """Map `DurableFlowError` from views to 4xx JSON responses."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, DurableFlowError):
            return error_response(exception)
        return None
