"""Fuzzed bad input (hypothesis): arbitrary JSON and text at the JSON API and the Python API.

The rule under test: a caller can send anything, and gets either a success or a typed refusal
(a 4xx over HTTP, a `DurableFlowError` in Python), never a 500 or a stray exception; and a
refused call changes nothing that existed before it. `FUZZ_EXAMPLES` sets the examples per
test (default 40); hypothesis prints the failing example to replay.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import quote

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_flow.exceptions import DurableFlowError
from durable_flow.models import FlowQueue, Signal, WorkflowRun
from durable_flow.operations import api
from tests.support.clients import logged_in_client

FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "40")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: Text with what databases choke on mixed in: NUL, lone surrogates, very long strings.
nasty_text = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=30),
    st.sampled_from(["", "\x00", "a\x00b", "\ud800", "keep-me", "x" * 300, "fuzz-q", "approve", " "]),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    nasty_text,
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(nasty_text, children, max_size=4),
    max_leaves=12,
)
#: Known names next to fuzzed ones, so some calls get past the first check.
workflows = st.one_of(st.sampled_from(["tests.echo_flow", "tests.sleeper", "tests.three_steps"]), json_values)
#: A request body: valid JSON of a plausible shape, any JSON, or any text at all.
bodies = st.one_of(
    st.fixed_dictionaries(
        {}, optional={"workflow": workflows, "input": json_values, "run_id": json_values, "name": json_values}
    ).map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=60),
)
queue_bodies = st.one_of(
    st.fixed_dictionaries({}, optional={"concurrency": json_values, "rate_limit": json_values}).map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=60),
)


@pytest.fixture
def existing(engine: Any) -> WorkflowRun:
    api.register_queue("fuzz-q", concurrency=2)
    return api.start("tests.sleeper", 600, run_id="keep-me")


@pytest.fixture
def client(existing: WorkflowRun) -> Client:
    return logged_in_client("fuzz", superuser=True)


def snapshot() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Everything a refused call must leave as it was: runs, signals, queues."""
    return (
        list(WorkflowRun.objects.order_by("id").values_list("id", "status", "input", "output", "turns")),
        list(Signal.objects.order_by("id").values_list("id", "run_id", "name", "payload")),
        list(FlowQueue.objects.order_by("name").values_list("name", "config", "paused")),
    )


def assert_answered(response: Any, before: Any) -> None:
    """A 2xx, or a 4xx that changed nothing (a 500 raises in the test client already)."""
    assert response.status_code < 500, response.content[:300]
    if response.status_code >= 400:
        assert snapshot() == before, response.content[:300]


@FUZZ
@given(body=bodies)
def test_fuzzed_start_requests_answer_4xx_or_start(client: Client, body: str) -> None:
    before = snapshot()
    response = client.post("/api/runs/", data=body, content_type="application/json")
    assert response.status_code in (200, 201) or 400 <= response.status_code < 500
    assert_answered(response, before)
    if response.status_code == 200:  # an idempotent re-start returns the run as it was
        assert snapshot() == before


@FUZZ
@given(run_id=nasty_text, body=bodies)
def test_fuzzed_signals_answer_4xx_or_deliver(client: Client, run_id: str, body: str) -> None:
    before = snapshot()
    url = f"/api/runs/{quote(run_id, safe='', errors='surrogatepass')}/signals/"
    response = client.post(url, data=body, content_type="application/json")
    assert response.status_code in (202, 404) or 400 <= response.status_code < 500
    assert_answered(response, before)


@FUZZ
@given(name=nasty_text, body=queue_bodies)
def test_fuzzed_queue_updates_answer_4xx_or_apply(client: Client, name: str, body: str) -> None:
    before = snapshot()
    url = f"/api/queues/{quote(name, safe='', errors='surrogatepass')}/update/"
    response = client.post(url, data=body, content_type="application/json")
    assert_answered(response, before)


def typed_or_ok(call: Any) -> Any:
    """The call's result, or None when it raised a `DurableFlowError` (any other error fails)."""
    try:
        return call()
    except DurableFlowError:
        return None


@FUZZ
@given(workflow=workflows, value=json_values, run_id=st.one_of(st.none(), json_values), tags=json_values)
def test_fuzzed_python_starts_raise_typed_errors_only(
    existing: WorkflowRun, workflow: Any, value: Any, run_id: Any, tags: Any
) -> None:
    before = snapshot()
    started = typed_or_ok(lambda: api.start(workflow, value, run_id, tags=tags))
    if started is None:
        assert snapshot() == before


@FUZZ
@given(run_id=st.one_of(st.just("keep-me"), json_values), name=json_values, payload=json_values)
def test_fuzzed_python_signals_raise_typed_errors_only(
    existing: WorkflowRun, run_id: Any, name: Any, payload: Any
) -> None:
    before = snapshot()
    if typed_or_ok(lambda: api.send_signal(run_id, name, payload) or True) is None:
        assert snapshot() == before


@FUZZ
@given(
    name=st.one_of(st.just("fuzz-q"), json_values),
    concurrency=json_values,
    rate_limit=json_values,
    retry_ms=json_values,
    fairness=json_values,
    order=json_values,
)
def test_fuzzed_python_queue_registrations_raise_typed_errors_only(
    existing: WorkflowRun, name: Any, concurrency: Any, rate_limit: Any, retry_ms: Any, fairness: Any, order: Any
) -> None:
    before = snapshot()
    registered = typed_or_ok(
        lambda: (
            api.register_queue(
                name, concurrency=concurrency, rate_limit=rate_limit, retry_ms=retry_ms, fairness=fairness, order=order
            )
            or True
        )
    )
    if registered is None:
        assert snapshot() == before
