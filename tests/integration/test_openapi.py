"""The API's OpenAPI document: a valid OpenAPI 3.1 document, served, naming exactly the routes
and methods `durable_flow.urls` serves, and describing what they really answer."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import URLPattern
from django.utils import timezone
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from durable_flow import urls
from durable_flow.contrib.api_access import Endpoint
from durable_flow.contrib.openapi import document
from durable_flow.models import AccessToken, FlowQueue, Schedule
from tests.support.clients import create_user, logged_in

pytestmark = pytest.mark.inline_only("about the API's document; the engine pair does not change it")

DOCUMENT = document()


def test_the_document_is_valid_openapi_3_1() -> None:
    validate(DOCUMENT)  # raises on any error
    assert DOCUMENT["openapi"].startswith("3.1.")


def test_run_and_run_summary_declare_the_fields_they_share_once() -> None:
    """Both views of a run take their common fields from `RunFields` (`allOf`), so the two
    cannot drift apart; each declares only what is its own."""
    schemas = DOCUMENT["components"]["schemas"]
    run, summary = schemas["Run"], schemas["RunSummary"]
    repeated = {name for name, schema in run["properties"].items() if summary["properties"].get(name) == schema}
    assert repeated == set()
    for schema in (run, summary):
        assert schema["allOf"] == [{"$ref": "#/components/schemas/RunFields"}]
    # The shared fields are still required of each: a summary without one is refused.
    body = {
        "id": "r1",
        "workflow": "wf",
        "version": "1",
        "status": "completed",
        "tags": [],
        "concurrency_key": None,
        "parent_id": None,
        "rerun_of": None,
        "error": None,
        "wake_at": None,
        "created_at": "2026-01-01T00:00:00Z",
        "finished_at": None,
    }
    validator = Draft202012Validator({**DOCUMENT, "$ref": "#/components/schemas/RunSummary"})
    assert list(validator.iter_errors(body)) == []
    assert [error.message for error in validator.iter_errors({**body, "status": "nope"})] != []
    del body["created_at"]
    assert [error.message for error in validator.iter_errors(body)] == ["'created_at' is a required property"]


def test_the_document_is_served_under_the_apis_prefix_without_login(engine: Any) -> None:
    response = Client().get("/api/openapi.json")
    assert response.status_code == 200
    assert response.json() == json.loads(json.dumps(document(server_url="/api")))


def route_template(pattern: URLPattern) -> str:
    """`runs/<path:run_id>/cancel/` or `^bulk/(?P<action>cancel|retry)/$` as an OpenAPI path."""
    text = str(pattern.pattern)
    text = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", text)  # re_path() named groups
    text = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", text)  # path() converters
    return "/" + text.removeprefix("^").removesuffix("$")


def test_every_route_and_method_is_in_the_document_and_nothing_else() -> None:
    served = {
        route_template(pattern): {method.lower() for method in pattern.callback.methods}
        for pattern in urls.urlpatterns
        if isinstance(pattern.callback, Endpoint)
    }
    unrouted = [pattern.name for pattern in urls.urlpatterns if not isinstance(pattern.callback, Endpoint)]
    assert unrouted == ["not_found"]  # the catch-all JSON 404 is the only other pattern
    documented = {
        path: {key for key in item if key in {"get", "post", "put", "patch", "delete"}}
        for path, item in DOCUMENT["paths"].items()
    }
    assert served == documented


def test_path_parameters_with_a_fixed_set_of_values_match_the_routes() -> None:
    for pattern in urls.urlpatterns:
        for name, choices in re.findall(r"\(\?P<(\w+)>([\w|]+)\)", str(pattern.pattern)):
            parameters = DOCUMENT["paths"][route_template(pattern)]["parameters"]
            schema = next(p["schema"] for p in parameters if p["name"] == name)
            assert schema["enum"] == choices.split("|")


def check(path: str, method: str, response: Any) -> dict[str, Any]:
    """Validate a real answer against the document: its status is one the operation lists, and
    its JSON body (and `Retry-After`, on a 429) fits that answer's schema."""
    answers = DOCUMENT["paths"][path][method]["responses"]
    status = str(response.status_code)
    assert status in answers, f"{method.upper()} {path} answered {status}, not in {sorted(answers)}"
    answer = answers[status]
    if "$ref" in answer:
        answer = DOCUMENT["components"]["responses"][answer["$ref"].rsplit("/", 1)[-1]]
    schema = answer["content"]["application/json"]["schema"]
    body = response.json()
    validator = Draft202012Validator({**DOCUMENT, **schema}, format_checker=Draft202012Validator.FORMAT_CHECKER)
    errors = [f"{list(error.absolute_path)}: {error.message}" for error in validator.iter_errors(body)]
    assert errors == [], errors
    for header in answer.get("headers", {}):
        if header != "Retry-After":  # optional by design: left out when unknown
            assert header in response, f"{header} missing"
    return body


def test_real_answers_fit_the_documents_schemas(engine: Any, declare: Any) -> None:
    declare("tests.on_ping", lambda ctx, event: event["data"], trigger="tests/http.ping")
    user = create_user(
        "api",
        permissions=["start_workflowrun", "cancel_workflowrun", "retry_workflowrun", "signal_workflowrun"],
    )
    user.user_permissions.add(Permission.objects.get(codename="change_flowqueue"))
    user.user_permissions.add(Permission.objects.get(codename="add_event"))
    user.user_permissions.add(Permission.objects.get(codename="change_schedule"))
    token_row = AccessToken(user=user, name="openapi test")
    token = token_row.set_new_token()
    token_row.save()
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def post(url: str, body: Any = None) -> Any:
        return client.post(url, data=json.dumps(body or {}), content_type="application/json")

    check("/runs/", "post", post("/api/runs/", {"workflow": "tests.sleeper", "input": 600, "run_id": "s1"}))
    check("/runs/", "post", post("/api/runs/", {"workflow": "tests.sleeper", "input": 600, "run_id": "s1"}))  # 200
    check("/runs/", "post", post("/api/runs/", {"workflow": "tests.three_steps", "input": 1, "run_id": "t1"}))
    check("/runs/", "post", post("/api/runs/", {"workflow": "tests.fails", "input": 1, "run_id": "f1"}))
    page = check("/runs/", "get", client.get("/api/runs/", {"limit": 2}))
    assert page["next_cursor"] is not None
    check("/runs/", "get", client.get("/api/runs/", {"cursor": page["next_cursor"]}))
    check("/runs/{run_id}/", "get", client.get("/api/runs/t1/"))
    check("/runs/{run_id}/signals/", "post", post("/api/runs/s1/signals/", {"name": "go", "payload": 1}))
    check("/runs/{run_id}/cancel/", "post", post("/api/runs/s1/cancel/"))
    check("/runs/{run_id}/retry/", "post", post("/api/runs/f1/retry/"))
    check("/runs/{run_id}/rerun/", "post", post("/api/runs/t1/rerun/", {"run_id": "t2"}))
    check("/bulk/{action}/", "post", post("/api/bulk/cancel/", {"workflow": "tests.sleeper"}))
    FlowQueue.objects.create(name="emails", config={"name": "emails", "concurrency": 2})
    check("/queues/{name}/{operation}/", "post", post("/api/queues/emails/pause/"))
    ping = {"name": "tests/http.ping", "data": {"n": 1}, "id": "ping-1"}
    assert check("/events/", "post", post("/api/events/", ping))["runs"][0]["action"] == "started"  # 201
    check("/events/", "post", post("/api/events/", ping))  # 200
    check("/events/", "post", post("/api/events/", {"name": "tests/never.declared"}))  # 400
    Schedule.objects.create(workflow="nightly", cron="0 3 * * *", timezone="UTC", next_tick_at=timezone.now())
    check("/schedules/{workflow}/{operation}/", "post", post("/api/schedules/nightly/pause/"))
    check("/schedules/", "get", client.get("/api/schedules/"))
    check("/schedules/{workflow}/{operation}/", "post", post("/api/schedules/nightly/resume/"))
    check("/schedules/{workflow}/{operation}/", "post", post("/api/schedules/nope/resume/"))  # 404
    # The errors, each against its shared answer.
    check("/runs/", "get", client.get("/api/runs/", {"limit": "0"}))  # 400
    check("/runs/", "get", Client().get("/api/runs/"))  # 401
    check("/runs/", "get", logged_in(create_user("plain", staff=False)).get("/api/runs/"))  # 403
    check("/runs/{run_id}/", "get", client.get("/api/runs/nope/"))  # 404
    check("/runs/", "post", post("/api/runs/", {"workflow": "tests.three_steps", "input": "x" * 2_100_000}))  # 413
    quota = {"workflow": "tests.quota_sleeper", "input": {"tenant": "acme", "seconds": 600}}
    check("/runs/", "post", post("/api/runs/", quota))
    refused = post("/api/runs/", quota)
    assert check("/runs/", "post", refused)["error"] == "ConcurrencyLimitError"  # 429


def test_every_error_answer_is_an_error_object(engine: Any) -> None:
    """405 and an unknown route are answered on every path: their bodies fit `Error` too."""
    client = logged_in(create_user("api"))
    schema = {**DOCUMENT, "$ref": "#/components/schemas/Error"}
    for response in (client.delete("/api/runs/"), client.get("/api/nope/")):
        assert response.status_code in (404, 405)
        assert list(Draft202012Validator(schema).iter_errors(response.json())) == []
