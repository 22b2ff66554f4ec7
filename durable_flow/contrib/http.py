"""HTTP mapping of durable_flow's typed errors: a bad request answers 4xx, never 500.

`DurableFlowErrorMiddleware` turns an uncaught `DurableFlowError` raised by any view into a
JSON error with the right status: unknown workflow/run → 404, refused by a quota → 429 with
`Retry-After`, any other bad input → 400.

For a project that does not install the middleware, `quota_limited` does the quota part for
one view: a start refused by its quota answers 429 with `Retry-After` and a JSON body naming
the key, limit and active count (`respond_429` builds that response for a hand-written
`except ConcurrencyLimitError`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from durable_flow.exceptions import (
    ConcurrencyLimitError,
    DurableFlowError,
    QueueNotFound,
    RunNotFound,
    StepNotFound,
    WorkflowNotFound,
)

RETRY_AFTER_S = 1


def error_response(exc: DurableFlowError) -> JsonResponse:
    """The JSON response for a typed error."""
    body: dict[str, object] = {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, WorkflowNotFound | RunNotFound | StepNotFound | QueueNotFound):
        return JsonResponse(body, status=404)
    if isinstance(exc, ConcurrencyLimitError):
        body.update(key=exc.key, limit=exc.limit, active=exc.active, workflow=exc.workflow)
        response = JsonResponse(body, status=429)
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
    return JsonResponse(body, status=400)


def respond_429(exc: ConcurrencyLimitError) -> JsonResponse:
    """The 429 for a refused start: `Retry-After` plus key, limit, active and workflow."""
    return error_response(exc)


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
