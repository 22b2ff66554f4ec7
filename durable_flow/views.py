"""A small JSON API for staff: start, inspect and cancel runs (session auth + CSRF).

POST /api/runs/                {"workflow": "...", "input": ..., "run_id": "..."?}  → 201 (200 if it existed)
GET  /api/runs/<run_id>/       → the run and its checkpoints
POST /api/runs/<run_id>/cancel/ → the run after cancel
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

from durable_flow import api
from durable_flow.api import MAX_NAME
from durable_flow.exceptions import InvalidInput
from durable_flow.models import WorkflowRun
from durable_flow.validation import storable_text

MAX_BODY_BYTES = 2_000_000


def staff_api(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """401 for anonymous callers and 403 for non-staff (JSON, no login redirect)."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return JsonResponse({"error": "NotAuthenticated", "message": "log in first"}, status=401)
        if not request.user.is_staff:
            return JsonResponse({"error": "PermissionDenied", "message": "staff only"}, status=403)
        return view(request, *args, **kwargs)

    return wrapper


def run_json(run: WorkflowRun, with_steps: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": run.id,
        "workflow": run.workflow,
        "version": run.version,
        "status": run.status,
        "input": run.input,
        "output": run.output,
        "error": run.error,
        "wake_at": run.wake_at.isoformat() if run.wake_at else None,
        "created_at": run.created_at.isoformat(),
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
    }
    if with_steps:
        data["steps"] = [
            {
                "key": cp.key,
                "kind": cp.kind,
                "name": cp.name,
                "status": cp.status,
                "attempt": cp.attempt,
                "queue": cp.queue,
                "output": cp.output,
                "error": cp.error,
            }
            for cp in run.checkpoints.order_by("sequence")
        ]
    return data


def _body(request: HttpRequest) -> dict[str, Any]:
    if len(request.body) > MAX_BODY_BYTES:
        raise InvalidInput(f"request body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(request.body or b"{}")
    except ValueError as exc:  # not JSON, not UTF-8, or an integer too long to convert
        raise InvalidInput(f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object")
    return body


@require_POST
@staff_api
def start_run(request: HttpRequest) -> HttpResponse:
    body = _body(request)
    workflow = body.get("workflow")
    if not isinstance(workflow, str) or not workflow:
        raise InvalidInput('"workflow" must be a workflow name')
    run_id = body.get("run_id")
    if run_id is not None:
        storable_text(run_id, '"run_id"', MAX_NAME)
    existed = run_id is not None and WorkflowRun.objects.filter(pk=run_id).exists()
    run = api.start(workflow, body.get("input"), run_id=run_id)
    return JsonResponse(run_json(run), status=200 if existed else 201)


@require_GET
@staff_api
def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    return JsonResponse(run_json(api.get_run(run_id), with_steps=True))


@require_POST
@staff_api
def cancel_run(request: HttpRequest, run_id: str) -> HttpResponse:
    return JsonResponse(run_json(api.cancel(run_id)))
