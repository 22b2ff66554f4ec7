"""`GET /api/runs/`: filters through the dashboard's filter form, pages by an opaque keyset
cursor over `(created_at, id)` (stable while runs are started, no COUNT), bad parameters a 400
naming the field."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from durable_flow.models import RunStatus, StepCheckpoint, WorkflowRun
from tests.support.clients import logged_in_client

BASE = timezone.now().replace(microsecond=0) - timedelta(days=1)


@pytest.fixture
def client(db: None) -> Client:
    """The list reads rows: no engine needed."""
    return logged_in_client("lister")


def make_run(run_id: str, at: datetime, **fields: Any) -> WorkflowRun:
    """A run row created at `at` (`auto_now_add` sets the time, so it is moved after)."""
    fields.setdefault("workflow", "tests.three_steps")
    fields.setdefault("status", RunStatus.COMPLETED)
    run = WorkflowRun.objects.create(id=run_id, **fields)
    WorkflowRun.objects.filter(pk=run_id).update(created_at=at)
    return run


def ids(response: Any) -> list[str]:
    assert response.status_code == 200, response.content
    return [run["id"] for run in response.json()["runs"]]


def walk(client: Client, **params: Any) -> list[list[str]]:
    """Every page, following `next_cursor` to the end."""
    pages: list[list[str]] = []
    cursor = None
    while True:
        response = client.get("/api/runs/", {**params, **({"cursor": cursor} if cursor else {})})
        pages.append(ids(response))
        cursor = response.json()["next_cursor"]
        if cursor is None:
            return pages


def test_pages_cover_every_run_once_newest_first_ties_broken_by_id(client: Client) -> None:
    for n in range(5):
        make_run(f"r{n}", BASE + timedelta(seconds=n))
    for name in ("t-a", "t-b", "t-c"):  # three runs created in the same instant
        make_run(name, BASE + timedelta(seconds=10))
    pages = walk(client, limit=3)
    # Ties by id, ascending: the dashboard's run list's order too (one keyset, `observe.run_pages`).
    assert pages == [["t-a", "t-b", "t-c"], ["r4", "r3", "r2"], ["r1", "r0"]]
    assert walk(client, limit=2) == [["t-a", "t-b"], ["t-c", "r4"], ["r3", "r2"], ["r1", "r0"]]


def test_runs_started_between_pages_neither_shift_nor_repeat_the_next_page(client: Client) -> None:
    for n in range(6):
        make_run(f"r{n}", BASE + timedelta(seconds=n))
    first = client.get("/api/runs/", {"limit": 3})
    assert ids(first) == ["r5", "r4", "r3"]
    for n in range(6, 10):  # newer runs arrive, and one in the same instant as the page's last
        make_run(f"r{n}", BASE + timedelta(seconds=n))
    make_run("q3-twin", BASE + timedelta(seconds=3))  # before r3 in the tie (ids ascending): already passed
    second = client.get("/api/runs/", {"limit": 3, "cursor": first.json()["next_cursor"]})
    assert ids(second) == ["r2", "r1", "r0"]
    assert second.json()["next_cursor"] is None


def test_a_page_counts_nothing(client: Client) -> None:
    for n in range(4):
        make_run(f"r{n}", BASE + timedelta(seconds=n))
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/api/runs/", {"limit": 2, "status": "completed"})
    assert len(ids(response)) == 2
    statements = [query["sql"].upper() for query in queries.captured_queries]
    assert not [sql for sql in statements if "COUNT(" in sql]
    run_reads = [sql for sql in statements if "DURABLE_FLOW_WORKFLOWRUN" in sql]
    assert len(run_reads) == 1 and "LIMIT 3" in run_reads[0]  # one row past the page, to know if more follow
    assert '"INPUT"' not in run_reads[0] and '"OUTPUT"' not in run_reads[0]  # a list line shows neither


def test_filters(client: Client) -> None:
    make_run("alpha-1", BASE, status=RunStatus.FAILED, tags=["nightly", "eu"], error={"type": "x.Boom", "message": "m"})
    make_run("alpha-2", BASE + timedelta(hours=1), status=RunStatus.SUSPENDED, workflow="tests.sleeper")
    make_run("beta-1", BASE + timedelta(hours=2), status=RunStatus.COMPLETED, tags=["nightly-2"])
    queued = make_run("beta-2", BASE + timedelta(hours=3), status=RunStatus.RUNNING)
    StepCheckpoint.objects.create(run=queued, key="s1", sequence=1, name="echo", status="pending", queue="emails")

    def listed(**params: Any) -> set[str]:
        return set(ids(client.get("/api/runs/", params)))

    assert listed(status="failed") == {"alpha-1"}
    assert listed(status=["failed", "running"]) == listed(status="failed,running") == {"alpha-1", "beta-2"}
    assert listed(workflow="tests.sleeper") == {"alpha-2"}
    assert listed(tag="nightly") == {"alpha-1"}  # a whole tag, not a part of one
    assert listed(queue="emails") == {"beta-2"}
    assert listed(id_prefix="alpha-") == {"alpha-1", "alpha-2"}
    assert listed(id_prefix="lpha") == set()  # a prefix, not a substring
    after = (BASE + timedelta(hours=1)).isoformat()
    before = (BASE + timedelta(hours=2)).isoformat()
    assert listed(created_after=after, created_before=before) == {"alpha-2", "beta-1"}  # both ends included
    assert listed(created_after=after, id_prefix="beta", status="running") == {"beta-2"}
    failed = client.get("/api/runs/", {"status": "failed"}).json()["runs"][0]
    assert failed["error"] == {"type": "x.Boom", "message": "m"} and failed["tags"] == ["nightly", "eu"]
    assert "input" not in failed and "output" not in failed


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"stauts": "failed"}, "stauts"),
        ({"status": "exploded"}, "status"),
        ({"limit": "0"}, "limit"),
        ({"limit": "201"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"created_after": "yesterday"}, "created_after"),
        ({"created_before": "2026-13-01T00:00:00Z"}, "created_before"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"cursor": "WyJ4IiwgMV0"}, "cursor"),  # base64 of ["x", 1]: JSON, but no time and id
        ({"cursor": "WyIyMDI2LTAxLTAxVDAwOjAwOjAwIiwgImEiXQ"}, "cursor"),  # a time with no zone
        ({"id_prefix": "a\x00"}, "id_prefix"),
        ({"id_prefix": "x" * 201}, "id_prefix"),
        ({"workflow": ["a", "b"]}, "workflow"),
        ({"tag": "x" * 201}, "tag"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(client: Client, params: dict[str, Any], field: str) -> None:
    make_run("kept", BASE)
    response = client.get("/api/runs/", params)
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert body["error"] == "InvalidInput" and body["field"] == field and field in body["message"]


def test_a_cursor_survives_a_round_trip_through_a_url(client: Client) -> None:
    for n in range(3):
        make_run(f"odd/id+{n}=", BASE + timedelta(microseconds=n))
    assert walk(client, limit=1) == [["odd/id+2="], ["odd/id+1="], ["odd/id+0="]]
