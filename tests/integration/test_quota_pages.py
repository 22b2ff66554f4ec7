"""The quota page: every declared start quota with its limit (shown while nothing runs), and the
history of refused starts (workflow, key, time, active/limit) kept for
`POLLER["REFUSAL_RETENTION_S"]`, filtered by workflow and key, live."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable_flow import ConcurrencyLimitError
from durable_flow.engine import Engine
from durable_flow.models import QuotaRefusal, StartRefusal, WorkflowRun
from durable_flow.operations import api
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store import quotas as quota_store
from durable_flow_dashboard.live import render_topic
from durable_flow_dashboard.snapshot import snapshot
from tests.conftest import MovableClock

SLEEPER = "tests.quota_sleeper"  # quota: key "sleeper:" + input.tenant, limit 1


def sleeper(tenant: str, run_id: str, **kwargs: Any) -> WorkflowRun:
    return api.start(SLEEPER, {"tenant": tenant, "seconds": 600}, run_id=run_id, **kwargs)


def refuse(tenant: str, run_id: str, **kwargs: Any) -> ConcurrencyLimitError:
    with pytest.raises(ConcurrencyLimitError) as info:
        sleeper(tenant, run_id, **kwargs)
    return info.value


def row_of(html: str, workflow: str) -> str:
    """The declared-quota table's row of `workflow`."""
    match = re.search(rf'<tr data-workflow="{re.escape(workflow)}">(.*?)</tr>', html, re.DOTALL)
    assert match, f"no row for {workflow}"
    return match.group(1)


def test_a_refused_start_is_kept_with_its_workflow_key_time_and_count(engine: Engine) -> None:
    sleeper("acme", "s1")
    before = timezone.now()
    refuse("acme", "s2")
    refuse("acme", "s3", quota={"key": "sleeper:acme", "limit": 1})  # a per-start quota, same key
    rows = list(StartRefusal.objects.order_by("id").values_list("workflow", "key", "active", "limit"))
    assert rows == [(SLEEPER, "sleeper:acme", 1, 1)] * 2
    assert all(before <= at <= timezone.now() for at in StartRefusal.objects.values_list("at", flat=True))
    assert not WorkflowRun.objects.filter(pk__in=["s2", "s3"]).exists()


def test_a_refused_retry_is_kept_too(engine: Engine) -> None:
    sleeper("acme", "s1")
    api.cancel("s1")
    sleeper("acme", "s2")
    with pytest.raises(ConcurrencyLimitError):
        api.retry("s1")
    assert list(StartRefusal.objects.values_list("workflow", "key", "active", "limit")) == [
        (SLEEPER, "sleeper:acme", 1, 1)
    ]


def test_the_poller_deletes_refusals_past_the_retention_in_batches(manual: Engine, clock: MovableClock) -> None:
    sleeper("acme", "s1")
    refuse("acme", "s2")  # at the real now, which the clock started from
    old = clock() - timedelta(days=30)
    StartRefusal.objects.bulk_create(
        [
            StartRefusal(workflow=SLEEPER, key="k", at=old, active=1, limit=1)
            for _ in range(2 * quota_store.PRUNE_BATCH + 5)
        ]
    )
    QuotaRefusal.objects.create(key="k", minute=old.replace(second=0, microsecond=0), refusals=3)
    poller = TimerPoller(manual)
    retention = manual.settings.refusal_retention_s
    assert retention == 7 * 86_400  # the default

    clock.advance(seconds=retention - 60)  # a minute short of the retention: only the old rows go
    poller.maintain()
    assert list(StartRefusal.objects.values_list("key", flat=True)) == ["sleeper:acme"]
    assert list(QuotaRefusal.objects.values_list("key", flat=True)) == ["sleeper:acme"]

    clock.advance(seconds=120)  # past it
    poller.maintain()
    assert not StartRefusal.objects.exists() and not QuotaRefusal.objects.exists()


def test_declared_limits_show_while_nothing_runs(engine: Engine, admin_client: Any) -> None:
    page = admin_client.get("/dashboard/quotas/")
    assert page.status_code == 200
    row = row_of(page.content.decode(), SLEEPER)
    assert '"sleeper:" + input.tenant' in row.replace("&quot;", '"')
    assert re.search(r'class="limit num"[^>]*>1<', row)
    assert "none now (0 / 1)" in row


def test_keys_in_use_and_refusals_show_in_user_terms_and_filter(engine: Engine, admin_client: Any) -> None:
    sleeper("acme", "s1")
    sleeper("globex", "g1")
    refuse("acme", "s2")
    html = admin_client.get("/dashboard/quotas/").content.decode()
    row = row_of(html, SLEEPER)
    assert re.search(r'class="limit num"[^>]*>1<', row)
    for key in ("sleeper:acme", "sleeper:globex"):  # two keys in use, each at its limit
        assert re.search(rf'<li data-key="{key}">.*?class="key-usage">1 / 1<', row)
    assert re.search(r'class="refused num"[^>]*><a [^>]*>1</a>', row)
    history = html[html.index('id="quota-refusals"') :]
    assert history.count("data-refusal=") == 1
    assert re.search(r'class="usage num"[^>]*>1 / 1<', history)

    only_globex = admin_client.get("/dashboard/quotas/", {"key": "sleeper:globex"}).content.decode()
    assert "data-refusal=" not in only_globex[only_globex.index('id="quota-refusals"') :]
    by_workflow = admin_client.get("/dashboard/quotas/", {"workflow": SLEEPER, "key": "sleeper:acme"}).content.decode()
    assert by_workflow[by_workflow.index('id="quota-refusals"') :].count("data-refusal=") == 1
    assert admin_client.get("/dashboard/quotas/", {"key": "a\x00b"}).status_code == 400


def test_the_quota_page_is_a_live_topic_under_its_filter(engine: Engine) -> None:
    sleeper("acme", "s1")
    refuse("acme", "s2")
    snap = snapshot()
    everything = render_topic(snap, "quotas:")
    assert everything is not None and "data-refusal=" in everything["quota-refusals"]
    declared = row_of(everything["quota-declared"], SLEEPER)
    assert re.search(r'class="refused num"[^>]*><a [^>]*>1</a>', declared)
    other = render_topic(snap, "quotas:key=sleeper%3Aglobex")
    assert other is not None and "data-refusal=" not in other["quota-refusals"]
    # The chart counts the refusal in its minute.
    assert "refused / min" in everything["quota-refusals"]


def test_the_overview_shows_an_idle_refused_keys_limit_not_a_dash(engine: Engine, admin_client: Any) -> None:
    sleeper("acme", "s1")
    refuse("acme", "s2")
    api.cancel("s1")  # nothing of the key is active now; its refusal is in the last minute
    html = admin_client.get("/").content.decode()
    row = re.search(r'<tr data-quota="sleeper:acme">(.*?)</tr>', html, re.DOTALL)
    assert row and re.search(r'class="active num">0 / 1<', row.group(1))
    assert 'href="/dashboard/quotas/"' in html


def test_the_admin_lists_refused_starts_read_only(engine: Engine, admin_client: Any) -> None:
    sleeper("acme", "s1")
    refuse("acme", "s2")
    page = admin_client.get("/admin/durable_flow/startrefusal/", {"q": "sleeper:acme"})
    assert page.status_code == 200
    assert [(r.workflow, r.key) for r in page.context["cl"].result_list] == [(SLEEPER, "sleeper:acme")]
    assert admin_client.get("/admin/durable_flow/startrefusal/add/").status_code == 403


def test_the_refusal_chart_counts_the_workflow_picked(engine: Engine, admin_client: Any) -> None:
    from durable_flow.observe.quotas import refusals_per_minute

    sleeper("acme", "s1")
    refuse("acme", "s2")
    refuse("acme", "s3")
    # Another workflow refused under the same key (a per-start quota): the key's count holds both.
    with pytest.raises(ConcurrencyLimitError):
        api.start("tests.echo_flow", 1, run_id="e1", quota={"key": "sleeper:acme", "limit": 1})
    now = timezone.now()

    def total(**scope: str) -> float:
        return sum(n for _, n in refusals_per_minute(now, **scope))

    assert total() == total(key="sleeper:acme") == 3
    assert total(workflow=SLEEPER) == total(workflow=SLEEPER, key="sleeper:acme") == 2
    assert total(workflow="tests.echo_flow") == 1
    assert total(workflow=SLEEPER, key="sleeper:globex") == 0
    assert [at for at, _ in refusals_per_minute(now, workflow=SLEEPER)] == [at for at, _ in refusals_per_minute(now)]
    # Its workflow declares no quota, and can be picked all the same.
    assert "<option>tests.echo_flow</option>" in admin_client.get("/dashboard/quotas/").content.decode()
    html = admin_client.get("/dashboard/quotas/", {"workflow": "tests.echo_flow"}).content.decode()
    assert "Refused starts per minute over the last hour, workflow tests.echo_flow" in html
    assert "<option selected>tests.echo_flow</option>" in html  # the picker keeps the choice
    live = render_topic(snapshot(), "quotas:workflow=tests.echo_flow")
    assert live is not None and "over the last hour, workflow tests.echo_flow<" in live["quota-refusals"]
