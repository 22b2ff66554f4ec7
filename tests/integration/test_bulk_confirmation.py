"""What an operator reads around a bulk cancel or retry, on the dashboard and in the admin: the
confirmation says the filter in words, warns when there is none (every unfinished run), and the
result counts the runs done, skipped (finished on their own since the confirmation) and failed,
and says why they differ from the count confirmed."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.http import QueryDict
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from durable_flow.engine import Engine
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.observe.run_filters import RunFilterForm
from durable_flow.operations import bulk
from durable_flow_dashboard.bulk_views import filter_words

ADMIN_BULK = "/admin/durable_flow/workflowrun/bulk/"


def operator(permissions: tuple[str, ...] = ("view_workflowrun", "cancel_workflowrun", "retry_workflowrun")) -> Client:
    user = get_user_model().objects.create_user("op", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="durable_flow", codename__in=permissions)
    )
    client = Client()
    client.force_login(user)
    return client


def make(prefix: str, count: int, status: str = RunStatus.PENDING, workflow: str = "tests.sleeper") -> list[str]:
    # Created a little before the confirmation, as runs listed on a page are.
    created = timezone.now() - timedelta(seconds=30)
    runs = [
        WorkflowRun(id=f"{prefix}-{i:03d}", workflow=workflow, status=status, input=i, created_at=created)
        for i in range(count)
    ]
    WorkflowRun.objects.bulk_create(runs)
    WorkflowRun.objects.filter(pk__in=[r.id for r in runs]).update(created_at=created)  # auto_now_add
    return [run.id for run in runs]


def finish(ids: list[str]) -> None:
    """These runs complete on their own (a worker), after the confirmation was shown."""
    WorkflowRun.objects.filter(pk__in=ids).update(status=RunStatus.COMPLETED, finished_at=timezone.now())


def confirmed_at(html: str) -> str:
    found = re.search(r'name="confirmed_at" value="([^"]+)"', html)
    assert found, "the confirmation form sends back when it was shown"
    return found.group(1)


def said(response: object) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]  # type: ignore[attr-defined]


def test_the_dashboard_confirmation_says_the_filter_in_words(db_transport_engine: Engine) -> None:
    make("w", 3)
    query = "?status=pending&workflow=tests.sleeper&range=1h"
    page = operator().get(reverse("dashboard:bulk", args=["cancel"]) + query)
    html = page.content.decode()
    assert page.status_code == 200 and 'id="bulk-everything"' not in html
    words = re.search(r'<ul class="filter-words" id="bulk-filter">(.*?)</ul>', html, re.S)
    assert words is not None
    assert re.findall(r"<li>(.*?)</li>", words.group(1)) == [
        "status is pending",
        "workflow is tests.sleeper",
        "started in the last 1h",
    ]
    assert '<b id="bulk-count">3</b>' in html


def test_with_no_filter_the_dashboard_warns_that_this_is_every_unfinished_run(db_transport_engine: Engine) -> None:
    make("all", 4)
    make("old", 2, RunStatus.COMPLETED)
    client = operator()
    html = client.get(reverse("dashboard:bulk", args=["cancel"])).content.decode()
    assert "No filter: this is all unfinished runs (4)." in html
    assert 'id="bulk-filter"' not in html
    html = client.get(reverse("dashboard:bulk", args=["retry"])).content.decode()
    assert "No filter: this is all failed or cancelled runs (0)." in html


def test_the_dashboard_result_counts_runs_that_finished_in_between(db_transport_engine: Engine) -> None:
    ids = make("between", 10)
    client = operator()
    url = reverse("dashboard:bulk", args=["cancel"]) + "?status=pending&workflow=tests.sleeper"
    page = client.get(url)
    assert '<b id="bulk-count">10</b>' in page.content.decode()
    finish(ids[:3])  # three finish on their own while the operator reads the page
    late = make("late", 1)  # and one starts after it: not among the runs confirmed
    WorkflowRun.objects.filter(pk__in=late).update(created_at=timezone.now() + timedelta(seconds=1))
    response = client.post(url, {"confirmed_at": confirmed_at(page.content.decode())})
    assert response.status_code == 302
    message = said(response)[0]
    assert message.startswith("Cancel: 7 done, 3 already finished.")
    assert "ended on their own after you confirmed" in message
    assert WorkflowRun.objects.filter(pk__in=ids[3:], status=RunStatus.CANCELLED).count() == 7
    assert WorkflowRun.objects.filter(pk__in=ids[:3], status=RunStatus.COMPLETED).count() == 3
    assert WorkflowRun.objects.get(pk=late[0]).status == RunStatus.PENDING


def test_a_bad_confirmation_time_is_a_400_and_changes_nothing(db_transport_engine: Engine) -> None:
    ids = make("bad", 2)
    client = operator()
    url = reverse("dashboard:bulk", args=["cancel"])
    for value in ("yesterday", "2026-13-45T00:00:00+00:00", "2026-01-01T00:00:00", "2999-01-01T00:00:00+00:00"):
        assert client.post(url, {"confirmed_at": value}).status_code == 400
    assert set(WorkflowRun.objects.filter(pk__in=ids).values_list("status", flat=True)) == {RunStatus.PENDING}


def test_the_admin_warns_without_a_filter_and_counts_runs_finished_in_between(db_transport_engine: Engine) -> None:
    ids = make("adm", 6)
    client = operator()
    html = client.get(f"{ADMIN_BULK}cancel/").content.decode()
    assert "No filter: this is all unfinished runs (6)." in html
    page = client.get(f"{ADMIN_BULK}cancel/?status__exact=pending")
    assert 'id="bulk-everything"' not in page.content.decode()
    finish(ids[:2])
    response = client.post(
        f"{ADMIN_BULK}cancel/?status__exact=pending", {"confirmed_at": confirmed_at(page.content.decode())}
    )
    assert response.status_code == 302
    assert said(response)[0].startswith("Cancel: 4 done, 2 already finished (in 1 batch(es)).")


def test_a_retry_counts_runs_no_longer_failed_when_their_batch_locks_them(db_transport_engine: Engine) -> None:
    ids = make("rt", 3, RunStatus.FAILED, "tests.three_steps")
    confirmed = timezone.now()
    # Between the listing and the lock: one is retried by someone else.
    WorkflowRun.objects.filter(pk=ids[0]).update(status=RunStatus.PENDING)
    done, refused, skipped = bulk.retry_batch(ids)
    assert (done, refused, skipped) == (2, [], 1)
    result = bulk.retry_matching(WorkflowRun.objects.filter(pk__in=ids), confirmed_at=confirmed)
    assert result.done == 0 and result.skipped == 0  # nothing failed is left to retry
    assert bulk.BulkResult(done=2, skipped=1, refused=["r"]).summary("Retry") == (
        "Retry: 2 done, 1 no longer failed or cancelled, 1 failed."
    )


def test_a_waiting_filter_is_said_in_words_not_taken_for_no_filter(db_transport_engine: Engine) -> None:
    make("w", 2)
    html = operator().get(reverse("dashboard:bulk", args=["cancel"]) + "?waiting=cap").content.decode()
    assert "waiting because of the queue&#x27;s cap" in html or "waiting because of the queue's cap" in html
    assert 'id="bulk-everything"' not in html and "No filter" not in html
    assert '<b id="bulk-count">0</b>' in html  # none of them is parked behind a cap


@pytest.mark.parametrize(
    "query",
    [
        "q=abc",
        "status=failed",
        "workflow=w",
        "queue=emails",
        "tag=t",
        "waiting=cap",
        "key=cust-7",
        "key_scope=fn",
        "range=1h",
        "since=2026-01-01T00:00",
        "until=2026-01-01T00:00",
    ],
)
def test_every_filter_field_is_said_in_words_so_none_reads_as_no_filter(query: str) -> None:
    """Each field that narrows the list has a phrase: a filter the page did not put in words
    would be confirmed under the "No filter: all unfinished runs" warning."""
    form = RunFilterForm(QueryDict(query))
    assert form.is_valid(), form.errors
    assert filter_words(form.cleaned_data)


def test_every_narrowing_field_of_the_form_is_in_the_parametrized_list() -> None:
    said = {"q", "status", "workflow", "queue", "tag", "waiting", "key", "key_scope", "range", "since", "until"}
    assert set(RunFilterForm.base_fields) - said == {"in_input"}  # only widens `q`


def test_the_input_search_is_said_only_when_asked() -> None:
    plain = RunFilterForm(QueryDict("q=abc"))
    inside = RunFilterForm(QueryDict("q=abc&in_input=on"))
    assert plain.is_valid() and inside.is_valid()
    assert filter_words(plain.cleaned_data) == ["run id starting with “abc”"]
    assert filter_words(inside.cleaned_data) == ["run id starting with “abc”, or input containing it"]


def test_the_confirmation_is_a_live_topic_whose_count_and_sample_follow_the_runs(
    db_transport_engine: Engine,
) -> None:
    from durable_flow_dashboard import consumers  # noqa: F401 - the consumer registers the topic
    from durable_flow_dashboard.live import canonical_topic, render_topic

    ids = make("live", 12)
    topic = canonical_topic("bulk:cancel:workflow=tests.sleeper&q=&status=pending")
    assert topic == "bulk:cancel:status=pending&workflow=tests.sleeper"  # one spelling: one group
    before = render_topic({}, topic)
    assert before is not None and set(before) == {"bulk-heading", "bulk-matching", "bulk-button"}
    assert before["bulk-heading"].strip() == "Cancel 12 runs?"
    assert '<b id="bulk-count">12</b>' in before["bulk-matching"]
    assert before["bulk-matching"].count("data-run=") == 10
    assert "The newest 10 runs it selects now:" in before["bulk-matching"]
    assert "Cancel 12 runs</button>" in before["bulk-button"]
    finish(ids[:9])  # nine finish on their own while the page is open
    after = render_topic({}, topic)
    assert after is not None and '<b id="bulk-count">3</b>' in after["bulk-matching"]
    assert sorted(re.findall(r'<tr data-run="([^"]+)"', after["bulk-matching"])) == ids[9:]
    assert "Cancel 3 runs</button>" in after["bulk-button"]
    finish(ids[9:])
    none = render_topic({}, topic)
    assert none is not None and "disabled" in none["bulk-button"] and "No run matches now." in none["bulk-matching"]
    for refused in ("bulk:explode:", "bulk:cancel:status=nope", "bulk:retry:since=yesterday"):
        assert canonical_topic(refused) is None


def test_a_post_confirmed_at_a_ticks_time_acts_on_the_count_that_tick_showed(db_transport_engine: Engine) -> None:
    ids = make("tick", 10)
    client = operator()
    url = reverse("dashboard:bulk", args=["cancel"]) + "?status=pending&workflow=tests.sleeper"
    html = client.get(url).content.decode()
    assert 'name="confirmed_at"' in html and "data-live-at" in html  # live.js moves it to each tick's time
    assert 'data-live-topic="bulk:cancel:status=pending&amp;workflow=tests.sleeper"' in html
    finish(ids[:4])
    shown_at = timezone.now().isoformat()  # a tick's time: its count was 6
    response = client.post(url, {"confirmed_at": shown_at})
    assert said(response)[0] == "Cancel: 6 done."  # the four finished before it were not in its count
    assert WorkflowRun.objects.filter(pk__in=ids[4:], status=RunStatus.CANCELLED).count() == 6
