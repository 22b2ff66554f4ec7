"""The dashboard's Runs, Run detail and Flow pages through Django's test client: filters,
search, bulk actions by filter with a confirmation, the timeline, the operations with their
permissions and audit entries, the flow snapshot and the burst."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from durable_flow import register_queue
from durable_flow.config.settings import get_settings
from durable_flow.exceptions import UnexpectedSignal
from durable_flow.models import RunStatus, Signal, WorkerHeartbeat, WorkflowRun
from durable_flow.observe.queues import queue_flow as flow_snapshot
from durable_flow.observe.timeline import build_timeline
from durable_flow.operations import api
from durable_flow.runtime.poller import TimerPoller
from durable_flow_dashboard import consumers  # noqa: F401 - the consumer registers the run page's topic
from durable_flow_dashboard.live import render_topic
from tests import workflows
from tests.conftest import MovableClock
from tests.engine_support import transport_of
from tests.support.clients import StaffLogin


@pytest.fixture
def admin_client(transactional_db: None) -> Client:
    user = get_user_model().objects.create_user("boss", password="pw", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def staff_login() -> StaffLogin:
    """Staff without any durable_flow permission."""
    return StaffLogin("viewer", superuser=False, csrf=False)


def test_runs_list_filters_by_status_workflow_tag_and_searches_input(engine: Any, admin_client: Client) -> None:
    done = api.start("tests.three_steps", 1, run_id="order-1", tags=["vip"])
    workflows.FAILURES_LEFT["zz-needle"] = 1
    failed = api.start("tests.step_then_flaky", "zz-needle", run_id="order-2")
    assert WorkflowRun.objects.get(pk=failed.id).status == RunStatus.FAILED
    page = admin_client.get("/dashboard/runs/", {"status": "failed"}).content.decode()
    assert 'data-run="order-2"' in page and 'data-run="order-1"' not in page
    assert "flaky zz-needle failing" in page  # the error column
    page = admin_client.get("/dashboard/runs/", {"workflow": "tests.three_steps"}).content.decode()
    assert 'data-run="order-1"' in page and 'data-run="order-2"' not in page
    assert 'data-run="order-1"' in admin_client.get("/dashboard/runs/", {"tag": "vip"}).content.decode()
    assert 'data-run="order-2"' not in admin_client.get("/dashboard/runs/", {"tag": "vip"}).content.decode()
    page = admin_client.get("/dashboard/runs/", {"q": "needle", "in_input": "on"}).content.decode()  # input content
    assert 'data-run="order-2"' in page and 'data-run="order-1"' not in page
    assert 'data-run="order-2"' not in admin_client.get("/dashboard/runs/", {"q": "needle"}).content.decode()
    page = admin_client.get("/dashboard/runs/", {"q": "order-1"}).content.decode()  # run id
    assert 'data-run="order-1"' in page and 'data-run="order-2"' not in page
    assert f'data-run="{done.id}"' in admin_client.get("/dashboard/runs/", {"range": "1h"}).content.decode()


@pytest.mark.parametrize(
    "params",
    [{"status": "bogus"}, {"range": "3y"}, {"since": "not a date"}, {"q": "a\x00b"}, {"after": "x"}],
)
def test_bad_filters_are_a_400_never_a_500(engine: Any, admin_client: Client, params: dict) -> None:
    assert admin_client.get("/dashboard/runs/", params).status_code == 400


def test_pagination_splits_the_list(engine: Any, admin_client: Client) -> None:
    for i in range(55):
        api.start("tests.three_steps", i, run_id=f"p-{i:03d}")
    first = admin_client.get("/dashboard/runs/").content.decode()
    assert 'rel="next"' in first and 'rel="prev"' not in first and "p-000" not in first
    older = first.split('" rel="next"')[0].rsplit('href="', 1)[1].replace("&amp;", "&")
    second = admin_client.get(f"/dashboard/runs/{older}").content.decode()
    assert 'rel="prev"' in second and 'rel="next"' not in second and "p-000" in second


def test_bulk_retry_by_filter_asks_first_then_retries_every_match(engine: Any, admin_client: Client) -> None:
    for i in range(3):
        workflows.FAILURES_LEFT[f"b{i}"] = 1
        api.start("tests.step_then_flaky", f"b{i}", run_id=f"bulk-{i}")
    api.start("tests.three_steps", 1, run_id="fine")
    confirm = admin_client.get("/dashboard/runs/bulk/retry/", {"status": "failed"})
    assert confirm.status_code == 200 and 'id="bulk-count">3<' in confirm.content.decode()
    assert WorkflowRun.objects.filter(status=RunStatus.FAILED).count() == 3  # nothing done on GET
    response = admin_client.post("/dashboard/runs/bulk/retry/?status=failed")
    assert response.status_code == 302
    assert WorkflowRun.objects.filter(status=RunStatus.COMPLETED).count() == 4
    assert LogEntry.objects.filter(change_message__contains="by filter").count() == 3


def test_bulk_needs_the_permission(engine: Any, staff_client: Client) -> None:
    assert staff_client.get("/dashboard/runs/bulk/cancel/").status_code == 403
    assert staff_client.post("/dashboard/runs/bulk/cancel/").status_code == 403
    assert staff_client.get("/dashboard/runs/bulk/explode/").status_code == 404


def test_run_detail_shows_every_attempt_with_its_error_and_a_timeline(
    engine: Any, clock: MovableClock, admin_client: Client
) -> None:
    workflows.FAILURES_LEFT["t"] = 2
    run = api.start("tests.flaky_flow", "t")
    for backoff_s in (1, 2):
        clock.advance(seconds=backoff_s)
        TimerPoller(engine).tick()
    run.refresh_from_db()
    timeline = build_timeline(run, now=clock())
    assert timeline.rows[0].kind == "turn"  # the run's turns come first
    steps = timeline.rows[1:]
    assert [(r.attempt, r.status) for r in steps] == [(1, "failed"), (2, "failed"), (3, "completed")]
    assert [s.kind for s in steps[0].segments] == ["transport", "failed", "backoff"]
    assert steps[0].segments[-1].seconds == 1.0
    assert steps[1].segments[-1].seconds == 2.0
    page = admin_client.get(f"/dashboard/runs/{run.id}/").content.decode()
    assert "attempt 1 of 4" in page and "attempt 3 of 4" in page
    assert "flaky t failing, 2 left" in page and "flaky t failing, 1 left" in page
    assert "<pre>Traceback" in page
    assert admin_client.get("/dashboard/runs/nope/").status_code == 404


def test_operations_need_their_permission_and_are_audited(engine: Any, staff_client: Client) -> None:
    run = api.start("tests.signal_waiter", None)
    assert staff_client.post(f"/dashboard/runs/{run.id}/signal/", {"name": "approve"}).status_code == 403
    assert staff_client.post(f"/dashboard/runs/{run.id}/cancel/").status_code == 403
    assert staff_client.post(f"/dashboard/runs/{run.id}/rerun/").status_code == 403
    assert staff_client.get("/dashboard/runs/start/").status_code == 403
    user = get_user_model().objects.get(username="viewer")
    user.user_permissions.add(*Permission.objects.filter(codename__in=["signal_workflowrun", "cancel_workflowrun"]))
    page = staff_client.get(f"/dashboard/runs/{run.id}/").content.decode()
    assert 'id="rerun-run" disabled' in page  # shown, but disabled without the permission
    response = staff_client.post(f"/dashboard/runs/{run.id}/signal/", {"name": "approve", "payload": '{"ok": 1}'})
    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert LogEntry.objects.filter(object_id=run.id, change_message__contains="signal").exists()
    other = api.start("tests.signal_waiter", None)
    assert "Yes, cancel" in staff_client.get(f"/dashboard/runs/{other.id}/cancel/").content.decode()
    assert WorkflowRun.objects.get(pk=other.id).status != RunStatus.CANCELLED
    staff_client.post(f"/dashboard/runs/{other.id}/cancel/")
    assert WorkflowRun.objects.get(pk=other.id).status == RunStatus.CANCELLED


def test_a_bad_signal_payload_is_refused_and_the_form_keeps_what_was_typed(engine: Any, admin_client: Client) -> None:
    run = api.start("tests.signal_waiter", None)
    response = admin_client.post(f"/dashboard/runs/{run.id}/signal/", {"name": "approve", "payload": "{nope"})
    page = response.content.decode()
    assert response.status_code == 400 and "Signal not sent" in page
    assert 'value="approve"' in page and "{nope</textarea>" in page  # both fields as typed
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.SUSPENDED


def test_a_signal_name_the_run_does_not_wait_for_asks_for_confirmation(engine: Any, admin_client: Client) -> None:
    run = api.start("tests.signal_waiter", None)
    url = f"/dashboard/runs/{run.id}/signal/"
    asked = admin_client.post(url, {"name": "aprove", "payload": '{"by": "me"}'})
    page = asked.content.decode()
    assert asked.status_code == 409 and 'id="signal-confirm"' in page
    assert "does not wait for <code>aprove</code> (it waits for <code>approve</code>)" in page
    assert not Signal.objects.filter(run_id=run.id).exists()  # nothing sent yet
    sent = admin_client.post(url, {"name": "aprove", "payload": '{"by": "me"}', "confirm": "1"})
    assert sent.status_code == 302
    assert list(Signal.objects.filter(run_id=run.id).values_list("name", "payload")) == [("aprove", {"by": "me"})]
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.SUSPENDED  # still waits for approve
    # The name it waits for goes at once, no question.
    assert admin_client.post(url, {"name": "approve"}).status_code == 302
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED


def test_the_operations_layer_refuses_an_unexpected_signal_unless_confirmed(engine: Any) -> None:
    run = api.start("tests.signal_waiter", None)
    with pytest.raises(UnexpectedSignal) as refused:
        api.send_signal(run.id, "aprove", None, confirm=False)
    assert (refused.value.name, refused.value.awaited) == ("aprove", ["approve"])
    api.send_signal(run.id, "approve", {"ok": True}, confirm=False)
    assert WorkflowRun.objects.get(pk=run.id).output == {"got": {"ok": True}}


def test_start_form_starts_a_run(engine: Any, admin_client: Client) -> None:
    assert "tests.three_steps" in admin_client.get("/dashboard/runs/start/").content.decode()
    response = admin_client.post(
        "/dashboard/runs/start/", {"workflow": "tests.three_steps", "input": "2", "run_id": "from-form"}
    )
    assert response.status_code == 302 and response["Location"].endswith("/dashboard/runs/from-form/")
    assert WorkflowRun.objects.get(pk="from-form").output == 7
    bad = admin_client.post("/dashboard/runs/start/", {"workflow": "tests.three_steps", "input": "{"})
    assert bad.status_code == 400


def test_flow_snapshot_places_waiting_calls_and_the_burst_starts_runs(
    manual: Any, admin_client: Client, settings: Any
) -> None:
    register_queue("flow-q", concurrency=1)
    settings.DASHBOARD_BURST = {"WORKFLOW": "tests.queued", "QUEUE": "flow-q", "SIZE": 3, "INPUT": {"queue": "flow-q"}}
    response = admin_client.post("/dashboard/flow/burst/", {"size": "3"}, HTTP_ACCEPT="application/json")
    assert response.status_code == 201 and response.json()["started"] == 3
    manual.transport.run_turns()
    zones = sorted(d["zone"] for d in flow_snapshot("flow-q")["dots"])
    assert zones == ["admitted", "waiting", "waiting"]
    page = admin_client.get("/dashboard/flow/?queue=flow-q").content.decode()
    assert "Waiting line" in page and 'id="n-waiting">2<' in page
    assert admin_client.post("/dashboard/flow/burst/", {"size": "100000"}).status_code == 400
    assert admin_client.get("/favicon.ico").status_code == 200


def test_a_run_page_shows_a_step_only_a_live_workers_heartbeat_lists(manual: Any, admin_client: Client) -> None:
    """An optimistic first step runs before any row of its run says so: its worker's heartbeat
    is the one record, and the run's page and its admin page read it."""
    run = api.start("tests.three_steps", 1)
    now = timezone.now()
    WorkerHeartbeat.objects.create(
        worker_id="w-opt", host="h", pid=1, transport="rq", started_at=now, last_seen=now, running=[f"{run.id}/1/1"]
    )
    dead = now - timedelta(seconds=get_settings().heartbeat_ttl_s + 60)
    WorkerHeartbeat.objects.create(
        worker_id="w-dead", host="h", pid=2, transport="rq", started_at=dead, last_seen=dead, running=[f"{run.id}/1/1"]
    )
    line = "step 1, attempt 1, on worker w-opt (not recorded yet"
    page = admin_client.get(reverse("dashboard:run", args=[run.id])).content.decode()
    assert 'id="executing-now"' in page and line in page and "w-dead" not in page
    admin_page = admin_client.get(reverse("admin:durable_flow_workflowrun_change", args=[run.id])).content.decode()
    assert line in admin_page and "w-dead" not in admin_page
    other = api.start("tests.three_steps", 2)
    assert 'id="executing-now"' not in admin_client.get(reverse("dashboard:run", args=[other.id])).content.decode()
    transport_of(manual).run_turns()  # the step written as dispatched (the locked path): recorded
    page = admin_client.get(reverse("dashboard:run", args=[run.id])).content.decode()
    assert "step 1, attempt 1, on worker w-opt" in page and "not recorded yet" not in page


def test_the_run_page_is_a_live_topic_whose_fragments_follow_the_run(engine: Any) -> None:
    run = api.start("tests.signal_waiter", None)
    before = render_topic({}, f"run:{run.id}")
    assert before is not None and "suspended" in before["run-badge"] and "signal `approve`" in before["run-waits"]
    api.send_signal(run.id, "approve", None)
    after = render_topic({}, f"run:{run.id}")
    assert after is not None and "completed" in after["run-badge"]
    assert "Nothing: the run has finished." in after["run-waits"]
    assert render_topic({}, "run:no-such-run") is None  # gone: the page says so


def test_the_run_topic_adds_each_failed_attempt_as_it_fails(engine: Any, clock: MovableClock) -> None:
    workflows.FAILURES_LEFT["live"] = 2
    run = api.start("tests.flaky_flow", "live")  # the first attempt fails at once
    first = render_topic({}, f"run:{run.id}")
    assert first is not None and first["run-attempts"].count("data-attempt=") == 1
    assert "flaky live failing, 2 left" in first["run-attempts"]
    clock.advance(seconds=1)
    TimerPoller(engine).tick()  # the retry after its backoff fails too
    second = render_topic({}, f"run:{run.id}")
    assert second is not None and second["run-attempts"].count("data-attempt=") == 2
    assert "flaky live failing, 1 left" in second["run-attempts"]
    # A traceback's <details> has an id, so the page keeps it open across a swap.
    assert 'details id="traceback-' in second["run-attempts"]


def test_the_run_topic_says_why_the_run_failed_once_it_has(engine: Any, clock: MovableClock) -> None:
    run = api.start("tests.fails", None)  # its step fails once, then again after a backoff
    retrying = render_topic({}, f"run:{run.id}")
    assert retrying is not None and "Why it failed" not in retrying["run-error"]
    clock.advance(seconds=1)
    TimerPoller(engine).tick()
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.FAILED
    failed = render_topic({}, f"run:{run.id}")
    assert failed is not None and "Why it failed" in failed["run-error"] and "boom" in failed["run-error"]


def test_the_run_topic_names_the_signals_the_run_waits_for_as_they_change(engine: Any) -> None:
    run = api.start("tests.two_signals", None)
    before = render_topic({}, f"run:{run.id}")
    assert before is not None
    assert 'data-first="approve"' in before["run-signal-names"]
    assert '<option value="approve">' in before["run-signal-names"]  # the name field's suggestions
    api.send_signal(run.id, "approve", None)
    after = render_topic({}, f"run:{run.id}")
    assert after is not None
    assert 'data-first="ship"' in after["run-signal-names"] and "<code>ship</code>" in after["run-signal-names"]
    assert "approve" not in after["run-signal-names"]
    assert "None." in before["run-signals"] and "<td>approve</td>" in after["run-signals"]  # received
    api.send_signal(run.id, "ship", None)
    done = render_topic({}, f"run:{run.id}")
    assert done is not None and "the run has finished" in done["run-signal-names"]


def test_no_live_fragment_holds_the_signal_forms_fields(engine: Any, admin_client: Client) -> None:
    run = api.start("tests.two_signals", None)
    fragments = render_topic({}, f"run:{run.id}")
    assert fragments is not None
    for html in fragments.values():  # a tick never replaces what the user typed
        assert 'name="name"' not in html and 'name="payload"' not in html
    page = admin_client.get(reverse("dashboard:run", args=[run.id])).content.decode()
    assert 'data-live="run-signal-names"' in page and 'data-live="run-attempts"' in page
    # The pre-filled name follows the run's awaited names; one sent back as typed does not.
    assert re.search(r'<input[^>]*data-follow-awaited[^>]*id="signal-name"', page)
    typed = admin_client.post(f"/dashboard/runs/{run.id}/signal/", {"name": "aprove", "payload": "{nope"})
    assert typed.status_code == 400
    assert "data-follow-awaited" not in typed.content.decode()


def test_the_cancel_confirmation_follows_the_runs_status(engine: Any, admin_client: Client) -> None:
    run = api.start("tests.signal_waiter", None)
    page = admin_client.get(reverse("dashboard:cancel", args=[run.id])).content.decode()
    assert f'data-live-topic="run:{run.id}"' in page and 'data-live="run-badge"' in page


def test_a_child_that_appears_is_in_the_next_ticks_children(engine: Any, admin_client: Client) -> None:
    parent = api.start("tests.signal_waiter", None)
    page = admin_client.get(reverse("dashboard:run", args=[parent.id])).content.decode()
    assert 'data-live="run-children"' in page and "Child runs" not in page  # its box, empty
    before = render_topic({}, f"run:{parent.id}")
    assert before is not None and before["run-children"].strip() == ""
    WorkflowRun.objects.create(id="late-child", workflow="tests.three_steps", input=1, parent_id=parent.id)
    after = render_topic({}, f"run:{parent.id}")
    assert after is not None and 'data-child="late-child"' in after["run-children"]
    assert reverse("dashboard:run", args=["late-child"]) in after["run-children"]


def test_the_run_state_fragment_flips_when_the_run_finishes(engine: Any, admin_client: Client) -> None:
    run = api.start("tests.signal_waiter", None)
    page = admin_client.get(reverse("dashboard:run", args=[run.id])).content.decode()
    # Every action is in the page, marked with when it shows; the run's state shows them now.
    assert re.search(r'id="cancel-run" data-show-when="unfinished"[^>]*>', page).group(0).count("hidden") == 0
    assert re.search(r'id="retry-form" data-show-when="retryable"[^>]*>', page).group(0).endswith(" hidden>")
    assert re.search(r'id="signal-form" data-show-when="unfinished"[^>]*>', page).group(0).count("hidden") == 0
    assert 'id="retry-run"' in page
    before = render_topic({}, f"run:{run.id}")
    assert before is not None
    assert 'data-run-unfinished="true" data-run-retryable="false"' in before["run-state"]
    api.send_signal(run.id, "approve", None)
    done = render_topic({}, f"run:{run.id}")
    assert done is not None and 'data-run-unfinished="false" data-run-retryable="false"' in done["run-state"]
    page = admin_client.get(reverse("dashboard:run", args=[run.id])).content.decode()
    assert re.search(r'id="cancel-run" data-show-when="unfinished"[^>]*>', page).group(0).endswith(" hidden>")
    assert re.search(r'id="signal-form" data-show-when="unfinished"[^>]*>', page).group(0).endswith(" hidden>")
    cancelled = api.start("tests.signal_waiter", None)
    api.cancel(cancelled.id)
    state = render_topic({}, f"run:{cancelled.id}")
    assert state is not None and 'data-run-unfinished="false" data-run-retryable="true"' in state["run-state"]
    for html in state.values():  # rendered for every tab alike: no token, no user
        assert "csrfmiddlewaretoken" not in html
