"""A small JSON API for staff and their scripts: list, start, inspect, cancel, re-run and signal
runs, act on runs by filter, steer queues. A session (with CSRF) or a personal access token
(`Authorization: Bearer`) authenticates; `durable_flow.contrib.api_access` holds those rules and
the JSON errors; `durable_flow.contrib.openapi` describes every route (and serves that at
`openapi.json`).

GET  /api/runs/                  ?status=&workflow=&queue=&tag=&created_after=&created_before=&id_prefix=
                                 &limit=&cursor= → {"runs": [...], "next_cursor"}, newest first
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
POST /api/events/                {"name": "...", "data": {...}?, "id": "..."?} → 201, the event and the
                                 runs it started, resumed or cancelled (200 if the id was sent before)
GET  /api/schedules/             → {"schedules": [...]}: each schedule's cron, timezone, catch-up,
                                 next and last ticks, last run and last refusal
POST /api/schedules/<workflow>/pause/ | resume/  → the schedule (resumed at its next tick from now)
GET  /api/openapi.json           → the OpenAPI 3.1 document of these routes (no login needed)

Operations need a model permission besides staff status (`durable_flow.start_workflowrun`,
`cancel_workflowrun`, `retry_workflowrun`, `signal_workflowrun`, `change_flowqueue`,
`change_schedule`; `add_event` to send an event, which may start and cancel runs): 403 without
it, for a token as for a session. Each one is logged as an admin `LogEntry` under the acting user.
"""

from __future__ import annotations

import json
from base64 import urlsafe_b64decode, urlsafe_b64encode
from datetime import datetime
from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse

from durable_flow.config.limits import RUN_ID_LENGTH
from durable_flow.config.validation import storable_text
from durable_flow.contrib.api_access import ApiError, json_body, requires
from durable_flow.exceptions import InvalidInput, ScheduleNotFound
from durable_flow.models import WorkflowRun
from durable_flow.observe.events import event_json, event_view
from durable_flow.observe.queues import stored_queue
from durable_flow.observe.run_filters import RunFilterForm, filtered_runs, runs_from_json
from durable_flow.observe.run_pages import run_page
from durable_flow.observe.schedules import ScheduleView, schedule, schedules
from durable_flow.operations import api, bulk
from durable_flow.operations.audit import record_operation
from durable_flow.operations.events import record_event

#: Runs on one page of the list, unless `limit` asks for fewer or more (up to `MAX_PAGE_SIZE`).
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
#: The list's query parameters that are fields of the filter bar (`RunFilterForm`), by their
#: name there (`id_prefix` is the bar's id search, a prefix); `limit` and `cursor` are the list's own.
FILTER_PARAMETERS = {
    "id_prefix": "q",
    "status": "status",
    "workflow": "workflow",
    "queue": "queue",
    "tag": "tag",
    "created_after": "since",
    "created_before": "until",
}
LIST_PARAMETERS = (*FILTER_PARAMETERS, "limit", "cursor")


def run_json(run: WorkflowRun, with_steps: bool = False) -> dict[str, Any]:
    """A run as the API answers it (`Run`, or `RunDetail` with its steps, in the OpenAPI document)."""
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


def run_summary_json(run: WorkflowRun) -> dict[str, Any]:
    """A line of the run list (`RunSummary`): no input or output, and only the error's type and
    message."""
    error = run.error if isinstance(run.error, dict) else None
    return {
        "id": run.id,
        "workflow": run.workflow,
        "version": run.version,
        "status": run.status,
        "tags": run.tags,
        "concurrency_key": run.concurrency_key,
        "parent_id": run.parent_id,
        "rerun_of": run.rerun_of or None,
        "error": {"type": str(error.get("type", "")), "message": str(error.get("message", ""))} if error else None,
        "wake_at": run.wake_at.isoformat() if run.wake_at else None,
        "created_at": run.created_at.isoformat(),
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
    }


def bad_parameter(name: str, message: str) -> ApiError:
    return ApiError(400, "InvalidInput", f"{name}: {message}", field=name)


def encode_cursor(after: tuple[datetime, str]) -> str:
    """An opaque cursor: the last run's `(created_at, id)`, as URL-safe base64 of JSON."""
    raw = json.dumps([after[0].isoformat(), after[1]]).encode()
    return urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The `(created_at, id)` a cursor from `encode_cursor` holds; 400 naming `cursor` otherwise."""
    try:
        created, run_id = json.loads(urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        created_at = datetime.fromisoformat(created)
    except (ValueError, TypeError):  # not base64, not JSON, not a pair, not a time
        raise bad_parameter("cursor", "not a cursor this API gave") from None
    if created_at.tzinfo is None or not isinstance(run_id, str) or len(run_id) > RUN_ID_LENGTH or "\x00" in run_id:
        raise bad_parameter("cursor", "not a cursor this API gave")
    return created_at, run_id


def page_size(value: str | None) -> int:
    if value is None:
        return DEFAULT_PAGE_SIZE
    if not value.isdigit() or not 1 <= int(value) <= MAX_PAGE_SIZE:
        raise bad_parameter("limit", f"must be a whole number from 1 to {MAX_PAGE_SIZE}")
    return int(value)


def listed_runs(request: HttpRequest) -> QuerySet[WorkflowRun]:
    """The runs the list's query parameters select, through the filter bar's form
    (`RunFilterForm`); an unknown parameter, one given twice or a bad value is a 400 naming it."""
    params = request.GET
    unknown = sorted(set(params) - set(LIST_PARAMETERS))
    if unknown:
        raise bad_parameter(unknown[0], f"unknown parameter; the list takes {', '.join(LIST_PARAMETERS)}")
    for name in params:
        if name != "status" and len(params.getlist(name)) > 1:
            raise bad_parameter(name, "give it once")
    data: dict[str, Any] = {}
    for name, field in FILTER_PARAMETERS.items():
        if name == "status":  # repeated, or comma-separated
            data[field] = [status for value in params.getlist(name) for status in value.split(",") if status]
        elif params.get(name):
            data[field] = params[name]
    form = RunFilterForm(data)
    if not form.is_valid():
        field, errors = next(iter(form.errors.items()))
        name = next((name for name, known in FILTER_PARAMETERS.items() if known == field), field)
        raise bad_parameter(name, " ".join(errors))
    return filtered_runs(form.cleaned_data)


def list_runs(request: HttpRequest) -> HttpResponse:
    """A page of runs, newest first; `next_cursor` asks for the next (null on the last page)."""
    runs = listed_runs(request)
    size = page_size(request.GET.get("limit"))
    cursor = request.GET.get("cursor")
    page = run_page(runs, after=decode_cursor(cursor) if cursor else None, size=size)
    return JsonResponse(
        {
            "runs": [run_summary_json(run) for run in page.runs],
            "next_cursor": encode_cursor(page.older) if page.older else None,
        }
    )


@requires("start_workflowrun")
def start_run(request: HttpRequest) -> HttpResponse:
    body = json_body(request)
    workflow = body.get("workflow")
    if not isinstance(workflow, str) or not workflow:
        raise ApiError(400, "InvalidInput", '"workflow" must be a workflow name', field="workflow")
    run_id = body.get("run_id")
    if run_id is not None:
        try:
            storable_text(run_id, '"run_id"', RUN_ID_LENGTH)
        except InvalidInput as exc:
            raise ApiError(400, "InvalidInput", str(exc), field="run_id") from None
    existed = run_id is not None and WorkflowRun.objects.filter(pk=run_id).exists()
    run = api.start(workflow, body.get("input"), run_id=run_id)
    existed = existed or hasattr(run, "start_outcome")  # folded into a debounced run, or skipped
    if not existed:
        record_operation(request.user, run, "Started from the JSON API")
    return JsonResponse(run_json(run), status=200 if existed else 201)


def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    return JsonResponse(run_json(api.get_run(run_id), with_steps=True))


@requires("cancel_workflowrun")
def cancel_run(request: HttpRequest, run_id: str) -> HttpResponse:
    run = api.cancel(run_id)
    record_operation(request.user, run, "Cancelled from the JSON API")
    return JsonResponse(run_json(run))


@requires("retry_workflowrun")
def retry_run(request: HttpRequest, run_id: str) -> HttpResponse:
    run = api.retry(run_id)
    record_operation(request.user, run, "Retried from the JSON API")
    return JsonResponse(run_json(api.get_run(run_id)))


@requires("start_workflowrun")
def rerun_run(request: HttpRequest, run_id: str) -> HttpResponse:
    body = json_body(request)
    new_run_id = body.get("run_id")
    run = api.rerun(run_id, new_run_id=new_run_id)
    record_operation(request.user, run, f"Re-run of {run_id} from the JSON API")
    return JsonResponse(run_json(run), status=201)


@requires("signal_workflowrun")
def send_signal(request: HttpRequest, run_id: str) -> HttpResponse:
    body = json_body(request)
    name = body.get("name")
    api.send_signal(run_id, name, body.get("payload"))  # type: ignore[arg-type]  # validated there
    run = api.get_run(run_id)
    record_operation(request.user, run, f"Sent signal {name!r} from the JSON API")
    return JsonResponse({"run_id": run.id, "signal": name, "status": run.status}, status=202)


def bulk_operation(request: HttpRequest, action: str) -> HttpResponse:
    """Cancel or retry every run a JSON filter matches (the dashboard's "by filter" actions),
    in batches of `bulk.BATCH_SIZE` runs a transaction, each run audited under the caller."""
    permission = "cancel_workflowrun" if action == "cancel" else "retry_workflowrun"
    if not request.user.has_perm(f"durable_flow.{permission}"):
        raise ApiError(403, "PermissionDenied", f"needs the durable_flow.{permission} permission")
    runs = runs_from_json(json_body(request))
    message = f"{action.capitalize()} (JSON API, by filter)"
    if action == "cancel":
        result = bulk.cancel_matching(runs, request.user, message)
    else:
        result = bulk.retry_matching(runs, request.user, message)
    return JsonResponse({"done": result.done, "refused": result.refused, "batches": result.batches})


@requires("add_event")
def send_event(request: HttpRequest) -> HttpResponse:
    """Record an event and deliver it (its starts, resumed waits and cancels are in the answer:
    the delivery runs once the request's transaction, if any, commits)."""
    body = json_body(request)
    unknown = sorted(set(body) - {"name", "data", "id"})
    if unknown:
        raise ApiError(400, "InvalidInput", f"unknown field(s): {', '.join(unknown)}", field=unknown[0])
    event, created = record_event(body.get("name"), body.get("data"), body.get("id"))  # type: ignore[arg-type]
    view = event_view(event.pk)
    assert view is not None
    return JsonResponse(event_json(view), status=201 if created else 200)


@requires("change_flowqueue")
def steer_queue(request: HttpRequest, name: str, operation: str) -> HttpResponse:
    """`pause`, `resume`, or `update` (`{"concurrency": 5, "rate_limit": {...} | null}`)."""
    if operation == "pause":
        api.pause_queue(name)
    elif operation == "resume":
        api.resume_queue(name)
    else:
        api.update_queue(name, **json_body(request))
    queue = stored_queue(name)  # as stored, whichever operation ran
    record_operation(request.user, queue, f"{operation.capitalize()}d from the JSON API: {queue.config}")
    return JsonResponse({"name": queue.name, "paused": queue.paused, "config": queue.config})


def iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def schedule_json(view: ScheduleView) -> dict[str, Any]:
    """A schedule as the API answers it (`Schedule` in the OpenAPI document)."""
    refusal = None
    if view.last_refused_tick_at is not None:
        refusal = {
            "tick_at": iso(view.last_refused_tick_at),
            "run_id": view.last_refused_run_id,
            "outcome": view.last_refusal,
        }
    return {
        "workflow": view.workflow,
        "cron": view.cron,
        "timezone": view.timezone,
        "catch_up": view.catch_up or None,
        "max_catch_up": view.max_catch_up,
        "declared": view.declared,
        "paused": view.paused,
        # A paused schedule has no next tick: resuming computes it from then.
        "next_tick_at": None if view.paused else iso(view.next_tick_at),
        "last_tick_at": iso(view.last_tick_at),
        "last_run_id": view.last_run_id or None,
        "last_outcome": view.last_outcome or None,
        "last_refusal": refusal,
    }


def list_schedules(request: HttpRequest) -> HttpResponse:
    """Every stored schedule, by workflow name."""
    return JsonResponse({"schedules": [schedule_json(view) for view in schedules()]})


@requires("change_schedule")
def steer_schedule(request: HttpRequest, workflow: str, operation: str) -> HttpResponse:
    """`pause` or `resume` (at the next tick from now) a schedule; 404 for one not stored."""
    row = api.pause_schedule(workflow) if operation == "pause" else api.resume_schedule(workflow)
    record_operation(request.user, row, f"{operation.capitalize()}d from the JSON API")
    view = schedule(workflow)
    if view is None:  # deleted meanwhile (the admin)
        raise ScheduleNotFound(f"no schedule is stored for workflow {workflow!r}")
    return JsonResponse(schedule_json(view))
