"""Bad input from issue 12's list: each gets a typed error or a 4xx, and existing runs are untouched."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from durable_flow.exceptions import DurableFlowError, InvalidInput, InvalidQueueConfig
from durable_flow.models import WorkflowRun
from durable_flow.operations import api
from tests.support.clients import logged_in_client

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "9" * 5_000


@pytest.fixture
def existing(engine: Any) -> WorkflowRun:
    return api.start("tests.sleeper", 600, run_id="keep-me")


@pytest.fixture
def client(existing: WorkflowRun) -> Client:
    return logged_in_client("bad", superuser=True)


def snapshot() -> list[tuple[Any, ...]]:
    return list(WorkflowRun.objects.order_by("id").values_list("id", "status", "input", "turns"))


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        ("post", "/api/runs/", '{"workflow": "tests.sleeper", "input": ' + HUGE_INT + "}"),
        ("post", "/api/runs/", '{"workflow": "tests.sleeper", "input": ' + DEEP + "}"),
        ("post", "/api/runs/", json.dumps({"workflow": "tests.sleeper", "input": "\ud800"})),
        ("post", "/api/runs/", json.dumps({"workflow": "tests.sleeper", "run_id": "a\x00b"})),
        ("post", "/api/runs/", json.dumps({"workflow": "tests.sleeper", "run_id": "\ud800"})),
        ("post", "/api/runs/", json.dumps({"workflow": "no\x00such"})),
        ("get", "/api/runs/a%00b/", None),
        ("post", "/api/runs/a%00b/cancel/", None),
        ("get", "/admin/durable_flow/workflowrun/?created_at__year=99999999999999999999", None),
        ("get", "/admin/durable_flow/workflowrun/?input__contains=x", None),
        ("get", "/admin/durable_flow/workflowrun/?q=%27%3B+DROP+TABLE+x%3B--", None),
    ],
)
def test_bad_http_input_is_a_4xx_and_loses_nothing(client: Client, method: str, url: str, body: str | None) -> None:
    before = snapshot()
    if method == "post":
        response = client.post(url, data=body or "", content_type="application/json")
    else:
        response = client.get(url)
    assert 400 <= response.status_code < 500 or (url.startswith("/admin/") and response.status_code in (200, 302))
    assert snapshot() == before


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: api.start("tests.sleeper", 1, run_id="a\x00b"), InvalidInput),
        (lambda: api.start("tests.sleeper", 1, tags=["ok", "t\x00"]), InvalidInput),
        (lambda: api.start("tests.sleeper", 1, tags="not-a-list"), InvalidInput),
        (lambda: api.start("tests.sleeper", nested(100_000)), InvalidInput),
        (lambda: api.start("tests.sleeper", {"k": "\ud800"}), InvalidInput),
        (lambda: api.send_signal("keep-me", "s\x00"), InvalidInput),
        (lambda: api.get_run("a\x00b"), InvalidInput),
        (lambda: api.cancel("\ud800"), InvalidInput),
        (lambda: api.register_queue("q\x00"), InvalidQueueConfig),
        (lambda: api.register_queue("big", concurrency=10**30), InvalidQueueConfig),
        (lambda: api.register_queue("big", rate_limit={"limit": 10**30, "period_ms": 1000}), InvalidQueueConfig),
        (lambda: api.register_queue("big", rate_limit={"limit": 1, "period_ms": 10**30}), InvalidQueueConfig),
        (lambda: api.register_queue("big", concurrency=1, retry_ms=10**30), InvalidQueueConfig),
    ],
)
def test_bad_python_input_raises_a_typed_error_and_loses_nothing(existing: WorkflowRun, call: Any, error: type) -> None:
    before = snapshot()
    with pytest.raises(error):
        call()
    assert snapshot() == before


def test_a_nul_fairness_key_fails_the_run_instead_of_poisoning_its_turn(engine: Any) -> None:
    run = api.start("tests.nul_fairness")
    run.refresh_from_db()
    assert run.status == "failed"
    assert "NUL" in run.error["message"]


def test_typed_errors_are_durable_flow_errors() -> None:
    assert issubclass(InvalidInput, DurableFlowError) and issubclass(InvalidQueueConfig, DurableFlowError)
