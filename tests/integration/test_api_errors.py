"""Every refusal under the API's prefix is JSON with the right status (400, 401, 403, 404, 405,
413, 429 and a failed CSRF check), with or without `DurableFlowErrorMiddleware`, and a 429's
`Retry-After` is there only when the quota knows when a slot frees."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import Client

from durable_flow import workflow
from durable_flow.contrib.http import respond_429, retry_after_s
from durable_flow.exceptions import ConcurrencyLimitError
from durable_flow.models import RunStatus, WorkflowRun
from tests.support.clients import create_user, logged_in, logged_in_client


@workflow("api.held", quota={"key": '"api:held"', "limit": 1})
def held(ctx: Any, input: Any) -> Any:
    """Holds the key's only slot until signalled: when that comes, nothing knows."""
    return ctx.wait_for_signal("go")


@workflow("api.napping", quota={"key": '"api:napping"', "limit": 1, "count_statuses": ["suspended"]})
def napping(ctx: Any, seconds: float) -> str:
    """Holds a slot only while asleep (its quota counts suspended runs): it frees at the wake."""
    ctx.sleep(timedelta(seconds=seconds))
    return "woke"


@pytest.fixture
def client(engine: Any) -> Client:
    return logged_in_client("api", permissions=["start_workflowrun", "cancel_workflowrun"])


def post(client: Client, url: str, body: Any, **extra: Any) -> Any:
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return client.post(url, data=data, content_type="application/json", **extra)


def assert_json_error(response: Any, status: int, error: str) -> dict[str, Any]:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert body["error"] == error and body["message"]
    return body


def test_400_bad_json(client: Client) -> None:
    assert_json_error(post(client, "/api/runs/", "{nope"), 400, "InvalidInput")
    body = assert_json_error(post(client, "/api/runs/", {"input": 1}), 400, "InvalidInput")
    assert body["field"] == "workflow"


def test_401_anonymous(engine: Any) -> None:
    response = Client().get("/api/runs/")
    assert_json_error(response, 401, "NotAuthenticated")
    assert response["WWW-Authenticate"] == 'Bearer realm="durable_flow"'


def test_403_not_staff_and_no_permission(engine: Any, client: Client) -> None:
    plain = logged_in(create_user("plain", staff=False))
    assert_json_error(plain.get("/api/runs/"), 403, "PermissionDenied")
    assert_json_error(post(client, "/api/bulk/retry/", {"all": True}), 403, "PermissionDenied")


def test_403_csrf_failure_is_json_not_djangos_page(engine: Any) -> None:
    client = logged_in(create_user("ops", permissions=["start_workflowrun"]), csrf=True)
    body = assert_json_error(post(client, "/api/runs/", {"workflow": "tests.three_steps"}), 403, "CsrfFailed")
    assert "CSRF" in body["message"]
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize("url", ["/api/runs/nope/", "/api/no-such-route/", "/api/runs", "/api/queues/x/explode/"])
def test_404_unknown_run_or_route(client: Client, url: str) -> None:
    response = client.get(url)
    assert response.status_code == 404 and response["Content-Type"] == "application/json"


def test_404_for_a_missing_slash_names_the_route(client: Client) -> None:
    body = assert_json_error(client.get("/api/runs"), 404, "NotFound")
    assert "did you mean '/api/runs/'" in body["message"]
    assert "did you mean" not in client.get("/api/nope").json()["message"]


def test_404_unknown_run_on_a_post(client: Client) -> None:
    assert_json_error(client.post("/api/runs/nope/cancel/"), 404, "RunNotFound")


@pytest.mark.parametrize(
    ("method", "url", "allow"),
    [
        ("get", "/api/runs/r/cancel/", "POST"),
        ("delete", "/api/runs/", "GET, POST"),
        ("put", "/api/runs/r/", "GET"),
        ("post", "/api/openapi.json", "GET"),
    ],
)
def test_405_names_the_allowed_methods(client: Client, method: str, url: str, allow: str) -> None:
    response = getattr(client, method)(url)
    assert_json_error(response, 405, "MethodNotAllowed")
    assert response["Allow"] == allow


def test_413_a_body_over_the_limit_is_not_read(client: Client) -> None:
    body = json.dumps({"workflow": "tests.three_steps", "input": "x" * 2_100_000})
    assert_json_error(post(client, "/api/runs/", body), 413, "PayloadTooLarge")
    assert not WorkflowRun.objects.exists()


def test_413_over_djangos_own_upload_limit(client: Client, settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1_000
    body = json.dumps({"workflow": "tests.three_steps", "input": "x" * 2_000})
    assert_json_error(post(client, "/api/runs/", body), 413, "PayloadTooLarge")


def test_429_without_retry_after_when_the_holder_has_no_known_end(client: Client) -> None:
    assert post(client, "/api/runs/", {"workflow": "api.held", "run_id": "holder"}).status_code == 201
    response = post(client, "/api/runs/", {"workflow": "api.held"})
    body = assert_json_error(response, 429, "ConcurrencyLimitError")
    assert "Retry-After" not in response  # not a guess
    assert (body["key"], body["limit"], body["active"], body["retry_at"]) == ("api:held", 1, 1, None)
    assert WorkflowRun.objects.count() == 1


def test_429_retry_after_is_when_the_sleeping_holder_wakes(client: Client) -> None:
    assert post(client, "/api/runs/", {"workflow": "api.napping", "input": 600, "run_id": "n1"}).status_code == 201
    holder = WorkflowRun.objects.get(pk="n1")
    assert holder.status == RunStatus.SUSPENDED and holder.wake_at is not None
    response = post(client, "/api/runs/", {"workflow": "api.napping", "input": 600})
    body = assert_json_error(response, 429, "ConcurrencyLimitError")
    assert datetime.fromisoformat(body["retry_at"]) == holder.wake_at
    assert 500 < int(response["Retry-After"]) <= 600  # the wake is 600 s after the engine's clock's start


def test_429_for_a_quota_of_zero_has_no_retry_after(engine: Any) -> None:
    response = respond_429(ConcurrencyLimitError("plan:free", 0, 0, "chat.turn"))
    assert response.status_code == 429 and "Retry-After" not in response


def test_retry_after_rounds_up_and_is_at_least_one_second() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0)
    assert retry_after_s(now + timedelta(seconds=20.1), now) == 21
    assert retry_after_s(now + timedelta(seconds=20), now) == 20
    assert retry_after_s(now - timedelta(seconds=3), now) == 1  # the wake is due: the poller is about to make it


def test_the_api_answers_json_without_the_error_middleware(client: Client, settings: Any) -> None:
    settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if not m.endswith("DurableFlowErrorMiddleware")]
    assert_json_error(client.get("/api/runs/nope/"), 404, "RunNotFound")
    assert_json_error(post(client, "/api/runs/", {"workflow": "no.such"}), 404, "WorkflowNotFound")
    post(client, "/api/runs/", {"workflow": "api.held"})
    assert_json_error(post(client, "/api/runs/", {"workflow": "api.held"}), 429, "ConcurrencyLimitError")


def test_the_project_keeps_its_csrf_middleware(engine: Any) -> None:
    """The API checks CSRF itself; the project's middleware still guards every other page."""
    assert "django.middleware.csrf.CsrfViewMiddleware" in settings.MIDDLEWARE
    client = logged_in(create_user("root", superuser=True), csrf=True)
    response = client.post("/admin/durable_flow/accesstoken/add/", {"name": "x"})
    assert response.status_code == 403 and "text/html" in response["Content-Type"]
