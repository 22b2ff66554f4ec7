"""Bulk cancel / retry by filter: every run the admin's filters match, in batches, with a
confirmation page first, permissions, one LogEntry per run, and a bounded number of queries."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from durable_flow.contrib.admin_bulk import MAX_SHOW_ALL
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, Task, TaskKind, WorkflowRun
from durable_flow.operations import api, bulk
from tests import workflows
from tests.engine_support import transport_of
from tests.support.statements import BULK_ACTION_QUERIES, BULK_TICKED_PAGE_QUERIES, capture

CHANGELIST = "/admin/durable_flow/workflowrun/"


def bulk_url(operation: str, query: str = "") -> str:
    url = reverse("admin:durable_flow_workflowrun_bulk", args=[operation])
    return f"{url}?{query}" if query else url


def user_with(name: str, permissions: list[str]) -> Client:
    user = get_user_model().objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="durable_flow", codename__in=permissions)
    )
    client = Client()
    client.force_login(user)
    return client


def make_runs(count: int, status: str, workflow: str, prefix: str) -> list[str]:
    """`count` runs written directly (no engine), as a busy system would have them."""
    runs = [WorkflowRun(id=f"{prefix}-{i:05d}", workflow=workflow, status=status, input=1) for i in range(count)]
    WorkflowRun.objects.bulk_create(runs, batch_size=1000)
    return [run.id for run in runs]


def statuses(ids: list[str]) -> set[str]:
    return set(WorkflowRun.objects.filter(pk__in=ids).values_list("status", flat=True))


def logged(run_id: str) -> list[str]:
    return list(LogEntry.objects.filter(object_id=run_id).values_list("change_message", flat=True))


# -- the batched operations match the per-run ones --------------------------------------------
def test_bulk_cancel_withdraws_waiters_and_leaves_a_run_with_a_step_executing_cancelling(manual: Engine) -> None:
    api.register_queue("narrow", concurrency=1)
    first = api.start("tests.queued", {"queue": "narrow", "value": 1})
    second = api.start("tests.queued", {"queue": "narrow", "value": 2})
    transport_of(manual).run_turns()
    assert StepCheckpoint.objects.get(run=second).status == StepStatus.WAITING
    result = bulk.cancel_matching(WorkflowRun.objects.all())
    assert (result.done, result.batches) == (2, 1)
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.status == RunStatus.CANCELLING  # its step is executing: cancelled when it lands
    assert second.status == RunStatus.CANCELLED and second.error == {"type": "Cancelled", "message": "cancelled"}
    assert StepCheckpoint.objects.get(run=second).status == StepStatus.CANCELLED
    assert manual.admission.waiting("narrow") == 0  # the waiter left the queue's line
    transport_of(manual).run_all()  # the executing step lands: ignored, the run is cancelled
    first.refresh_from_db()
    assert first.status == RunStatus.CANCELLED


def test_bulk_cancel_takes_children_with_their_parent_and_tells_a_live_parent(manual: Engine) -> None:
    parent = api.start("tests.child_parent", 1)
    transport_of(manual).run_turns()
    child = WorkflowRun.objects.get(parent=parent)
    bulk.cancel_matching(WorkflowRun.objects.filter(pk=child.pk))  # only the child: its parent is live
    transport_of(manual).run_all()
    parent.refresh_from_db()
    assert WorkflowRun.objects.get(pk=child.pk).status in (RunStatus.CANCELLING, RunStatus.CANCELLED)
    assert parent.status == RunStatus.FAILED  # the parent saw its child call fail, as with api.cancel

    other = api.start("tests.child_fan", {"n": 3})
    transport_of(manual).run_turns()
    bulk.cancel_matching(WorkflowRun.objects.filter(pk=other.pk))
    children = list(WorkflowRun.objects.filter(parent=other).values_list("pk", flat=True))
    assert len(children) == 3
    assert statuses([other.pk, *children]) <= {RunStatus.CANCELLED, RunStatus.CANCELLING}


def test_bulk_retry_resumes_failed_runs_and_refuses_a_changed_version(engine: Engine) -> None:
    workflows.FAILURES_LEFT.update({"b1": 1, "b2": 1})
    runs = [api.start("tests.step_then_flaky", key) for key in ("b1", "b2")]
    WorkflowRun.objects.filter(pk=runs[1].pk).update(version="0")
    result = bulk.retry_matching(WorkflowRun.objects.filter(workflow="tests.step_then_flaky"))
    assert result.done == 1 and len(result.refused) == 1 and "version" in result.refused[0]
    assert WorkflowRun.objects.get(pk=runs[0].pk).status == RunStatus.COMPLETED
    assert WorkflowRun.objects.get(pk=runs[1].pk).status == RunStatus.FAILED


def test_bulk_retry_retries_a_failed_child_with_its_parent(engine: Engine) -> None:
    workflows.FAILURES_LEFT["bc"] = 1
    parent = api.start("tests.parent_of_flaky", "bc")
    assert WorkflowRun.objects.get(pk=parent.pk).status == RunStatus.FAILED
    assert bulk.retry_matching(WorkflowRun.objects.filter(parent=None)).done == 1
    assert WorkflowRun.objects.get(pk=parent.pk).status == RunStatus.COMPLETED


def test_bulk_retry_refuses_a_run_over_its_start_quota(engine: Engine) -> None:
    payload = {"tenant": "acme", "seconds": 600}
    api.start("tests.quota_sleeper", payload, run_id="q1")
    api.cancel("q1")  # mid-sleep: its slot frees
    api.start("tests.quota_sleeper", payload, run_id="q2")
    result = bulk.retry_matching(WorkflowRun.objects.filter(pk="q1"))
    assert result.done == 0 and len(result.refused) == 1 and "sleeper:acme" in result.refused[0]
    assert WorkflowRun.objects.get(pk="q1").status == RunStatus.CANCELLED


def test_bulk_retry_of_a_run_cancelled_waiting_for_a_signal_waits_for_it_again(engine: Engine) -> None:
    run = api.start("tests.signal_waiter", None)
    api.cancel(run.pk)
    assert bulk.retry_matching(WorkflowRun.objects.filter(pk=run.pk)).done == 1
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED
    api.send_signal(run.pk, "approve", "late")
    assert WorkflowRun.objects.get(pk=run.pk).output == {"got": "late"}


# -- the admin: by filter, confirmation first, batches, bounded queries ------------------------
def test_cancel_all_matching_confirms_the_count_then_cancels_in_batches(db_transport_engine: Engine) -> None:
    target = make_runs(1_600, RunStatus.PENDING, "tests.sleeper", "target")
    other_workflow = make_runs(40, RunStatus.PENDING, "tests.three_steps", "other")
    done = make_runs(30, RunStatus.COMPLETED, "tests.sleeper", "done")
    admin = user_with("op", ["view_workflowrun", "cancel_workflowrun"])
    query = "workflow=tests.sleeper"

    listing = admin.get(f"{CHANGELIST}?{query}").content.decode()
    assert 'id="bulk-cancel"' in listing and bulk_url("cancel", query).replace("&", "&amp;") in listing
    page = admin.get(bulk_url("cancel", query))
    assert page.status_code == 200
    assert page.context["count"] == 1_600 and page.context["total"] == 1_630
    assert statuses(target) == {RunStatus.PENDING}  # a GET changes nothing

    with capture() as queries:
        response = admin.post(bulk_url("cancel", query))
    assert response.status_code == 302 and response["Location"] == f"{CHANGELIST}?{query}"
    assert statuses(target) == {RunStatus.CANCELLED}
    assert statuses(other_workflow) == {RunStatus.PENDING} and statuses(done) == {RunStatus.COMPLETED}
    # Four batches of at most 500, each a fixed handful of queries: not one (or ten) per run.
    assert len(queries) < BULK_ACTION_QUERIES, len(queries)
    assert LogEntry.objects.filter(change_message="Cancelled (bulk, by filter)").count() == 1_600
    assert logged(target[0]) == ["Cancelled (bulk, by filter)"]


def test_retry_all_matching_requeues_every_failed_run_with_one_insert_per_batch(db_transport_engine: Engine) -> None:
    failed = make_runs(1_200, RunStatus.FAILED, "tests.three_steps", "failed")
    pending = make_runs(20, RunStatus.PENDING, "tests.three_steps", "live")
    admin = user_with("op", ["view_workflowrun", "retry_workflowrun"])
    assert admin.get(bulk_url("retry", "workflow=tests.three_steps")).context["count"] == 1_200
    with capture() as queries:
        admin.post(bulk_url("retry", "workflow=tests.three_steps"))
    assert len(queries) < BULK_ACTION_QUERIES, len(queries)
    assert statuses(failed) == {RunStatus.PENDING} and statuses(pending) == {RunStatus.PENDING}
    turns = Task.objects.filter(kind=TaskKind.TURN, run_id__in=failed)
    assert turns.count() == 1_200  # each retried run has its turn queued for a worker


def test_select_all_across_pages_with_the_cancel_action_goes_to_the_confirmation_page(
    db_transport_engine: Engine,
) -> None:
    ids = make_runs(150, RunStatus.PENDING, "tests.sleeper", "across")
    admin = user_with("op", ["view_workflowrun", "cancel_workflowrun"])
    response = admin.post(
        f"{CHANGELIST}?status=pending",
        {"action": "cancel_selected", "select_across": "1", "index": "0", "_selected_action": ids[:100]},
    )
    assert response.status_code == 302 and response["Location"] == bulk_url("cancel", "status=pending")
    assert statuses(ids) == {RunStatus.PENDING}


def test_ticked_rows_are_cancelled_in_batches_and_a_full_page_stays_under_the_field_limit(
    db_transport_engine: Engine,
) -> None:
    ids = make_runs(MAX_SHOW_ALL, RunStatus.PENDING, "tests.sleeper", "ticked")
    assert MAX_SHOW_ALL + 10 < settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
    admin = user_with("op", ["view_workflowrun", "cancel_workflowrun"])
    with capture() as queries:
        response = admin.post(
            f"{CHANGELIST}?all=",
            {"action": "cancel_selected", "select_across": "0", "index": "0", "_selected_action": ids},
        )
    assert response.status_code == 302
    assert statuses(ids) == {RunStatus.CANCELLED}
    assert len(queries) < BULK_TICKED_PAGE_QUERIES, len(queries)


def test_bulk_needs_the_operations_permission(db_transport_engine: Engine) -> None:
    ids = make_runs(5, RunStatus.FAILED, "tests.three_steps", "perm")
    viewer = user_with("viewer", ["view_workflowrun"])
    assert 'id="bulk-cancel"' not in viewer.get(CHANGELIST).content.decode()
    for operation in ("cancel", "retry"):
        assert viewer.get(bulk_url(operation)).status_code == 403
        assert viewer.post(bulk_url(operation)).status_code == 403
    canceller = user_with("canceller", ["view_workflowrun", "cancel_workflowrun"])
    assert canceller.post(bulk_url("retry")).status_code == 403
    assert statuses(ids) == {RunStatus.FAILED}


@pytest.mark.parametrize(
    "query", ["created_at__year=99999999999999999999", "nonsense__field=1", "status__in=%00", "q=%00"]
)
def test_bad_filters_are_a_400_with_a_message_and_change_nothing(db_transport_engine: Engine, query: str) -> None:
    ids = make_runs(3, RunStatus.PENDING, "tests.sleeper", "bad")
    admin = user_with("op", ["view_workflowrun", "cancel_workflowrun"])
    page = admin.get(bulk_url("cancel", query))
    done = admin.post(bulk_url("cancel", query))
    if page.status_code == 200:  # a filter the database takes, matching nothing: nothing to do
        assert page.context["count"] == 0 and done.status_code == 302
    else:
        assert page.status_code == done.status_code == 400
        assert b"not valid" in page.content and b"not valid" in done.content
    assert statuses(ids) == {RunStatus.PENDING}


def test_an_unknown_bulk_operation_is_a_404(db_transport_engine: Engine) -> None:
    admin = user_with("op", ["view_workflowrun", "cancel_workflowrun"])
    assert admin.get(bulk_url("delete")).status_code == 404
