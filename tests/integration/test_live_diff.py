"""The live feed sends only what changed: the broadcaster renders each topic once per tick and
sends its group only the fragments whose content differs from the last tick's (none when
nothing changed), while a tab that joins gets every fragment once. Counted on the in-memory
channel layer, with the run list's topic (`runs:<query>`) over real rows."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone

from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.operations import api
from durable_flow_dashboard import live
from tests.conftest import wait_for

TOPIC = "runs:workflow=tests.diff"


def _runs() -> None:
    done = timezone.now() - timedelta(minutes=1)
    for i, status in enumerate((RunStatus.FAILED, RunStatus.COMPLETED)):
        WorkflowRun.objects.create(
            id=f"diff-{i}", workflow="tests.diff", status=status, input=i, finished_at=done, error=None
        )


def _finish(run_id: str) -> None:
    WorkflowRun.objects.filter(pk=run_id).update(status=RunStatus.COMPLETED)


@pytest.mark.django_db(transaction=True)
def test_a_tick_sends_only_the_fragments_that_changed() -> None:
    _runs()
    broadcaster = live.Broadcaster()
    broadcaster.subscribers[TOPIC] = 2  # two tabs, one group

    async def go() -> list[dict[str, Any]]:
        layer = get_channel_layer()
        tabs = [await layer.new_channel() for _ in range(2)]
        for tab in tabs:
            await layer.group_add(live.group_name(TOPIC), tab)
        received = []
        for change in (None, None, lambda: _finish("diff-0")):
            if change is not None:
                await database_sync_to_async(change)()
            await broadcaster.tick()
            messages = [(await layer.receive(tab))["data"] for tab in tabs]
            assert messages[0] == messages[1]  # one rendering, sent to the group
            received.append(messages[0])
        return received

    first, unchanged, finished = async_to_sync(go)()
    assert broadcaster.computed == 3  # once per tick, not once per tab
    assert set(first["fragments"]) == {"runs-count", "runs-table"}  # the first tick: everything
    assert 's-failed">failed' in first["fragments"]["runs-table"]
    assert unchanged["fragments"] == {} and not unchanged["gone"]  # nothing changed: nothing sent
    # One run finished: its row changed, the count did not.
    assert set(finished["fragments"]) == {"runs-table"}
    assert "s-failed" not in finished["fragments"]["runs-table"]
    assert broadcaster.sent_fragments == 3
    # A tab joining now gets every fragment, as they are now.
    joined = broadcaster.joined(TOPIC)
    assert joined is not None and set(joined["fragments"]) == {"runs-count", "runs-table"}
    assert "s-failed" not in joined["fragments"]["runs-table"]


@pytest.mark.django_db(transaction=True)
def test_a_quiet_tick_with_an_unfinished_run_on_the_page_sends_no_fragment() -> None:
    _runs()
    WorkflowRun.objects.create(id="diff-running", workflow="tests.diff", status=RunStatus.RUNNING, input=2)
    broadcaster = live.Broadcaster()
    broadcaster.subscribers[TOPIC] = 1

    def tick() -> dict[str, Any]:
        at, rendered = live.compute_tick([TOPIC])
        return broadcaster.changes(TOPIC, rendered[TOPIC], at)

    first = tick()
    row = first["fragments"]["runs-table"].split('data-run="diff-running"')[1].split("</tr>")[0]
    started = WorkflowRun.objects.get(pk="diff-running").created_at
    # Its duration runs to now: the row gives its start for the page to count from.
    assert f'data-since="{int(started.timestamp() * 1000)}"' in row
    # A second later its duration has grown, and still nothing changed on the server's side.
    wait_for(lambda: timezone.now() - started > timedelta(seconds=1.5), what="a second to pass")
    assert tick()["fragments"] == {}
    WorkflowRun.objects.filter(pk="diff-running").update(status=RunStatus.COMPLETED, finished_at=timezone.now())
    finished = tick()["fragments"]
    assert set(finished) == {"runs-table"}  # it finished: its row changed, with its duration
    assert "data-since" not in finished["runs-table"]


def _cookie(client: Client) -> list[tuple[bytes, bytes]]:
    return [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()), (b"origin", b"http://localhost")]


def test_a_tab_that_joins_gets_everything_once_then_only_changes(
    staff_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from settings.asgi import application

    _runs()
    # The broadcaster ticks once on the first subscription, then only when this test says so.
    monkeypatch.setattr(live.broadcaster, "interval_s", 3600.0)
    # Spelt another way (the fields out of order, a blank one): the same topic, the same group.
    other_spelling = "runs:q=&workflow=tests.diff"

    async def go() -> tuple[dict[str, Any], ...]:
        first = WebsocketCommunicator(application, f"/ws/live/?topic={quote(TOPIC)}", headers=_cookie(staff_client))
        assert (await first.connect())[0]
        full = await first.receive_json_from(timeout=30)
        url = f"/ws/live/?topic={quote(other_spelling)}"
        second = WebsocketCommunicator(application, url, headers=_cookie(staff_client))
        assert (await second.connect())[0]
        joined = await second.receive_json_from(timeout=30)
        await live.broadcaster.tick()
        quiet = [await tab.receive_json_from(timeout=30) for tab in (first, second)]
        await database_sync_to_async(_finish)("diff-0")
        await live.broadcaster.tick()
        changed = [await tab.receive_json_from(timeout=30) for tab in (first, second)]
        for tab in (first, second):
            await tab.disconnect()
        return full, joined, *quiet, *changed

    full, joined, quiet_a, quiet_b, changed_a, changed_b = async_to_sync(go)()
    assert set(full["fragments"]) == set(joined["fragments"]) == {"runs-count", "runs-table"}
    assert joined["fragments"] == full["fragments"] and joined["topic"] == TOPIC
    assert quiet_a["fragments"] == quiet_b["fragments"] == {}
    assert set(changed_a["fragments"]) == set(changed_b["fragments"]) == {"runs-table"}


@pytest.mark.parametrize(
    "topic",
    [
        "runs:status=nope",
        "runs:since=yesterday",
        "runs:after=x",
        "runs:before=2026-01-01T00:00:00",  # a cursor's time carries its offset
        "runs:after=2026-01-01T00:00:00%2B00:00~a&before=2026-01-01T00:00:00%2B00:00~b",
        "runs:after=2026-01-01T00:00:00%2B00:00~" + "x" * 400,
        "runs:q=" + "x" * 400,
    ],
)
def test_a_run_list_topic_with_a_bad_query_is_refused(topic: str) -> None:
    assert live.canonical_topic(topic) is None


def test_a_run_list_topic_has_one_spelling() -> None:
    assert live.canonical_topic("runs:") == "runs:"
    assert live.canonical_topic("runs:page=1&status=failed&q=") == "runs:status=failed"  # no such field
    assert (
        live.canonical_topic("runs:after=2026-01-01T00:00:00%2B00:00~r1&workflow=w&status=running&status=failed")
        == "runs:status=running&status=failed&workflow=w&after=2026-01-01T00%3A00%3A00%2B00%3A00~r1"
    )


def test_a_process_renders_a_bounded_number_of_topics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live, "MAX_TOPICS", 2)
    broadcaster = live.Broadcaster()
    broadcaster.subscribers.update({"runs:": 1, "runs:status=failed": 1})
    assert broadcaster.subscribe("runs:status=running") is False  # a third topic: refused
    assert "runs:status=running" not in broadcaster.subscribers


@pytest.mark.django_db(transaction=True)
def test_the_flow_topic_carries_the_queues_limits_as_configured_now(engine: Any) -> None:
    api.register_queue("resized-live", concurrency=6, rate_limit={"limit": 60, "period_ms": 60_000})
    broadcaster = live.Broadcaster()
    topic = "flow:resized-live"
    broadcaster.subscribers[topic] = 1

    def tick() -> dict[str, Any]:
        at, rendered = live.compute_tick([topic])
        return broadcaster.changes(topic, rendered[topic], at)

    first = tick()
    assert '<span id="n-cap">6</span>' in first["fragments"]["flow-gate"]
    assert '<span id="n-rate">60</span>' in first["fragments"]["flow-gate"]
    assert tick()["fragments"] == {}  # an idle queue: neither its gate nor its dots are sent again
    api.update_queue("resized-live", concurrency=2, rate_limit={"limit": 20, "period_ms": 60_000})
    resized = tick()["fragments"]
    assert set(resized) == {"flow-gate", "flow-data"}  # the gate and the JSON's limits
    assert '<span id="n-cap">2</span>' in resized["flow-gate"]
    assert '<span id="n-rate">20</span>' in resized["flow-gate"]
