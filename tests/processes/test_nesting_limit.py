"""JSON nests at most `MAX_JSON_DEPTH` lists and objects deep, at every way in: a value as deep
as the limit is stored and runs, one level deeper is refused with `InvalidInput` (400 over HTTP,
a form error in the admin and the dashboard); a value stored deeper before the limit existed
reads as a placeholder, so no page fails and a worker fails its run instead of looping."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection
from django.db.models import Model
from django.test import Client

from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.config.validation import MAX_JSON_DEPTH
from durable_flow.definitions.registry import step, workflow
from durable_flow.engine import Engine, set_engine
from durable_flow.exceptions import InvalidInput
from durable_flow.models import RunStatus, StepCheckpoint, Task, WorkflowRun
from durable_flow.operations import api
from durable_flow.transports.db.transport import DatabaseTransport
from tests.conftest import ManagedProcess, wait_for
from tests.support.clients import logged_in_client
from tests.task_functions import add
from tests.workflows import echo

PLACEHOLDER = "(too deeply nested to display)"
#: Deeper than Python's default recursion limit (1000) lets `json.loads` read inside a view.
STORED_DEPTH = 990


def deepest_storable() -> int:
    """Deeper than a process whose recursion limit a library raised (`cel-python`, a dev
    dependency, sets 2500 when imported) can decode: what jsonb takes on PostgreSQL; on SQLite,
    the most its JSON check constraint lets through."""
    return 5000 if connection.vendor == "postgresql" else 2000


def nested(depth: int) -> list[Any]:
    """Lists `depth` deep: `nested(1) == []`, `nested(2) == [[]]`."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def nested_text(depth: int) -> str:
    return "[" * depth + "]" * depth


@step("tests.nesting.deep_output")
def deep_output(depth: int) -> Any:
    return nested(depth)


@workflow("tests.nesting.builds")
def builds(ctx: Any, payload: dict[str, Any]) -> Any:
    """Builds a value `depth` deep inside the workflow and passes it `where`."""
    value = nested(payload["depth"])
    if payload["where"] == "step input":
        return ctx.step(echo, value)
    if payload["where"] == "step output":
        return ctx.step(deep_output, payload["depth"])
    if payload["where"] == "child input":
        return ctx.child("tests.echo_flow", value)
    return value


@pytest.fixture
def client(transactional_db: None) -> Client:
    return logged_in_client("deep", superuser=True)


@pytest.fixture
def default_recursion_limit() -> Iterator[None]:
    """Python's default recursion limit, as in a process where no library raised it (importing
    `cel-python`, which the benchmarks use, raises it to 2500 for the whole process)."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(before)


def store_raw(model: type[Model], field: str, text: str, **where: object) -> None:
    """Write JSON text straight into a column, as an older version might have stored it."""
    table, column = model._meta.db_table, model._meta.get_field(field).column
    cast = "::jsonb" if connection.vendor == "postgresql" else ""
    condition = " AND ".join(f"{model._meta.get_field(name).column} = %s" for name in where)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {column} = %s{cast} WHERE {condition}", [text, *where.values()])


# -- the Python API ---------------------------------------------------------------------


def test_an_input_as_deep_as_the_limit_starts_and_the_run_completes(engine: Any) -> None:
    run = api.start("tests.echo_flow", nested(MAX_JSON_DEPTH))
    run.refresh_from_db()
    assert (run.status, run.output) == (RunStatus.COMPLETED, nested(MAX_JSON_DEPTH))


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 975, 100_000])
def test_an_input_deeper_than_the_limit_is_refused_and_nothing_is_stored(engine: Any, depth: int) -> None:
    with pytest.raises(InvalidInput, match=f"more than {MAX_JSON_DEPTH} levels"):
        api.start("tests.echo_flow", nested(depth))
    assert not WorkflowRun.objects.exists()


def test_a_signal_payload_deeper_than_the_limit_is_refused(engine: Any) -> None:
    run = api.start("tests.signal_waiter", None)
    with pytest.raises(InvalidInput, match=f"more than {MAX_JSON_DEPTH} levels"):
        api.send_signal(run.pk, "go", nested(MAX_JSON_DEPTH + 1))
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED


@pytest.mark.parametrize("where", ["step input", "step output", "child input", "run output"])
def test_a_value_built_deeper_than_the_limit_inside_a_run_fails_the_run(engine: Any, where: str) -> None:
    run = api.start("tests.nesting.builds", {"depth": MAX_JSON_DEPTH + 1, "where": where})
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert f"more than {MAX_JSON_DEPTH} levels" in run.error["message"]


def test_a_task_enqueued_with_arguments_deeper_than_the_limit_is_refused(engine: Any) -> None:
    with pytest.raises(InvalidInput, match=f"more than {MAX_JSON_DEPTH} levels"):
        add.enqueue(nested(5000), 1)
    assert not WorkflowRun.objects.exists()


# -- HTTP: the JSON API and the forms ------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 975])
def test_the_api_answers_400_to_an_input_deeper_than_the_limit(engine: Any, client: Client, depth: int) -> None:
    body = '{"workflow": "tests.echo_flow", "input": ' + nested_text(depth) + "}"
    response = client.post("/api/runs/", data=body, content_type="application/json")
    assert response.status_code == 400 and response.json()["error"] == "InvalidInput"
    assert not WorkflowRun.objects.exists()


def test_the_api_answers_400_to_a_signal_payload_deeper_than_the_limit(engine: Any, client: Client) -> None:
    run = api.start("tests.signal_waiter", None)
    body = '{"name": "go", "payload": ' + nested_text(MAX_JSON_DEPTH + 1) + "}"
    response = client.post(f"/api/runs/{run.pk}/signals/", data=body, content_type="application/json")
    assert response.status_code == 400 and response.json()["error"] == "InvalidInput"
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
@pytest.mark.parametrize(
    ("url", "status"), [("/admin/durable_flow/workflowrun/start/", 200), ("/dashboard/runs/start/", 400)]
)
def test_a_start_form_shows_an_error_for_input_deeper_than_the_limit_and_keeps_it(
    engine: Any, client: Client, url: str, status: int, depth: int
) -> None:
    text = nested_text(depth)
    response = client.post(url, {"workflow": "tests.echo_flow", "input": text, "run_id": "kept-id"})
    page = response.content.decode()
    assert response.status_code == status
    assert f"more than {MAX_JSON_DEPTH} levels" in page
    assert text in page and "kept-id" in page
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_the_admin_signal_form_shows_an_error_for_a_payload_deeper_than_the_limit(
    engine: Any, client: Client, depth: int
) -> None:
    run = api.start("tests.signal_waiter", None)
    text = nested_text(depth)
    response = client.post(f"/admin/durable_flow/workflowrun/{run.pk}/signal/", {"name": "go", "payload": text})
    page = response.content.decode()
    assert response.status_code == 200 and f"more than {MAX_JSON_DEPTH} levels" in page and text in page
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_the_dashboard_signal_form_reports_a_payload_deeper_than_the_limit(
    engine: Any, client: Client, depth: int
) -> None:
    run = api.start("tests.signal_waiter", None)
    response = client.post(
        f"/dashboard/runs/{run.pk}/signal/", {"name": "go", "payload": nested_text(depth)}, follow=True
    )
    page = response.content.decode()
    # The run's page again, with the error and the form as it was typed (nothing was sent).
    assert response.status_code == 400 and f"more than {MAX_JSON_DEPTH} levels" in page
    assert 'value="go"' in page
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED


# -- values stored deeper than the limit (before it existed) -----------------------------


@pytest.fixture(params=[MAX_JSON_DEPTH + 1, STORED_DEPTH], ids=["just-over", "very-deep"])
def deep_run(request: pytest.FixtureRequest, engine: Any) -> str:
    """A completed run of one step whose input and output, and its step's, are stored too deep."""
    run = api.start("tests.echo_flow", 1, run_id="deep")
    text = nested_text(request.param)
    for field in ("input", "output"):
        store_raw(WorkflowRun, field, text, id=run.pk)
        store_raw(StepCheckpoint, field, text, run=run.pk)
    return run.pk


def test_a_value_stored_deeper_than_the_limit_reads_as_a_placeholder(
    deep_run: str, default_recursion_limit: None
) -> None:
    run = WorkflowRun.objects.get(pk=deep_run)
    assert (run.input, run.output) == (PLACEHOLDER, PLACEHOLDER)
    assert StepCheckpoint.objects.get(run=run).output == PLACEHOLDER


@pytest.mark.parametrize(
    ("url", "shows_values"),
    [
        ("/dashboard/runs/", False),
        ("/dashboard/runs/deep/", True),
        ("/admin/durable_flow/workflowrun/", False),
        ("/admin/durable_flow/workflowrun/deep/change/", True),
        ("/api/runs/deep/", True),
    ],
)
def test_a_run_stored_deeper_than_the_limit_does_not_break_its_pages(
    deep_run: str, client: Client, default_recursion_limit: None, url: str, shows_values: bool
) -> None:
    response = client.get(url)
    page = response.content.decode()
    assert response.status_code == 200 and "deep" in page
    assert (PLACEHOLDER in page) is shows_values


def test_a_run_stored_deeper_than_the_limit_is_not_rerun_with_its_placeholder(deep_run: str) -> None:
    with pytest.raises(InvalidInput, match=f"more than {MAX_JSON_DEPTH} levels"):
        api.rerun(deep_run, new_run_id="again")
    assert not WorkflowRun.objects.filter(pk="again").exists()


def test_a_run_stored_deeper_than_the_limit_fails_on_a_worker_instead_of_looping(
    transactional_db: None, spawn: Callable[..., ManagedProcess]
) -> None:
    set_engine(Engine(admission=LocalAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings()))
    run = api.start("tests.echo_flow", 1, run_id="deep-on-a-worker")  # pending: its first turn is a task row
    store_raw(WorkflowRun, "input", nested_text(deepest_storable()), id=run.pk)
    spawn("durable_worker", "--concurrency", "1", env={"DURABLE_FLOW_TRANSPORT": "db"})
    statuses = WorkflowRun.objects.filter(pk=run.pk).values_list("status", flat=True)
    wait_for(lambda: statuses.first() in (RunStatus.FAILED, RunStatus.COMPLETED), timeout=60, what="the run to end")
    (status, error) = WorkflowRun.objects.filter(pk=run.pk).values_list("status", "error").get()
    assert status == RunStatus.FAILED
    assert error["type"] == "durable_flow.exceptions.InvalidInput"
    assert f"more than {MAX_JSON_DEPTH} levels" in error["message"]
    assert not Task.objects.filter(run_id=run.pk).exists()  # nothing left to deliver again
