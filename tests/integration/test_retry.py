"""Retry: a failed or cancelled run resumes from where it stopped, keeping what completed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client

from durable_flow.exceptions import RetryRefused
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.operations import api
from tests import workflows
from tests.conftest import executed


def failed_run(key: str) -> WorkflowRun:
    workflows.FAILURES_LEFT[key] = 1
    run = api.start("tests.step_then_flaky", key)
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    return run


def test_retry_resumes_a_failed_run_keeping_its_completed_steps(engine: Any) -> None:
    run = failed_run("r1")
    api.retry(run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == "ok r1" and run.error is None
    assert executed("echo") == ["r1"]  # the completed step was not run again
    assert executed("flaky") == ["r1", "r1"]
    flaky_cp = StepCheckpoint.objects.get(run=run, key="2")
    assert (flaky_cp.status, flaky_cp.attempt) == (StepStatus.COMPLETED, 2)


def test_retry_of_a_cancelled_run_starts_its_sleep_over(engine: Any, clock: Any) -> None:
    run = api.start("tests.sleeper", 600)
    api.cancel(run.id)
    clock.advance(seconds=30)
    api.retry(run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED and run.wake_at == clock() + timedelta(seconds=600)


def test_retry_retries_a_failed_child_with_its_parent(engine: Any) -> None:
    workflows.FAILURES_LEFT["c1"] = 1
    parent = api.start("tests.parent_of_flaky", "c1")
    parent.refresh_from_db()
    assert parent.status == RunStatus.FAILED
    api.retry(parent.id)
    parent.refresh_from_db()
    assert parent.status == RunStatus.COMPLETED and parent.output == {"child": "ok c1"}
    assert WorkflowRun.objects.get(parent=parent).status == RunStatus.COMPLETED


@pytest.mark.parametrize("status", [RunStatus.COMPLETED, RunStatus.SUSPENDED])
def test_retry_refuses_a_run_that_is_not_failed_or_cancelled(engine: Any, status: str) -> None:
    run = api.start("tests.sleeper", 600) if status == RunStatus.SUSPENDED else api.start("tests.three_steps", 1)
    with pytest.raises(RetryRefused, match=status):
        api.retry(run.id)


def test_retry_refuses_a_run_whose_workflow_version_changed(engine: Any) -> None:
    run = failed_run("r2")
    WorkflowRun.objects.filter(pk=run.pk).update(version="0")
    with pytest.raises(RetryRefused, match="version"):
        api.retry(run.id)
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.FAILED


def test_retry_over_http_needs_its_permission_and_is_audited(engine: Any) -> None:
    run = failed_run("r3")
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.post(f"/api/runs/{run.id}/retry/").status_code == 403
    user.user_permissions.add(Permission.objects.get(codename="retry_workflowrun"))
    response = client.post(f"/api/runs/{run.id}/retry/")
    assert response.status_code == 200 and response.json()["status"] == RunStatus.COMPLETED
    assert client.post(f"/api/runs/{run.id}/retry/").status_code == 400  # completed now: refused
    assert LogEntry.objects.filter(object_id=run.id, change_message__contains="Retried").exists()


def test_retry_from_the_admin_detail_page(engine: Any) -> None:
    run = failed_run("r4")
    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root", password="pw"))
    page = admin.get(f"/admin/durable_flow/workflowrun/{run.id}/change/").content.decode()
    assert 'id="retry-run"' in page
    admin.post(f"/admin/durable_flow/workflowrun/{run.id}/retry/")
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert 'id="retry-run"' not in admin.get(f"/admin/durable_flow/workflowrun/{run.id}/change/").content.decode()


# -- a wait cancelled before its signal came waits again -----------------------------------------
def test_retry_of_a_run_cancelled_waiting_for_a_signal_waits_for_it_again(engine: Any) -> None:
    run = api.start("tests.signal_waiter", None)
    api.cancel(run.id)
    api.retry(run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED and run.output is None
    api.send_signal(run.id, "approve", {"ok": True})
    run.refresh_from_db()
    assert (run.status, run.output) == (RunStatus.COMPLETED, {"got": {"ok": True}})


def test_retry_of_a_signal_wait_with_a_timeout_starts_the_timeout_over(engine: Any, clock: Any) -> None:
    run = api.start("tests.signal_waiter", 600)
    api.cancel(run.id)
    clock.advance(seconds=30)
    api.retry(run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED and run.wake_at == clock() + timedelta(seconds=600)


def test_retry_consumes_a_signal_that_arrived_before_the_cancel(manual: Any) -> None:
    from tests.engine_support import transport_of

    transport = transport_of(manual)
    run = api.start("tests.signal_waiter", None)
    transport.run_turns()
    api.send_signal(run.id, "approve", "early")  # kept; the turn that would consume it is queued
    api.cancel(run.id)
    transport.run_turns()  # that turn finds the run cancelled
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.CANCELLED
    api.retry(run.id)
    transport.run_turns()
    run.refresh_from_db()
    assert (run.status, run.output) == (RunStatus.COMPLETED, {"got": "early"})
