"""Values from a URL (a path segment, a query parameter, a login's `next`) answer 4xx or a safe
redirect, never a 500: a NUL character PostgreSQL cannot take, a regular expression the database
cannot compile, a redirect to another site."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from durable_flow.models import FlowQueue, QuotaRefusal, WorkerHeartbeat, WorkflowRun
from durable_flow.operations import api
from tests.support.clients import logged_in_client


@pytest.fixture
def rows(engine: Any) -> None:
    """One row of each model the admin lists, so a lookup the database evaluates per row runs."""
    api.start("tests.sleeper", 600, run_id="keep-me")
    FlowQueue.objects.create(name="q", config={"name": "q", "concurrency": 1})
    now = timezone.now()
    WorkerHeartbeat.objects.create(
        worker_id="w", host="h", pid=1, transport="db", started_at=now, last_seen=now, stopped_at=now
    )
    QuotaRefusal.objects.create(key="k", minute=now.replace(second=0, microsecond=0), refusals=1)


@pytest.fixture
def client(rows: None) -> Client:
    return logged_in_client("admin", superuser=True)


def snapshot() -> list[tuple[Any, ...]]:
    return list(WorkflowRun.objects.order_by("id").values_list("id", "status"))


# -- NUL in a path or a query value ------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("get", "/dashboard/runs/a%00b/"),
        ("get", "/dashboard/runs/a%00b/cancel/"),
        ("post", "/dashboard/runs/a%00b/cancel/"),
        ("post", "/dashboard/runs/a%00b/retry/"),
        ("post", "/dashboard/runs/a%00b/rerun/"),
        ("post", "/dashboard/runs/a%00b/signal/"),
    ],
)
def test_a_nul_in_a_dashboard_run_id_is_a_404(client: Client, method: str, url: str) -> None:
    before = snapshot()
    assert getattr(client, method)(url).status_code == 404
    assert snapshot() == before


@pytest.mark.parametrize("url", ["/dashboard/flow/?queue=a%00b", "/dashboard/flow.json?queue=a%00b"])
def test_a_nul_in_the_flow_views_queue_is_a_400(client: Client, url: str) -> None:
    assert client.get(url).status_code == 400


@pytest.mark.parametrize(
    "url",
    [
        "/admin/durable_flow/workflowrun/a%00b/change/",
        "/admin/durable_flow/workflowrun/a%00b/history/",
        "/admin/durable_flow/workflowrun/a%00b/delete/",
        "/admin/durable_flow/flowqueue/a%00b/change/",
        "/admin/durable_flow/workerheartbeat/a%00b/change/",
        "/admin/durable_flow/workerheartbeat/a%00b/delete/",
    ],
)
def test_a_nul_in_an_admin_object_id_is_answered_as_a_missing_id(client: Client, url: str) -> None:
    """The admin's answer to any id that names no row (its "doesn't exist" redirect to the index;
    403 for a delete page, which only a deletable row opens)."""
    missing = client.get(url.replace("a%00b", "no-such-id"))
    response = client.get(url)
    assert (response.status_code, response.get("Location")) == (missing.status_code, missing.get("Location"))
    assert response.status_code in (302, 403)


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("get", "/admin/durable_flow/workflowrun/a%00b/cancel/"),
        ("post", "/admin/durable_flow/workflowrun/a%00b/cancel/"),
        ("post", "/admin/durable_flow/workflowrun/a%00b/retry/"),
        ("post", "/admin/durable_flow/workflowrun/a%00b/rerun/"),
        ("get", "/admin/durable_flow/workflowrun/a%00b/signal/"),
    ],
)
def test_a_nul_in_an_admin_run_operation_id_is_a_404(client: Client, method: str, url: str) -> None:
    before = snapshot()
    assert getattr(client, method)(url).status_code == 404
    assert snapshot() == before


@pytest.mark.parametrize(
    "url",
    [
        "/admin/durable_flow/flowqueue/?name__exact=a%00b",
        "/admin/durable_flow/workerheartbeat/?worker_id__exact=a%00b",
        "/admin/durable_flow/quotarefusal/?key__exact=a%00b",
    ],
)
def test_a_nul_in_an_admin_list_filter_is_an_invalid_lookup(client: Client, url: str) -> None:
    """The changelist's own answer to a filter it cannot apply: a redirect to `?e=1`."""
    response = client.get(url)
    assert (response.status_code, response["Location"]) == (302, f"{url.split('?')[0]}?e=1")


# -- regular expressions -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("get", "/admin/durable_flow/workflowrun/?id__regex=("),
        ("get", "/admin/durable_flow/workflowrun/?id__iregex=("),
        ("get", "/admin/durable_flow/workflowrun/?workflow__regex=.*"),
        ("get", "/admin/durable_flow/workflowrun/bulk/cancel/?id__regex=("),
        ("get", "/admin/durable_flow/workflowrun/bulk/retry/?id__regex=("),
        ("post", "/admin/durable_flow/workflowrun/bulk/cancel/?id__regex=.*"),
        ("get", "/admin/durable_flow/flowqueue/?name__regex=("),
        ("get", "/admin/durable_flow/workerheartbeat/?worker_id__iregex=("),
        ("get", "/admin/durable_flow/quotarefusal/?key__regex=("),
    ],
)
def test_a_regex_lookup_in_an_admin_url_is_refused(client: Client, method: str, url: str) -> None:
    """The admin's filters never build one; from a hand-written URL the database would compile
    the pattern (an invalid one fails inside SQLite's or PostgreSQL's matcher)."""
    before = snapshot()
    assert getattr(client, method)(url).status_code == 400
    assert snapshot() == before


# -- the login's next --------------------------------------------------------------------------
@pytest.mark.parametrize("unsafe", ["https://evil.example/", "//evil.example/"])
def test_an_unsafe_login_next_falls_back_to_the_dashboard(transactional_db: None, unsafe: str) -> None:
    get_user_model().objects.create_superuser("admin", password="pw")
    client = Client()
    response = client.post(f"/admin/login/?next={unsafe}", {"username": "admin", "password": "pw", "next": unsafe})
    assert (response.status_code, response["Location"]) == (302, "/")
    assert client.get(response["Location"]).status_code == 200


# -- NUL in the admin's forms ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "action"),
    [("/admin/durable_flow/workflowrun/", "cancel_selected"), ("/admin/durable_flow/flowqueue/", "pause_selected")],
)
def test_a_nul_in_an_admin_actions_selected_id_does_nothing(client: Client, url: str, action: str) -> None:
    before = snapshot()
    response = client.post(url, {"action": action, "_selected_action": ["a\x00b", "keep-me", "q"]})
    assert (response.status_code, response["Location"]) == (302, url)
    assert snapshot() == before
    assert not FlowQueue.objects.get(pk="q").paused


def test_a_nul_in_an_admin_autocomplete_term_finds_nothing(client: Client) -> None:
    query = "term=a%00b&app_label=durable_flow&model_name=workflowrun&field_name=parent"
    response = client.get(f"/admin/autocomplete/?{query}")
    assert (response.status_code, response.json()["results"]) == (200, [])
