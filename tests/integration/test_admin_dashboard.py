"""The admin and the dashboard: staff only, cancel by POST with CSRF, live feed for staff only."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from durable_flow import start
from durable_flow.models import RunStatus, WorkflowRun


@pytest.fixture
def sleeping_run(engine: Any) -> WorkflowRun:
    run = start("tests.sleeper", 3600)
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED
    return run


def test_anonymous_users_are_sent_to_login(transactional_db: None) -> None:
    for url in (
        reverse("dashboard:index"),
        reverse("dashboard:snapshot"),
        reverse("admin:durable_flow_workflowrun_changelist"),
    ):
        response = Client().get(url)
        assert response.status_code == 302
        assert "/admin/login/" in response["Location"]


def test_non_staff_users_cannot_see_the_dashboard(transactional_db: None) -> None:
    user = get_user_model().objects.create_user("plain", password="pw")
    client = Client()
    client.force_login(user)
    for name in ("dashboard:index", "dashboard:snapshot"):
        response = client.get(reverse(name))
        assert response.status_code == 403
        assert b"Queues" not in response.content
    cookie = f"sessionid={client.cookies['sessionid'].value}"
    connected, code, _ = _connect(cookie)
    assert not connected and code == 4403


def test_dashboard_renders_queues_and_workers_without_javascript(staff_client: Client, engine: Any) -> None:
    from durable_flow import register_queue

    register_queue("pdf-render", concurrency=5)
    response = staff_client.get(reverse("dashboard:index"))
    assert response.status_code == 200
    assert b"pdf-render" in response.content
    assert b"0 / 5" in response.content


def test_admin_lists_filters_and_searches_runs(staff_client: Client, sleeping_run: WorkflowRun) -> None:
    url = reverse("admin:durable_flow_workflowrun_changelist")
    assert sleeping_run.id.encode() in staff_client.get(url, {"status__exact": "suspended"}).content
    assert sleeping_run.id.encode() not in staff_client.get(url, {"status__exact": "completed"}).content
    assert sleeping_run.id.encode() in staff_client.get(url, {"q": sleeping_run.id[:12]}).content
    odd = staff_client.get(url, {"q": "'; DROP TABLE durable_flow_workflowrun; --"})
    assert odd.status_code == 200
    assert WorkflowRun.objects.filter(pk=sleeping_run.pk).exists()


def test_run_detail_shows_the_timeline_and_a_cancel_button(staff_client: Client, sleeping_run: WorkflowRun) -> None:
    response = staff_client.get(reverse("admin:durable_flow_workflowrun_change", args=[sleeping_run.pk]))
    assert response.status_code == 200
    assert b'id="cancel-run"' in response.content
    assert b"sleep" in response.content


def test_cancel_from_the_detail_page_needs_a_post_with_csrf(staff_client: Client, sleeping_run: WorkflowRun) -> None:
    url = reverse("admin:durable_flow_workflowrun_cancel", args=[sleeping_run.pk])
    confirmation = staff_client.get(url)  # asks first
    assert confirmation.status_code == 200 and b"confirm-cancel" in confirmation.content
    assert WorkflowRun.objects.get(pk=sleeping_run.pk).status == RunStatus.SUSPENDED
    assert staff_client.post(url).status_code == 403  # no CSRF token
    assert WorkflowRun.objects.get(pk=sleeping_run.pk).status == RunStatus.SUSPENDED
    page = staff_client.get(reverse("admin:durable_flow_workflowrun_change", args=[sleeping_run.pk]))
    token = page.context["csrf_token"]
    assert staff_client.post(url, {"csrfmiddlewaretoken": str(token)}).status_code == 302
    assert WorkflowRun.objects.get(pk=sleeping_run.pk).status == RunStatus.CANCELLED


def test_cancel_selected_runs_admin_action(staff_client: Client, engine: Any) -> None:
    runs = [start("tests.sleeper", 3600) for _ in range(3)]
    done = start("tests.three_steps", 1)
    url = reverse("admin:durable_flow_workflowrun_changelist")
    token = staff_client.get(url).context["csrf_token"]
    response = staff_client.post(
        url,
        {
            "action": "cancel_selected",
            "_selected_action": [r.pk for r in runs] + [done.pk],
            "csrfmiddlewaretoken": str(token),
        },
    )
    assert response.status_code == 302
    assert set(WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)) == {
        RunStatus.CANCELLED
    }
    assert WorkflowRun.objects.get(pk=done.pk).status == RunStatus.COMPLETED


def _connect(cookie: str | None) -> tuple[bool, Any, Any]:
    from settings.asgi import application

    async def go() -> tuple[bool, Any, Any]:
        headers = [(b"origin", b"http://localhost")]
        if cookie:
            headers.append((b"cookie", cookie.encode()))
        communicator = WebsocketCommunicator(application, "/ws/live/", headers=headers)
        connected, code = await communicator.connect()
        message = await communicator.receive_json_from(timeout=5) if connected else None
        await communicator.disconnect()
        return connected, code, message

    return async_to_sync(go)()


def test_anonymous_websocket_connections_are_closed(transactional_db: None) -> None:
    connected, code, _ = _connect(None)
    assert not connected
    assert code == 4403


def test_staff_websocket_receives_a_live_snapshot(staff_client: Client) -> None:
    cookie = f"sessionid={staff_client.cookies['sessionid'].value}"
    connected, _, message = _connect(cookie)
    assert connected
    assert message["topic"] == "overview" and "queues-table" in message["fragments"]
