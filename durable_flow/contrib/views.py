"""A small JSON API for staff: start, inspect, cancel, re-run and signal runs (session auth + CSRF).

POST /api/runs/                  {"workflow": "...", "input": ..., "run_id": "..."?}  → 201 (200 if it existed,
                                 or a debounce or singleton returned a pending or running one)
GET  /api/runs/<run_id>/         → the run and its checkpoints
POST /api/runs/<run_id>/cancel/  → the run after cancel
POST /api/runs/<run_id>/retry/   → the run, resumed from where it failed
POST /api/runs/<run_id>/rerun/   {"run_id": "..."?} → 201, the new run (linked by `rerun_of`)
POST /api/runs/<run_id>/signals/ {"name": "...", "payload": ...} → 202
POST /api/bulk/cancel/ | bulk/retry/      {"status": [...], "workflow", "queue", "tag", "q", "range",
                                           "since", "until"} or {"all": true} → {"done", "refused", "batches"}
POST /api/queues/<name>/pause/ | resume/ | update/ {"concurrency"?, "rate_limit"?} → the queue

Operations need a model permission besides staff status (`durable_flow.start_workflowrun`,
`cancel_workflowrun`, `retry_workflowrun`, `signal_workflowrun`): 403 without it. Each one is logged as an admin
`LogEntry` under the acting user.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

from durable_flow.config.limits import RUN_ID_LENGTH
from durable_flow.config.validation import StrictJSONDecoder, storable_text
from durable_flow.exceptions import InvalidInput
from durable_flow.models import WorkflowRun
from durable_flow.observe.queues import stored_queue
from durable_flow.observe.run_filters import runs_from_json
from durable_flow.operations import api, bulk
from durable_flow.operations.audit import record_operation

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


def requires(permission: str) -> Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]]:
    """403 (JSON) unless the user holds `durable_flow.<permission>`."""

    def decorate(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.has_perm(f"durable_flow.{permission}"):
                return JsonResponse(
                    {"error": "PermissionDenied", "message": f"needs the durable_flow.{permission} permission"},
                    status=403,
                )
            return view(request, *args, **kwargs)

        return wrapper

    return decorate


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
        "rerun_of": run.rerun_of or None,
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
        body = json.loads(request.body or b"{}", cls=StrictJSONDecoder)
    except ValueError as exc:  # not JSON, not UTF-8, an integer too long to convert, or NaN
        raise InvalidInput(f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object")
    return body


@require_POST
@staff_api
@requires("start_workflowrun")
def start_run(request: HttpRequest) -> HttpResponse:
    body = _body(request)
    workflow = body.get("workflow")
    if not isinstance(workflow, str) or not workflow:
        raise InvalidInput('"workflow" must be a workflow name')
    run_id = body.get("run_id")
    if run_id is not None:
        storable_text(run_id, '"run_id"', RUN_ID_LENGTH)
    existed = run_id is not None and WorkflowRun.objects.filter(pk=run_id).exists()
    run = api.start(workflow, body.get("input"), run_id=run_id)
    existed = existed or hasattr(run, "start_outcome")  # folded into a debounced run, or skipped
    if not existed:
        record_operation(request.user, run, "Started from the JSON API")
    return JsonResponse(run_json(run), status=200 if existed else 201)


@require_GET
@staff_api
def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    return JsonResponse(run_json(api.get_run(run_id), with_steps=True))


@require_POST
@staff_api
@requires("cancel_workflowrun")
def cancel_run(request: HttpRequest, run_id: str) -> HttpResponse:
    run = api.cancel(run_id)
    record_operation(request.user, run, "Cancelled from the JSON API")
    return JsonResponse(run_json(run))


@require_POST
@staff_api
@requires("retry_workflowrun")
def retry_run(request: HttpRequest, run_id: str) -> HttpResponse:
    run = api.retry(run_id)
    record_operation(request.user, run, "Retried from the JSON API")
    return JsonResponse(run_json(api.get_run(run_id)))


@require_POST
@staff_api
@requires("start_workflowrun")
def rerun_run(request: HttpRequest, run_id: str) -> HttpResponse:
    body = _body(request)
    new_run_id = body.get("run_id")
    run = api.rerun(run_id, new_run_id=new_run_id)
    record_operation(request.user, run, f"Re-run of {run_id} from the JSON API")
    return JsonResponse(run_json(run), status=201)


@require_POST
@staff_api
@requires("signal_workflowrun")
def send_signal(request: HttpRequest, run_id: str) -> HttpResponse:
    body = _body(request)
    name = body.get("name")
    api.send_signal(run_id, name, body.get("payload"))  # type: ignore[arg-type]  # validated there
    run = api.get_run(run_id)
    record_operation(request.user, run, f"Sent signal {name!r} from the JSON API")
    return JsonResponse({"run_id": run.id, "signal": name, "status": run.status}, status=202)


@require_POST
@staff_api
def bulk_operation(request: HttpRequest, action: str) -> HttpResponse:
    """Cancel or retry every run a JSON filter matches (the dashboard's "by filter" actions),
    in batches of `bulk.BATCH_SIZE` runs a transaction, each run audited under the caller."""
    permission = "cancel_workflowrun" if action == "cancel" else "retry_workflowrun"
    if not request.user.has_perm(f"durable_flow.{permission}"):
        return JsonResponse(
            {"error": "PermissionDenied", "message": f"needs the durable_flow.{permission} permission"}, status=403
        )
    runs = runs_from_json(_body(request))
    message = f"{action.capitalize()} (JSON API, by filter)"
    if action == "cancel":
        result = bulk.cancel_matching(runs, request.user, message)
    else:
        result = bulk.retry_matching(runs, request.user, message)
    return JsonResponse({"done": result.done, "refused": result.refused, "batches": result.batches})


@require_POST
@staff_api
@requires("change_flowqueue")
def steer_queue(request: HttpRequest, name: str, operation: str) -> HttpResponse:
    """`pause`, `resume`, or `update` (`{"concurrency": 5, "rate_limit": {...} | null}`)."""
    if operation == "pause":
        api.pause_queue(name)
    elif operation == "resume":
        api.resume_queue(name)
    else:
        api.update_queue(name, **_body(request))
    queue = stored_queue(name)  # as stored, whichever operation ran
    record_operation(request.user, queue, f"{operation.capitalize()}d from the JSON API: {queue.config}")
    return JsonResponse({"name": queue.name, "paused": queue.paused, "config": queue.config})
