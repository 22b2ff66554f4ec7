"""Operations on runs through the Python API, the JSON API and the admin: permissions and audit."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from durable_flow.exceptions import InvalidInput, RunNotFound
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.operations import api

OPERATIONS = ["start_workflowrun", "cancel_workflowrun", "signal_workflowrun"]


def staff_user(name: str, permissions: list[str]) -> Any:
    user = get_user_model().objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="durable_flow", codename__in=permissions)
    )
    return user


def client_for(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post(client: Client, url: str, body: Any = None) -> Any:
    return client.post(url, data=json.dumps(body or {}), content_type="application/json")


def logged(run: WorkflowRun) -> list[str]:
    return list(
        LogEntry.objects.filter(object_id=run.pk, content_type__model="workflowrun").values_list(
            "change_message", flat=True
        )
    )


def test_rerun_starts_the_same_workflow_with_the_same_input_and_links_the_original(engine: Any) -> None:
    original = api.start("tests.three_steps", 5, tags=["t1"])
    again = api.rerun(original.pk, new_run_id="again-1")
    assert (again.pk, again.workflow, again.input, again.rerun_of) == ("again-1", "tests.three_steps", 5, original.pk)
    assert WorkflowRun.objects.get(pk="again-1").status == RunStatus.COMPLETED
    assert api.rerun(original.pk, new_run_id="again-1").pk == "again-1"  # idempotent on the new id
    with pytest.raises(RunNotFound):
        api.rerun("nope")


def test_a_rerun_under_the_id_of_an_unrelated_run_is_refused_and_leaves_that_run_alone(engine: Any) -> None:
    original = api.start("tests.three_steps", 5)
    unrelated = api.start("tests.three_steps", 7, run_id="taken-1")
    with pytest.raises(InvalidInput, match="taken-1"):
        api.rerun(original.pk, new_run_id="taken-1")
    assert WorkflowRun.objects.get(pk=unrelated.pk).rerun_of == ""


def test_json_api_operations_need_their_permission(engine: Any) -> None:
    run = api.start("tests.sleeper", 600, run_id="perm-1")
    bare = client_for(staff_user("bare", []))
    assert post(bare, "/api/runs/", {"workflow": "tests.sleeper"}).status_code == 403
    assert post(bare, "/api/runs/perm-1/cancel/").status_code == 403
    assert post(bare, "/api/runs/perm-1/rerun/").status_code == 403
    assert post(bare, "/api/runs/perm-1/signals/", {"name": "go"}).status_code == 403
    assert bare.get("/api/runs/perm-1/").status_code == 200  # reading needs staff only
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED and WorkflowRun.objects.count() == 1


def test_json_api_signal_rerun_and_cancel_are_audited(engine: Any) -> None:
    waiting = api.start("tests.signal_waiter", {}, run_id="sig-1")
    operator = client_for(staff_user("op", OPERATIONS))
    response = post(operator, "/api/runs/sig-1/signals/", {"name": "approve", "payload": {"ok": True}})
    assert response.status_code == 202
    waiting.refresh_from_db()
    assert waiting.status == RunStatus.COMPLETED and waiting.output == {"got": {"ok": True}}
    rerun = post(operator, "/api/runs/sig-1/rerun/", {"run_id": "sig-2"})
    assert rerun.status_code == 201 and rerun.json()["rerun_of"] == "sig-1"
    assert post(operator, "/api/runs/sig-2/cancel/").json()["status"] == RunStatus.CANCELLED
    assert any("signal 'approve'" in message for message in logged(waiting))
    assert any("Cancelled" in message for message in logged(WorkflowRun.objects.get(pk="sig-2")))
    assert post(operator, "/api/runs/sig-2/signals/", {"name": "x\u0000"}).status_code == 400


def test_admin_is_read_only_and_offers_no_delete_for_live_runs(engine: Any) -> None:
    live = api.start("tests.sleeper", 600)
    done = api.start("tests.three_steps", 1)
    admin = client_for(get_user_model().objects.create_superuser("root", password="pw"))
    page = admin.get(reverse("admin:durable_flow_workflowrun_change", args=[live.pk])).content.decode()
    assert 'name="_save"' not in page and 'name="_continue"' not in page
    assert admin.get(reverse("admin:durable_flow_workflowrun_delete", args=[live.pk])).status_code == 403
    assert admin.get(reverse("admin:durable_flow_workflowrun_delete", args=[done.pk])).status_code == 200
    assert admin.post(reverse("admin:durable_flow_workflowrun_change", args=[live.pk]), {}).status_code == 403


def test_admin_start_form_and_signal_form_write_log_entries(engine: Any) -> None:
    operator = client_for(staff_user("op", ["view_workflowrun", *OPERATIONS]))
    start_url = reverse("admin:durable_flow_workflowrun_start")
    form = operator.get(start_url)
    assert form.status_code == 200 and "tests.signal_waiter" in form.content.decode()
    bad = operator.post(start_url, {"workflow": "tests.signal_waiter", "input": "{not json"})
    assert bad.status_code == 200 and WorkflowRun.objects.count() == 0
    operator.post(start_url, {"workflow": "tests.signal_waiter", "input": "{}", "run_id": "form-1"})
    run = WorkflowRun.objects.get(pk="form-1")
    assert logged(run) == ["Started from the admin"]
    signal_url = reverse("admin:durable_flow_workflowrun_signal", args=["form-1"])
    operator.post(signal_url, {"name": "approve", "payload": '"yes"'})
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == {"got": "yes"}


def test_staff_without_permissions_see_disabled_buttons_and_get_403(engine: Any) -> None:
    run = api.start("tests.sleeper", 600)
    viewer = client_for(staff_user("viewer", ["view_workflowrun"]))
    page = viewer.get(reverse("admin:durable_flow_workflowrun_change", args=[run.pk])).content.decode()
    assert 'aria-disabled="true"' in page and 'id="cancel-run"' not in page
    assert viewer.get(reverse("admin:durable_flow_workflowrun_cancel", args=[run.pk])).status_code == 403
    assert viewer.get(reverse("admin:durable_flow_workflowrun_start")).status_code == 403
