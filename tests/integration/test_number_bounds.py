"""Every number a workflow, a step, a request or a setting gives has finite sane bounds: NaN,
infinities, booleans and absurd sizes are refused with a typed error that names the argument,
before they can overflow a date or a column deep in the engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.core.checks import run_checks
from django.test import Client, override_settings
from django.urls import reverse

from durable_flow import RegistrationError, step, workflow
from durable_flow.config.validation import MAX_DURATION
from durable_flow.contrib.tasks import debounce
from durable_flow.definitions.registry import exponential_backoff
from durable_flow.engine import Engine
from durable_flow.models import FlowQueue, RunStatus, WorkflowRun
from durable_flow.operations import api
from tests.engine_support import transport_of
from tests.support.clients import logged_in_client
from tests.workflows import add_one

TOO_LONG = MAX_DURATION + timedelta(days=1)


# -- declarations ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"debounce": {"key": "input.a", "period": timedelta.max}}, "period"),
        ({"debounce": {"key": "input.a", "period": TOO_LONG}}, "period"),
        ({"debounce": {"key": "input.a", "period": timedelta(seconds=1), "max_wait": timedelta.max}}, "max_wait"),
        ({"concurrency": 2**31}, "limit"),
        ({"concurrency": {"limit": 10**30, "key": "input.a"}}, "limit"),
        ({"version": True}, "version"),
        ({"version": float("nan")}, "version"),
        ({"version": ""}, "version"),
        ({"version": "v" * 51}, "version"),
    ],
)
def test_a_workflow_declared_with_an_absurd_number_fails_registration_naming_it(
    options: dict[str, Any], field: str
) -> None:
    with pytest.raises(RegistrationError, match=r"workflow 'bounds\.bad'") as caught:
        workflow("bounds.bad", **options)
    assert field in str(caught.value)


def test_a_task_debounced_for_longer_than_ten_years_fails_at_import() -> None:
    with pytest.raises(RegistrationError, match="period must be a positive timedelta of at most 3650 days"):
        debounce(key="input.a", period=timedelta.max)(lambda: None)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"retries": 2**31}, "retries"),
        ({"retries": True}, "retries"),
        ({"retries": 2.0}, "retries"),
        ({"backoff": 5}, "backoff"),
        ({"backoff": timedelta.max}, "backoff"),
        ({"backoff": timedelta(seconds=-1)}, "backoff"),
        ({"max_backoff": TOO_LONG}, "max_backoff"),
        ({"timeout": timedelta.max}, "timeout"),
        ({"timeout": 30}, "timeout"),
    ],
)
def test_a_step_declared_with_an_absurd_number_fails_registration_naming_it(
    options: dict[str, Any], field: str
) -> None:
    with pytest.raises(RegistrationError, match=r"step 'bounds\.bad_step'") as caught:
        step("bounds.bad_step", **options)
    assert f" {field} must be" in str(caught.value)


def test_the_backoff_of_a_late_attempt_is_capped_not_an_overflow() -> None:
    assert exponential_backoff(100) == timedelta(minutes=5)
    assert exponential_backoff(10**6, timedelta(days=1), timedelta(days=3650)) == timedelta(days=3650)


# -- per-call numbers inside a workflow -----------------------------------------------------------
BAD_CALLS: dict[str, Callable[[Any], Any]] = {
    "sleep_forever": lambda ctx: ctx.sleep(timedelta.max),
    "sleep_eleven_years": lambda ctx: ctx.sleep(TOO_LONG),
    "sleep_until_year_9999": lambda ctx: ctx.sleep_until(
        datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))
    ),
    "signal_timeout_forever": lambda ctx: ctx.wait_for_signal("go", timeout=timedelta.max),
    "step_timeout_forever": lambda ctx: ctx.step(add_one, 1, timeout=timedelta.max),
    "step_priority_bool": lambda ctx: ctx.step(add_one, 1, priority=True),
    "step_priority_nan": lambda ctx: ctx.step(add_one, 1, priority=float("nan")),
    "step_retries_huge": lambda ctx: ctx.step(add_one, 1, retries=2**31),
    "fan_concurrency_huge": lambda ctx: ctx.all(add_one, [1, 2], concurrency=2**31),
    "fan_retries_inf": lambda ctx: ctx.all(add_one, [1, 2], retries=float("inf")),
}
NAMED = {
    "sleep_forever": "ctx.sleep: duration",
    "sleep_eleven_years": "ctx.sleep: duration",
    "sleep_until_year_9999": "ctx.sleep_until: when",
    "signal_timeout_forever": "ctx.wait_for_signal: timeout",
    "step_timeout_forever": "timeout",
    "step_priority_bool": "priority",
    "step_priority_nan": "priority",
    "step_retries_huge": "retries",
    "fan_concurrency_huge": "ctx.all: concurrency",
    "fan_retries_inf": "retries",
}


@workflow("bounds.bad_call")
def bad_call(ctx: Any, name: str) -> Any:
    return BAD_CALLS[name](ctx)


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_an_absurd_number_in_a_ctx_call_fails_the_run_with_invalid_input_naming_it(manual: Engine, name: str) -> None:
    run = api.start("bounds.bad_call", name)
    transport_of(manual).run_turns()
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == "durable_flow.exceptions.InvalidInput"
    assert run.error["message"].startswith(f"{NAMED[name]} must be")


def test_a_sleep_of_zero_or_less_still_returns_at_once(manual: Engine) -> None:
    BAD_CALLS["sleep_back"] = lambda ctx: ctx.sleep(timedelta(seconds=-5)) or "woke"
    try:
        run = api.start("bounds.bad_call", "sleep_back")
        transport_of(manual).run_turns()
    finally:
        del BAD_CALLS["sleep_back"]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == "woke"


# -- the JSON API ---------------------------------------------------------------------------------
@pytest.fixture
def client(engine: Any) -> Client:
    return logged_in_client("api", permissions=["start_workflowrun", "signal_workflowrun", "change_flowqueue"])


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/api/runs/", '{"workflow": "tests.three_steps", "input": %s}'),
        ("/api/queues/sized/update/", '{"concurrency": %s}'),
        ("/api/runs/{run}/signals/", '{"name": "go", "payload": {"n": %s}}'),
    ],
)
def test_a_request_body_with_nan_or_infinity_is_refused_as_not_json(
    client: Client, url: str, body: str, constant: str
) -> None:
    api.register_queue("sized", concurrency=2)
    run = api.start("tests.signal_waiter", None)
    response = client.post(url.format(run=run.id), data=body % constant, content_type="application/json")
    assert response.status_code == 400
    assert response.json() == {
        "error": "InvalidInput",
        "message": f"request body is not JSON: {constant} is not a JSON number",
    }
    assert FlowQueue.objects.get(pk="sized").config["concurrency"] == 2
    assert WorkflowRun.objects.count() == 1


def test_a_huge_number_in_a_request_body_answers_400_and_changes_nothing(client: Client) -> None:
    api.register_queue("sized", concurrency=2)
    body = json.dumps({"concurrency": 10**30})
    response = client.post("/api/queues/sized/update/", data=body, content_type="application/json")
    assert response.status_code == 400 and "concurrency" in response.json()["message"]
    assert FlowQueue.objects.get(pk="sized").config["concurrency"] == 2


# -- the dashboard --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("burst", "field"),
    [
        ({"SIZE": float("inf")}, "SIZE"),
        ({"SIZE": float("nan")}, "SIZE"),
        ({"SIZE": True}, "SIZE"),
        ({"SIZE": 10**9}, "SIZE"),
        ({"SIZE": "20"}, "SIZE"),
        ({"INPUT": ["a"]}, "INPUT"),
        ({"WORKFLOW": 7}, "WORKFLOW"),
        ({"QUEUE": ""}, "QUEUE"),
        ({"SIZES": 3}, "SIZES"),
        ("examples.sync_tenant", "DASHBOARD_BURST"),
    ],
)
def test_a_bad_dashboard_burst_setting_fails_the_checks_with_an_id_and_a_hint(burst: Any, field: str) -> None:
    with override_settings(DASHBOARD_BURST=burst):
        errors = [e for e in run_checks() if e.id == "durable_flow_dashboard.E005"]
    assert len(errors) == 1 and field in errors[0].msg and errors[0].hint


def test_the_default_and_the_test_dashboard_burst_pass_the_checks() -> None:
    assert not [e for e in run_checks() if e.id.startswith("dashboard.")]


def test_a_bad_dashboard_burst_setting_answers_the_burst_button_with_a_4xx(admin_client: Client, engine: Any) -> None:
    with override_settings(DASHBOARD_BURST={"SIZE": float("inf")}):
        response = admin_client.post("/dashboard/flow/burst/", {}, HTTP_ACCEPT="application/json")
    assert response.status_code == 400 and "DASHBOARD_BURST" in response.json()["message"]
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize("period", ["1e999999", "1e30", "Infinity", "NaN"])
def test_an_absurd_resize_period_is_a_message_not_an_error(admin_client: Client, engine: Any, period: str) -> None:
    api.register_queue("steer", concurrency=2)
    url = reverse("dashboard:queue-resize", args=["steer"])
    response = admin_client.post(url, {"concurrency": "3", "rate_limit": "5", "rate_period_s": period})
    assert response.status_code == 303
    page = admin_client.get(response["Location"]).content.decode()
    assert "Not resized" in page and "rate period s must be" in page
    assert FlowQueue.objects.get(pk="steer").config["concurrency"] == 2


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_start_form_with_nan_or_infinity_in_its_json_is_a_form_error(
    admin_client: Client, engine: Any, constant: str
) -> None:
    form = {"workflow": "tests.three_steps", "input": f'{{"n": {constant}}}', "run_id": "nan-form"}
    response = admin_client.post("/dashboard/runs/start/", form)
    assert response.status_code == 400
    assert f"{constant} is not a JSON number" in response.content.decode()
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize("constant", ["NaN", "Infinity"])
def test_a_signal_form_with_nan_or_infinity_in_its_payload_is_refused_with_the_reason(
    admin_client: Client, engine: Any, constant: str
) -> None:
    run = api.start("tests.signal_waiter", None)
    form = {"name": "approve", "payload": f"[{constant}]"}
    response = admin_client.post(f"/dashboard/runs/{run.id}/signal/", form, follow=True)
    assert response.status_code == 400 and f"{constant} is not a JSON number" in response.content.decode()
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.SUSPENDED


def test_a_sleep_until_a_year_from_now_suspends_the_run_until_then(manual: Engine) -> None:
    BAD_CALLS["next_year"] = lambda ctx: ctx.sleep_until(ctx.now + timedelta(days=365))
    try:
        run = api.start("bounds.bad_call", "next_year")
        transport_of(manual).run_turns()
    finally:
        del BAD_CALLS["next_year"]
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED and run.wake_at == manual.now() + timedelta(days=365)
