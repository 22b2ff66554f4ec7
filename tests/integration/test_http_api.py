"""The JSON API: staff only, CSRF-checked, and bad input answers 4xx (never 500)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from durable_flow.contrib.http import error_response
from durable_flow.exceptions import ConcurrencyLimitError
from durable_flow.models import RunStatus, WorkflowRun
from tests.support.clients import logged_in_client


@pytest.fixture
def client(engine: Any) -> Client:
    return logged_in_client("api", permissions=["start_workflowrun", "cancel_workflowrun", "signal_workflowrun"])


def post(client: Client, url: str, body: Any) -> Any:
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return client.post(url, data=data, content_type="application/json")


def test_start_then_inspect_then_cancel(client: Client) -> None:
    created = post(client, "/api/runs/", {"workflow": "tests.sleeper", "input": 600, "run_id": "api-1"})
    assert created.status_code == 201 and created.json()["id"] == "api-1"
    again = post(client, "/api/runs/", {"workflow": "tests.sleeper", "input": 1, "run_id": "api-1"})
    assert again.status_code == 200 and again.json()["input"] == 600
    detail = client.get("/api/runs/api-1/").json()
    assert detail["status"] == RunStatus.SUSPENDED and detail["steps"][0]["kind"] == "sleep"
    cancelled = client.post("/api/runs/api-1/cancel/")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == RunStatus.CANCELLED


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"workflow": "no.such.workflow"}, 404, "WorkflowNotFound"),
        ("{not json", 400, "InvalidInput"),
        ("[1, 2]", 400, "InvalidInput"),
        ({"input": 1}, 400, "InvalidInput"),
        ({"workflow": "tests.three_steps", "run_id": 7}, 400, "InvalidInput"),
        ({"workflow": "tests.three_steps", "input": "x" * 1_100_000}, 400, "InvalidInput"),
    ],
)
def test_bad_input_answers_4xx_with_a_typed_error(client: Client, body: Any, status: int, error: str) -> None:
    response = post(client, "/api/runs/", body)
    assert response.status_code == status
    assert response.json()["error"] == error
    assert not WorkflowRun.objects.exists()


def test_unknown_run_is_404(client: Client) -> None:
    assert client.get("/api/runs/nope/").status_code == 404
    assert client.post("/api/runs/nope/cancel/").status_code == 404


def test_anonymous_and_non_staff_are_refused(engine: Any) -> None:
    assert post(Client(), "/api/runs/", {"workflow": "tests.three_steps"}).status_code == 401
    user = get_user_model().objects.create_user("plain", password="pw")
    plain = Client()
    plain.force_login(user)
    assert post(plain, "/api/runs/", {"workflow": "tests.three_steps"}).status_code == 403
    assert not WorkflowRun.objects.exists()


def test_posts_need_a_csrf_token(engine: Any) -> None:
    user = get_user_model().objects.create_user("csrf", password="pw", is_staff=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    refused = post(client, "/api/runs/", {"workflow": "tests.three_steps"})
    assert refused.status_code == 403 and refused.json()["error"] == "CsrfFailed"
    assert not WorkflowRun.objects.exists()


def test_a_quota_refusal_maps_to_429_with_retry_after_only_when_known() -> None:
    unknown = error_response(ConcurrencyLimitError(key="tenant:1", limit=8, active=8, workflow="chat.turn"))
    assert unknown.status_code == 429 and "Retry-After" not in unknown
    assert json.loads(unknown.content)["limit"] == 8
    frees_at = timezone.now() + timedelta(seconds=90)
    known = error_response(ConcurrencyLimitError("tenant:1", 8, 8, "chat.turn", retry_at=frees_at))
    assert 85 <= int(known["Retry-After"]) <= 90
    assert json.loads(known.content)["retry_at"] == frees_at.isoformat()


def test_bulk_cancel_by_a_json_filter_cancels_the_matching_runs_only(client: Client) -> None:
    for n in range(3):
        post(client, "/api/runs/", {"workflow": "tests.sleeper", "input": 600, "run_id": f"sleep-{n}"})
    post(client, "/api/runs/", {"workflow": "tests.three_steps", "input": 1, "run_id": "other"})
    response = post(client, "/api/bulk/cancel/", {"workflow": "tests.sleeper", "status": ["suspended"]})
    assert response.status_code == 200
    assert response.json() == {"done": 3, "refused": [], "batches": 1}
    statuses = dict(WorkflowRun.objects.values_list("id", "status"))
    assert {statuses[f"sleep-{n}"] for n in range(3)} == {RunStatus.CANCELLED}
    assert statuses["other"] != RunStatus.CANCELLED
    again = post(client, "/api/bulk/cancel/", {"workflow": "tests.sleeper"})
    assert again.json()["done"] == 0  # already terminal: nothing to cancel


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, '"all": true'),
        ({"stauts": "failed"}, "unknown filter 'stauts'"),
        ({"status": "exploded"}, 'filter "status"'),
        ({"status": [1]}, "a string or a list of strings"),
        ({"workflow": {"$ne": 1}}, 'filter "workflow" must be a string'),
        ({"since": "yesterday"}, 'filter "since"'),
        ({"all": "yes"}, '"all" must be true or false'),
        ("[1]", "JSON object"),
    ],
)
def test_bulk_filters_that_are_wrong_are_a_400_naming_the_filter(client: Client, body: Any, fragment: str) -> None:
    post(client, "/api/runs/", {"workflow": "tests.sleeper", "input": 600, "run_id": "kept"})
    response = post(client, "/api/bulk/cancel/", body)
    assert response.status_code == 400 and response.json()["error"] == "InvalidInput"
    assert fragment in response.json()["message"]
    assert WorkflowRun.objects.get(pk="kept").status == RunStatus.SUSPENDED


def test_bulk_all_needs_the_operations_permission(client: Client) -> None:
    post(client, "/api/runs/", {"workflow": "tests.sleeper", "input": 600, "run_id": "kept"})
    assert post(client, "/api/bulk/retry/", {"all": True}).status_code == 403  # no retry permission
    assert client.get("/api/bulk/cancel/").status_code == 405
    assert post(client, "/api/bulk/cancel/", {"all": True}).json()["done"] == 1
    assert WorkflowRun.objects.get(pk="kept").status == RunStatus.CANCELLED


# -- events ------------------------------------------------------------------------------------
def on_ping(ctx: Any, event: dict[str, Any]) -> Any:
    """Started by each `tests/http.ping` event: its data back."""
    return event["data"]


@pytest.fixture
def event_client(engine: Any, declare: Any) -> Client:
    declare("tests.on_ping", on_ping, trigger="tests/http.ping")
    return logged_in_client("events", permissions=["add_event"])


def test_an_event_posted_starts_its_triggered_run_and_answers_it(event_client: Client) -> None:
    sent = post(event_client, "/api/events/", {"name": "tests/http.ping", "data": {"n": 1}, "id": "p-1"})
    assert sent.status_code == 201
    body = sent.json()
    assert (body["id"], body["name"], body["data"], body["pending"]) == ("p-1", "tests/http.ping", {"n": 1}, False)
    assert body["runs"] == [{"action": "started", "workflow": "tests.on_ping", "run_id": "tests.on_ping@event:p-1"}]
    assert WorkflowRun.objects.get(pk="tests.on_ping@event:p-1").output == {"n": 1}
    again = post(event_client, "/api/events/", {"name": "tests/http.ping", "data": {"n": 2}, "id": "p-1"})
    assert again.status_code == 200 and again.json()["data"] == {"n": 1}
    assert WorkflowRun.objects.filter(workflow="tests.on_ping").count() == 1


@pytest.mark.parametrize(
    ("body", "error", "says"),
    [
        ({"name": "tests/never.declared"}, "UnknownEvent", "not declared"),
        ({"name": "bad name"}, "InvalidEvent", "letters, digits"),
        ({}, "InvalidEvent", "non-empty string"),
        ({"name": "tests/http.ping", "data": [1]}, "InvalidEvent", "JSON object"),
        ({"name": "tests/http.ping", "id": 3}, "InvalidEvent", "event id must be a string"),
        ({"name": "tests/http.ping", "payload": {}}, "InvalidInput", "unknown field(s): payload"),
        ("[1]", "InvalidInput", "JSON object"),
    ],
)
def test_a_bad_event_answers_400_and_records_nothing(event_client: Client, body: Any, error: str, says: str) -> None:
    from durable_flow.models import Event

    before = Event.objects.count()
    response = post(event_client, "/api/events/", body)
    assert response.status_code == 400
    assert response.json()["error"] == error and says in response.json()["message"]
    assert Event.objects.count() == before


def test_sending_an_event_needs_the_add_event_permission(engine: Any) -> None:
    from durable_flow.models import Event

    before = Event.objects.count()
    client = logged_in_client("no-events", permissions=["start_workflowrun"])
    refused = post(client, "/api/events/", {"name": "tests/http.ping"})
    assert refused.status_code == 403 and "durable_flow.add_event" in refused.json()["message"]
    assert post(Client(), "/api/events/", {"name": "tests/http.ping"}).status_code == 401
    assert Event.objects.count() == before
