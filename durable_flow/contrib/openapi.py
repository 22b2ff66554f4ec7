"""The OpenAPI 3.1 document of the JSON API (`durable_flow.urls`), written out here once and
served at `openapi.json`. Tests validate it with `openapi-spec-validator`, hold its paths and
methods equal to the URL patterns', and validate real answers against its schemas."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from durable_flow.config.limits import EVENT_ID_LENGTH, EVENT_NAME_LENGTH, RUN_ID_LENGTH
from durable_flow.contrib.api_access import MAX_BODY_BYTES
from durable_flow.contrib.views import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from durable_flow.models import RunStatus, ScheduleOutcome
from durable_flow.observe.schedules import CATCH_UP_POLICIES

JSON = "application/json"


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"oneOf": [schema, {"type": "null"}]}


def answer(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def errors(*codes: int) -> dict[str, Any]:
    """The operation's error answers, each a shared response of `components.responses`."""
    return {str(code): {"$ref": f"#/components/responses/{ERROR_RESPONSES[code][0]}"} for code in codes}


#: status → (response name, when it is answered)
ERROR_RESPONSES: dict[int, tuple[str, str]] = {
    400: ("BadRequest", "Bad input: the body, a parameter or a value (`field` names it when one is to blame)."),
    401: ("Unauthorized", "No session and no bearer token, or a token that is unknown, revoked or expired."),
    403: ("Forbidden", "Not staff, without the operation's permission, or a session request failing CSRF."),
    404: ("NotFound", "No such run, workflow, queue or schedule."),
    405: ("MethodNotAllowed", "The route does not serve this method (`Allow` lists those it does)."),
    413: ("PayloadTooLarge", f"The request body is over {MAX_BODY_BYTES:,} bytes."),
    429: ("TooManyRequests", "The workflow's start quota is full."),
}

RUN_ID = {
    "name": "run_id",
    "in": "path",
    "required": True,
    "description": "The run's id.",
    "schema": {"type": "string", "maxLength": RUN_ID_LENGTH},
}

TIMESTAMP = {"type": "string", "format": "date-time"}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error", "message"],
        "properties": {
            "error": {"type": "string", "description": "The error's name, e.g. `InvalidInput`, `RunNotFound`."},
            "message": {"type": "string"},
            "field": {"type": "string", "description": "The parameter or body field to blame (400 only)."},
        },
    },
    "QuotaRefused": {
        "allOf": [ref("Error")],
        "type": "object",
        "required": ["key", "limit", "active", "workflow", "retry_at"],
        "properties": {
            "key": {"type": "string"},
            "limit": {"type": "integer"},
            "active": {"type": "integer"},
            "workflow": {"type": "string"},
            "retry_at": {
                **nullable(TIMESTAMP),
                "description": "When a slot frees as planned now; null when no run holding one has a known end.",
            },
        },
    },
    "RunStatus": {"type": "string", "enum": list(RunStatus.values)},
    "RunFields": {
        "description": "The fields every view of a run has (`Run`, `RunSummary`).",
        "type": "object",
        "required": ["id", "workflow", "version", "status", "wake_at", "created_at", "finished_at", "rerun_of"],
        "properties": {
            "id": {"type": "string"},
            "workflow": {"type": "string"},
            "version": {"type": "string"},
            "status": ref("RunStatus"),
            "wake_at": nullable(TIMESTAMP),
            "created_at": TIMESTAMP,
            "finished_at": nullable(TIMESTAMP),
            "rerun_of": nullable({"type": "string"}),
        },
    },
    "Run": {
        "allOf": [ref("RunFields")],
        "type": "object",
        "required": ["input", "output", "error"],
        "properties": {
            "input": {"description": "The run's JSON input."},
            "output": {"description": "The run's JSON output (null until it completes)."},
            "error": {"description": "Why the run failed: `type`, `message`, `traceback`; null otherwise."},
        },
    },
    "Step": {
        "type": "object",
        "required": ["key", "kind", "name", "status", "attempt", "queue", "output", "error"],
        "properties": {
            "key": {"type": "string"},
            "kind": {"type": "string"},
            "name": {"type": "string"},
            "status": {"type": "string"},
            "attempt": {"type": "integer"},
            "queue": {"type": "string"},
            "output": {},
            "error": {},
        },
    },
    "RunDetail": {
        "allOf": [ref("Run")],
        "type": "object",
        "required": ["steps"],
        "properties": {"steps": {"type": "array", "items": ref("Step")}},
    },
    "RunSummary": {
        "allOf": [ref("RunFields")],
        "type": "object",
        "required": ["tags", "concurrency_key", "parent_id", "error"],
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}},
            "concurrency_key": nullable({"type": "string"}),
            "parent_id": nullable({"type": "string"}),
            "error": nullable(
                {
                    "type": "object",
                    "required": ["type", "message"],
                    "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                }
            ),
        },
    },
    "RunPage": {
        "type": "object",
        "required": ["runs", "next_cursor"],
        "properties": {
            "runs": {"type": "array", "items": ref("RunSummary")},
            "next_cursor": {
                **nullable({"type": "string"}),
                "description": "Pass as `cursor` for the next page; null on the last page.",
            },
        },
    },
    "StartRequest": {
        "type": "object",
        "required": ["workflow"],
        "properties": {
            "workflow": {"type": "string", "description": "A registered workflow's name."},
            "input": {"description": "The run's JSON input."},
            "run_id": {
                "type": "string",
                "maxLength": RUN_ID_LENGTH,
                "description": "Starting an id that exists returns it.",
            },
        },
    },
    "RerunRequest": {
        "type": "object",
        "properties": {"run_id": {"type": "string", "maxLength": RUN_ID_LENGTH, "description": "The new run's id."}},
    },
    "SignalRequest": {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string"}, "payload": {"description": "Any JSON value."}},
    },
    "SignalSent": {
        "type": "object",
        "required": ["run_id", "signal", "status"],
        "properties": {"run_id": {"type": "string"}, "signal": {"type": "string"}, "status": ref("RunStatus")},
    },
    "EventRequest": {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {
            "name": {
                "type": "string",
                "maxLength": EVENT_NAME_LENGTH,
                "pattern": "^[A-Za-z0-9][A-Za-z0-9_.:/-]*$",
                "description": 'An event name declared in `DURABLE_FLOW["EVENTS"]`.',
            },
            "data": {"type": "object", "description": "The event's JSON object (default `{}`)."},
            "id": {
                "type": "string",
                "maxLength": EVENT_ID_LENGTH,
                "description": "Its idempotency key: an id sent before returns that event and starts nothing again.",
            },
        },
    },
    "Event": {
        "type": "object",
        "required": ["id", "name", "data", "received_at", "pending", "runs"],
        "properties": {
            "id": {"type": "string"},
            "name": {"type": "string"},
            "data": {"type": "object"},
            "received_at": TIMESTAMP,
            "pending": {"type": "boolean", "description": "Its delivery to runs is not finished yet."},
            "runs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["action", "workflow", "run_id"],
                    "properties": {
                        "action": {
                            "type": "string",
                            "enum": ["started", "gated", "refused", "invalid", "resumed", "cancelled"],
                        },
                        "workflow": {"type": "string"},
                        "run_id": {
                            "type": ["string", "null"],
                            "description": "The run; null for a start refused by its quota or as invalid.",
                        },
                    },
                },
            },
        },
    },
    "RunFilter": {
        "type": "object",
        "description": 'Which runs a bulk operation acts on; an empty filter must say `"all": true`.',
        "additionalProperties": False,
        "properties": {
            "status": {"oneOf": [ref("RunStatus"), {"type": "array", "items": ref("RunStatus")}]},
            "workflow": {"type": "string"},
            "queue": {"type": "string"},
            "tag": {"type": "string"},
            "q": {"type": "string", "description": "A run id, an id prefix, or text in the input."},
            "range": {"type": "string", "enum": ["15m", "1h", "24h", "7d"]},
            "since": TIMESTAMP,
            "until": TIMESTAMP,
            "all": {"type": "boolean"},
        },
    },
    "BulkResult": {
        "type": "object",
        "required": ["done", "refused", "batches"],
        "properties": {
            "done": {"type": "integer"},
            "refused": {"type": "array", "description": "The runs left as they were, and why."},
            "batches": {"type": "integer"},
        },
    },
    "QueueChange": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "concurrency": nullable({"type": "integer", "minimum": 1}),
            "rate_limit": {"description": "A window `{limit, period_ms, ...}`, a list of windows, or null."},
            "throttle": {"description": "A throttle, or null to remove it."},
        },
    },
    "Queue": {
        "type": "object",
        "required": ["name", "paused", "config"],
        "properties": {"name": {"type": "string"}, "paused": {"type": "boolean"}, "config": {"type": "object"}},
    },
    "ScheduleOutcome": {"type": "string", "enum": list(ScheduleOutcome.values)},
    "Schedule": {
        "type": "object",
        "required": [
            "workflow",
            "cron",
            "timezone",
            "catch_up",
            "max_catch_up",
            "declared",
            "paused",
            "next_tick_at",
            "last_tick_at",
            "last_run_id",
            "last_outcome",
            "last_refusal",
        ],
        "properties": {
            "workflow": {"type": "string", "description": "The scheduled workflow's name (the schedule's)."},
            "cron": {"type": "string"},
            "timezone": {"type": "string", "description": "The IANA timezone whose wall clock the ticks follow."},
            "catch_up": {
                **nullable({"type": "string", "enum": list(CATCH_UP_POLICIES)}),
                "description": "What a poller does with missed ticks; null for a schedule no longer declared.",
            },
            "max_catch_up": nullable({"type": "integer", "minimum": 1}),
            "declared": {
                "type": "boolean",
                "description": "False when the workflow no longer declares this schedule: no poller starts it.",
            },
            "paused": {"type": "boolean"},
            "next_tick_at": {
                **nullable(TIMESTAMP),
                "description": "The next tick a poller will start; null while paused (resuming sets it).",
            },
            "last_tick_at": {**nullable(TIMESTAMP), "description": "The last tick started or dropped."},
            "last_run_id": {**nullable({"type": "string"}), "description": "The last tick's run."},
            "last_outcome": {**nullable(ref("ScheduleOutcome")), "description": "What the last tick came to."},
            "last_refusal": {
                **nullable(
                    {
                        "type": "object",
                        "required": ["tick_at", "run_id", "outcome"],
                        "properties": {
                            "tick_at": TIMESTAMP,
                            "run_id": {"type": "string", "description": "The run id the tick would have had."},
                            "outcome": {"type": "string", "enum": ["refused", "invalid"]},
                        },
                    }
                ),
                "description": "The last tick whose start was refused: by the start quota, or as invalid.",
            },
        },
    },
    "ScheduleList": {
        "type": "object",
        "required": ["schedules"],
        "properties": {"schedules": {"type": "array", "items": ref("Schedule")}},
    },
}


def error_response(status: int) -> dict[str, Any]:
    description = ERROR_RESPONSES[status][1]
    if status == 429:
        return {
            **answer(description, ref("QuotaRefused")),
            "headers": {
                "Retry-After": {
                    "description": "Seconds until a slot frees, when that is known; left out otherwise.",
                    "schema": {"type": "integer", "minimum": 1},
                }
            },
        }
    response = answer(description, ref("Error"))
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    if status == 405:
        response["headers"] = {"Allow": {"schema": {"type": "string"}}}
    return response


def needs(permission: str) -> str:
    return f"the `durable_flow.{permission}` permission"


def list_parameter(name: str, description: str, schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema, **extra}


LIST_PARAMETERS = [
    list_parameter(
        "status",
        "Runs in these statuses: repeat the parameter, or separate with commas.",
        {"type": "array", "items": ref("RunStatus")},
        style="form",
        explode=True,
    ),
    list_parameter("workflow", "Runs of this workflow.", {"type": "string"}),
    list_parameter("queue", "Runs with a step on this queue.", {"type": "string"}),
    list_parameter("tag", "Runs carrying this tag.", {"type": "string"}),
    list_parameter("created_after", "Runs created at or after this time (ISO 8601).", TIMESTAMP),
    list_parameter("created_before", "Runs created at or before this time (ISO 8601).", TIMESTAMP),
    list_parameter("id_prefix", "Runs whose id starts with this.", {"type": "string", "maxLength": RUN_ID_LENGTH}),
    list_parameter(
        "limit",
        "Runs on the page.",
        {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE, "default": DEFAULT_PAGE_SIZE},
    ),
    list_parameter("cursor", "The `next_cursor` of the page before.", {"type": "string"}),
]


def operation(
    operation_id: str,
    summary: str,
    responses: dict[str, Any],
    *,
    permission: str | None = None,
    body: str | None = None,
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    description = f"Needs staff status and {permission}." if permission else "Needs staff status."
    result: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "description": description,
        "responses": responses,
    }
    if parameters:
        result["parameters"] = parameters
    if body:
        result["requestBody"] = {"required": body != "RerunRequest", "content": {JSON: {"schema": ref(body)}}}
    return result


def steering(name: str, operations: list[str]) -> list[dict[str, Any]]:
    """The path parameters of `/<things>/{name}/{operation}/`: what is steered, and how."""
    return [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}},
        {"name": "operation", "in": "path", "required": True, "schema": {"type": "string", "enum": operations}},
    ]


PATHS: dict[str, Any] = {
    "/runs/": {
        "get": operation(
            "listRuns",
            "List runs, newest first, a page at a time",
            {"200": answer("A page of runs.", ref("RunPage")), **errors(400, 401, 403)},
            parameters=LIST_PARAMETERS,
        ),
        "post": operation(
            "startRun",
            "Start a run",
            {
                "201": answer("The new run.", ref("Run")),
                "200": answer("The run that existed, or the run a debounce or singleton returned.", ref("Run")),
                **errors(400, 401, 403, 404, 413, 429),
            },
            permission=needs("start_workflowrun"),
            body="StartRequest",
        ),
    },
    "/runs/{run_id}/": {
        "parameters": [RUN_ID],
        "get": operation(
            "getRun",
            "A run and its steps",
            {"200": answer("The run.", ref("RunDetail")), **errors(401, 403, 404)},
        ),
    },
    "/runs/{run_id}/cancel/": {
        "parameters": [RUN_ID],
        "post": operation(
            "cancelRun",
            "Cancel a run and its children",
            {"200": answer("The run after cancel.", ref("Run")), **errors(400, 401, 403, 404)},
            permission=needs("cancel_workflowrun"),
        ),
    },
    "/runs/{run_id}/retry/": {
        "parameters": [RUN_ID],
        "post": operation(
            "retryRun",
            "Resume a failed or cancelled run from where it stopped",
            {"200": answer("The run, resumed.", ref("Run")), **errors(400, 401, 403, 404, 429)},
            permission=needs("retry_workflowrun"),
        ),
    },
    "/runs/{run_id}/rerun/": {
        "parameters": [RUN_ID],
        "post": operation(
            "rerunRun",
            "Start a new run with the same workflow and input",
            {"201": answer("The new run.", ref("Run")), **errors(400, 401, 403, 404, 413, 429)},
            permission=needs("start_workflowrun"),
            body="RerunRequest",
        ),
    },
    "/runs/{run_id}/signals/": {
        "parameters": [RUN_ID],
        "post": operation(
            "sendSignal",
            "Send a signal to a run",
            {"202": answer("The signal is delivered or kept.", ref("SignalSent")), **errors(400, 401, 403, 404, 413)},
            permission=needs("signal_workflowrun"),
            body="SignalRequest",
        ),
    },
    "/events/": {
        "post": operation(
            "sendEvent",
            "Send an event: start the workflows it triggers, resume the waits and cancel the runs it matches",
            {
                "201": answer("The event, recorded now, and what it did to runs.", ref("Event")),
                "200": answer("The event its id named, recorded before.", ref("Event")),
                **errors(400, 401, 403, 413),
            },
            permission=needs("add_event"),
            body="EventRequest",
        ),
    },
    "/bulk/{action}/": {
        "parameters": [
            {
                "name": "action",
                "in": "path",
                "required": True,
                "schema": {"type": "string", "enum": ["cancel", "retry"]},
            }
        ],
        "post": operation(
            "bulkOperation",
            "Cancel or retry every run a filter matches",
            {"200": answer("What was done.", ref("BulkResult")), **errors(400, 401, 403, 413)},
            permission=f"{needs('cancel_workflowrun')} to cancel, {needs('retry_workflowrun')} to retry",
            body="RunFilter",
        ),
    },
    "/queues/{name}/{operation}/": {
        "parameters": steering("name", ["pause", "resume", "update"]),
        "post": operation(
            "steerQueue",
            "Pause, resume or resize a queue (`update` takes a body)",
            {"200": answer("The queue as stored.", ref("Queue")), **errors(400, 401, 403, 404, 413)},
            permission=needs("change_flowqueue"),
            body="QueueChange",
        ),
    },
    "/schedules/": {
        "get": operation(
            "listSchedules",
            "Every schedule, with its next and last ticks",
            {"200": answer("The schedules, by workflow name.", ref("ScheduleList")), **errors(401, 403)},
        ),
    },
    "/schedules/{workflow}/{operation}/": {
        "parameters": steering("workflow", ["pause", "resume"]),
        "post": operation(
            "steerSchedule",
            "Pause a schedule, or resume it at its next tick from now (the paused ticks are not caught up)",
            {"200": answer("The schedule as stored.", ref("Schedule")), **errors(400, 401, 403, 404)},
            permission=needs("change_schedule"),
        ),
    },
    "/openapi.json": {
        "get": {
            "operationId": "openapiDocument",
            "summary": "This document",
            "security": [],
            "responses": {"200": answer("The OpenAPI document.", {"type": "object"})},
        }
    },
}

DESCRIPTION = """\
Runs of durable workflows: list and search them, start, inspect, cancel, retry, re-run and
signal them, act on many by filter, steer queues, send events, list, pause and resume schedules.

Authenticate with a personal access token (`Authorization: Bearer dfp_…`, created in the
Django admin, acting as its user with that user's permissions) or a staff session (whose
POSTs need Django's CSRF token). Every error under the API's prefix is JSON:
`{"error": <name>, "message": <text>}`, with `field` on a 400 naming the parameter to blame.
"""


def document(server_url: str = "/api") -> dict[str, Any]:
    """The OpenAPI 3.1 document; `server_url` is the prefix the API is included under."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "durable_flow API", "version": "1", "description": DESCRIPTION},
        "servers": [{"url": server_url}],
        "security": [{"accessToken": []}, {"session": []}],
        "paths": PATHS,
        "components": {
            "schemas": SCHEMAS,
            "responses": {name: error_response(status) for status, (name, _) in ERROR_RESPONSES.items()},
            "securitySchemes": {
                "accessToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A personal access token from the Django admin (Access tokens).",
                },
                "session": {
                    "type": "apiKey",
                    "in": "cookie",
                    "name": "sessionid",
                    "description": "A staff session; a POST needs the CSRF token (`X-CSRFToken`).",
                },
            },
        },
    }


def openapi_view(request: HttpRequest) -> HttpResponse:
    """The document, its server the prefix this API is included under (`/api` for `api/`)."""
    prefix = request.path.removesuffix("openapi.json").rstrip("/")
    return JsonResponse(document(server_url=prefix or "/"))
