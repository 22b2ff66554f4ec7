"""The dashboard's pages, history samples and live feed, without a browser: samples the poller
writes, pages that render without JavaScript, the queue forms (POST + CSRF + permission), and
one snapshot per tick for every open tab."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.sessions.models import Session
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from durable_flow import start
from durable_flow.engine import Engine
from durable_flow.models import FlowQueue, QueueSample, WorkerHeartbeat, WorkerSample
from durable_flow.observe.sampling import aligned, prune_samples, take_samples
from durable_flow.operations import api
from durable_flow.runtime.poller import TimerPoller
from durable_flow_dashboard import live
from durable_flow_dashboard.snapshot import human_period, snapshot
from tests import workflows
from tests.engine_support import ManualTransport
from tests.support.engine_pairs import db_engine


def csrf_post(client: Client, url: str, data: dict[str, str] | None = None) -> Any:
    """POST as a browser does: the form's CSRF token from a page of the dashboard."""
    client.get(reverse("dashboard:queues"))
    token = client.cookies["csrftoken"].value
    return client.post(url, {**(data or {}), "csrfmiddlewaretoken": token})


# -- samples -----------------------------------------------------------------------------------
def test_samples_count_the_interval_and_are_written_once_per_queue_and_interval(manual: Engine, clock: Any) -> None:
    transport = manual.transport
    assert isinstance(transport, ManualTransport)
    api.register_queue("sampled", concurrency=1)
    for value in range(3):
        start("tests.queued", {"queue": "sampled", "value": value})
    transport.run_turns()
    transport.execute(transport.take())  # one admitted and completed; two waited behind the cap
    transport.run_turns()  # early wake: the next waiter is admitted, one still waits
    clock.advance(seconds=manual.settings.sample_interval_s)

    at = take_samples(manual, clock())
    assert at == aligned(clock(), manual.settings.sample_interval_s)
    row = QueueSample.objects.get(queue="sampled", at=at)
    assert (row.waiting, row.in_flight, row.admissions, row.completions, row.failures) == (1, 1, 2, 1, 0)
    assert QueueSample.objects.filter(queue="", at=at).exists()  # steps on no queue

    take_samples(manual, clock())  # a second poller in the same interval
    assert QueueSample.objects.filter(queue="sampled", at=at).count() == 1


def test_a_db_admission_line_longer_than_the_cap_is_sampled_up_to_the_cap(
    clock: Any, transactional_db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `db` backend's line is counted as far as the parked calls are (the cap), not whole:
    a sample of a line of 100,000 waiters must not read 100,000 index entries."""
    monkeypatch.setattr("durable_flow.observe.sampling.PARKED_COUNT_CAP", 2)
    engine = db_engine(clock, ManualTransport())
    transport = engine.transport
    assert isinstance(transport, ManualTransport)
    api.register_queue("long", concurrency=1)
    for value in range(5):
        start("tests.queued", {"queue": "long", "value": value})
    transport.run_turns()  # one admitted, four parked in the database's line
    assert engine.admission.waiting("long") == 4
    assert engine.admission.waiting("long", limit=2) == 2
    clock.advance(seconds=engine.settings.sample_interval_s)

    at = take_samples(engine, clock())
    assert QueueSample.objects.get(queue="long", at=at).waiting == 2  # the cap, as the parked count


def test_a_sampling_pass_takes_as_many_statements_with_eight_queues_as_with_one(manual: Engine, clock: Any) -> None:
    """The pass reads every queue's figures at once: its statements do not grow with the queues
    (one read per queue made a pass cost its queues' round trips), and still write a row per
    queue, the no-queue row and a row per live worker."""
    api.register_queue("sampled0", concurrency=1)
    start("tests.queued", {"queue": "sampled0", "value": 0})
    manual.transport.run_turns()  # type: ignore[attr-defined]
    now = clock()
    WorkerHeartbeat.objects.create(
        worker_id="w:1:a", host="w", pid=1, transport="db", started_at=now, last_seen=now, live_limit=4, in_flight=2
    )
    interval = manual.settings.sample_interval_s
    counted = []
    for queues in (1, 8):
        for n in range(1, queues):
            api.register_queue(f"sampled{n}", concurrency=1)
        clock.advance(seconds=interval)
        WorkerHeartbeat.objects.filter(worker_id="w:1:a").update(last_seen=clock())  # alive
        with CaptureQueriesContext(connection) as statements:
            at = take_samples(manual, clock())
        counted.append(len(statements))
        assert set(QueueSample.objects.filter(at=at).values_list("queue", flat=True)) == {
            "",
            *(f"sampled{n}" for n in range(queues)),
        }
        sample = WorkerSample.objects.get(at=at)
        assert (sample.worker_id, sample.live_limit, sample.in_flight) == ("w:1:a", 4, 2)
    assert counted[0] == counted[1] <= 3, counted
    assert QueueSample.objects.get(queue="sampled0", at=at).in_flight == 1


def test_samples_count_each_failed_attempt_apart_from_steps_failed_for_good(engine: Engine, clock: Any) -> None:
    api.register_queue("shaky", concurrency=2)
    workflows.FAILURES_LEFT["sampled"] = 2
    interval = engine.settings.sample_interval_s
    began = clock()
    run = start("tests.flaky_queued", {"key": "sampled", "queue": "shaky"})  # fails, backs off 1 s
    poller = TimerPoller(engine)
    for backoff_s in (1, 2):  # second attempt fails, backs off 2 s; third completes
        clock.advance(seconds=backoff_s)
        poller.tick()
    doomed = start("tests.fails", None)  # fails, and again after 1 s: failed for good
    clock.advance(seconds=1)
    poller.tick()
    assert run.__class__.objects.get(pk=run.pk).status == "completed"
    assert doomed.__class__.objects.get(pk=doomed.pk).status == "failed"
    # Every interval from the first call to now, once each: the sums cover every event.
    at, last = aligned(began, interval), aligned(clock(), interval) + timedelta(seconds=interval)
    while at <= last:
        take_samples(engine, at)
        at += timedelta(seconds=interval)
    shaky = QueueSample.objects.filter(queue="shaky")
    assert sum(shaky.values_list("failed_attempts", flat=True)) == 2  # both retried
    assert sum(shaky.values_list("failures", flat=True)) == 0
    assert sum(shaky.values_list("completions", flat=True)) == 1
    unqueued = QueueSample.objects.filter(queue="")
    assert sum(unqueued.values_list("failed_attempts", flat=True)) == 2  # its two attempts
    assert sum(unqueued.values_list("failures", flat=True)) == 1  # one step failed for good


def test_the_charts_draw_failed_attempts_and_steps_failed_for_good_apart(staff_client: Client, engine: Engine) -> None:
    api.register_queue("q", concurrency=1)
    at = aligned(timezone.now(), 10)
    QueueSample.objects.create(queue="q", at=at, interval_s=10, failed_attempts=3, failures=1, completions=5)
    for url in (reverse("dashboard:index"), reverse("dashboard:queue", args=["q"])):
        html = staff_client.get(url).content.decode()
        assert "failed attempts / min (retried ones too)" in html and "failed for good / min" in html
        assert 'class="s-attempt_failures' in html


def test_samples_older_than_the_retention_are_pruned(transactional_db: None) -> None:
    now = timezone.now()
    for age_h in (0, 2, 30):
        QueueSample.objects.create(queue="q", at=now - timedelta(hours=age_h), interval_s=10)
        WorkerSample.objects.create(worker_id="w", at=now - timedelta(hours=age_h))
    assert prune_samples(86_400, now) == 2
    assert QueueSample.objects.count() == 2 and WorkerSample.objects.count() == 2


def test_sample_times_align_to_the_interval() -> None:
    at = datetime(2026, 1, 1, 12, 0, 17, 500_000, tzinfo=UTC)
    assert aligned(at, 10) == datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC)
    assert human_period(10_000) == "10 s" and human_period(60_000) == "1 min" and human_period(1500) == "1.5 s"


# -- pages -------------------------------------------------------------------------------------
def test_every_page_renders_without_javascript(staff_client: Client, engine: Engine) -> None:
    api.register_queue(
        "pdf-render", concurrency=5, rate_limit={"limit": 20, "period_ms": 10_000, "algorithm": "sliding"}
    )
    start("tests.three_steps", 1)
    for name, args in (("index", []), ("queues", []), ("queue", ["pdf-render"]), ("workers", [])):
        response = staff_client.get(reverse(f"dashboard:{name}", args=args))
        assert response.status_code == 200, name
        html = response.content.decode()
        assert "<h1>" in html and "<main" in html and 'aria-label="Dashboard"' in html
    html = staff_client.get(reverse("dashboard:queue", args=["pdf-render"])).content.decode()
    assert "0 / 20 per 10 s, sliding" in html
    assert "0 / 5" in html


def test_pages_are_for_staff_only(engine: Engine) -> None:
    api.register_queue("private", concurrency=1)
    urls = [reverse("dashboard:queues"), reverse("dashboard:queue", args=["private"]), reverse("dashboard:workers")]
    for url in urls:
        response = Client().get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]
    plain = Client()
    plain.force_login(get_user_model().objects.create_user("plain", password="pw"))
    for url in urls:
        assert plain.get(url).status_code == 403


def test_run_counts_link_to_the_filtered_run_list(staff_client: Client, engine: Engine) -> None:
    start("tests.three_steps", 1)
    html = staff_client.get(reverse("dashboard:index")).content.decode()
    assert "/admin/durable_flow/workflowrun/?status__exact=completed" in html or "?status=completed" in html
    assert 'aria-label="completed runs"' in html  # finished runs: a link, never a count of the history


def test_an_unknown_queue_is_404(staff_client: Client, engine: Engine) -> None:
    assert staff_client.get(reverse("dashboard:queue", args=["nope"])).status_code == 404


def test_problems_list_a_crashed_worker_and_a_paused_queue(staff_client: Client, engine: Engine) -> None:
    api.register_queue("held", concurrency=1)
    api.pause_queue("held")
    long_ago = timezone.now() - timedelta(minutes=5)
    WorkerHeartbeat.objects.create(
        worker_id="gone:1:a", host="gone", pid=1, transport="db", started_at=long_ago, last_seen=long_ago
    )
    problems = snapshot()["problems"]
    texts = " | ".join(p["text"] for p in problems)
    assert "Worker gone:1 stopped heartbeating" in texts
    assert "Queue held is paused" in texts
    html = staff_client.get(reverse("dashboard:index")).content.decode()
    assert 'href="/dashboard/queues/held/"' in html


def test_a_queue_blocked_by_its_cap_says_why(manual: Engine) -> None:
    transport = manual.transport
    api.register_queue("capped", concurrency=1)
    for value in range(2):
        start("tests.queued", {"queue": "capped", "value": value})
    transport.run_turns()
    row = next(q for q in snapshot()["queues"] if q["name"] == "capped")
    assert [r["kind"] for r in row["blocked"]] == ["concurrency"]


# -- steering forms ----------------------------------------------------------------------------
def test_pause_resume_and_resize_from_the_queue_page(staff_client: Client, engine: Engine, staff: Any) -> None:
    api.register_queue("steer", concurrency=2)
    response = csrf_post(staff_client, reverse("dashboard:queue-pause", args=["steer"]))
    assert response.status_code == 303 and FlowQueue.objects.get(pk="steer").paused
    csrf_post(staff_client, reverse("dashboard:queue-resume", args=["steer"]))
    assert not FlowQueue.objects.get(pk="steer").paused
    csrf_post(
        staff_client,
        reverse("dashboard:queue-resize", args=["steer"]),
        {"concurrency": "7", "rate_limit": "30", "rate_period_s": "10", "rate_algorithm": "sliding"},
    )
    config = FlowQueue.objects.get(pk="steer").config
    assert config["concurrency"] == 7
    assert config["rate_limit"] == {"limit": 30, "period_ms": 10_000, "algorithm": "sliding"}
    messages = list(LogEntry.objects.filter(user=staff).values_list("change_message", flat=True))
    assert any(m.startswith("Paused from the dashboard") for m in messages)
    assert any(m.startswith("Resized from the dashboard") for m in messages)


def test_the_resize_form_shows_and_sends_back_every_option(staff_client: Client, engine: Engine) -> None:
    """Resizing the cap keeps a per-key window and a throttle the form shows; blanking the
    throttle's limit removes it; sub-second periods round-trip exactly."""
    api.register_queue(
        "keyed",
        concurrency=2,
        rate_limit=[
            {"limit": 30, "period_ms": 1500, "algorithm": "sliding"},
            {"limit": 3, "period_ms": 500, "per": "key"},
        ],
        throttle={"limit": 4, "period_ms": 1000, "burst": 2, "per": "key"},
    )
    page = staff_client.get(reverse("dashboard:queue", args=["keyed"])).content.decode()
    form = page[page.index('id="resize-form"') : page.index("</form>", page.index('id="resize-form"'))]
    fields = dict(re.findall(r'name="(\w+)"[^>]*value="([^"]*)"', form))
    assert fields == {
        "csrfmiddlewaretoken": fields["csrfmiddlewaretoken"],
        "concurrency": "2",
        "rate_limit": "30",
        "rate_period_s": "1.5",
        "key_rate_limit": "3",
        "key_rate_period_s": "0.5",
        "throttle_limit": "4",
        "throttle_period_s": "1",
        "throttle_burst": "2",
    }
    selected = dict(re.findall(r'<select name="(\w+)">(?:(?!</select>).)*?<option value="(\w+)" selected', form, re.S))
    assert selected == {"rate_algorithm": "sliding", "key_rate_algorithm": "fixed", "throttle_per": "key"}
    before = FlowQueue.objects.get(pk="keyed").config
    sent = fields | selected | {"concurrency": "5"}
    csrf_post(staff_client, reverse("dashboard:queue-resize", args=["keyed"]), sent)
    after = FlowQueue.objects.get(pk="keyed").config
    assert after == before | {"concurrency": 5}
    csrf_post(staff_client, reverse("dashboard:queue-resize", args=["keyed"]), sent | {"throttle_limit": ""})
    assert FlowQueue.objects.get(pk="keyed").config == before | {"concurrency": 5, "throttle": None}


def test_bad_resize_input_is_a_message_not_an_error(staff_client: Client, engine: Engine) -> None:
    api.register_queue("steer", concurrency=2)
    bad = (
        {"concurrency": "two"},
        {"concurrency": "1" + "0" * 30},
        {"rate_limit": "5"},
        {"rate_limit": "5", "rate_period_s": "0.0001"},
        {"throttle_limit": "5", "throttle_period_s": "soon"},
        {"throttle_limit": "5", "throttle_period_s": "1", "throttle_per": "tenant"},
    )
    for data in bad:
        response = csrf_post(staff_client, reverse("dashboard:queue-resize", args=["steer"]), data)
        assert response.status_code == 303
        page = staff_client.get(response["Location"]).content.decode()
        assert "Not resized" in page or "must be" in page
    assert FlowQueue.objects.get(pk="steer").config["concurrency"] == 2


def test_steering_needs_a_post_with_csrf_and_the_permission(engine: Engine) -> None:
    api.register_queue("steer", concurrency=2)
    user = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    url = reverse("dashboard:queue-pause", args=["steer"])
    assert client.get(url).status_code == 405
    assert client.post(url).status_code == 403  # no CSRF token
    assert csrf_post(client, url).status_code == 403  # no permission
    page = client.get(reverse("dashboard:queue", args=["steer"])).content.decode()
    assert 'id="pause-queue" type="submit" disabled' in page
    user.user_permissions.add(Permission.objects.get(codename="change_flowqueue"))
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert csrf_post(client, url).status_code == 303
    assert FlowQueue.objects.get(pk="steer").paused
    assert csrf_post(client, reverse("dashboard:queue-pause", args=["missing"])).status_code == 404


def test_session_check_tells_an_expired_session(staff_client: Client) -> None:
    assert staff_client.get(reverse("dashboard:session")).status_code == 204
    assert Client().get(reverse("dashboard:session")).status_code == 401


# -- live --------------------------------------------------------------------------------------
def _cookie(client: Client) -> list[tuple[bytes, bytes]]:
    return [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()), (b"origin", b"http://localhost")]


def _application() -> Any:
    from settings.asgi import application

    return application


def test_one_snapshot_per_tick_serves_every_open_tab(staff_client: Client, engine: Engine) -> None:
    api.register_queue("live-q", concurrency=3)

    async def go() -> tuple[int, list[dict[str, Any]]]:
        tabs = [
            WebsocketCommunicator(_application(), "/ws/live/?topic=overview", headers=_cookie(staff_client))
            for _ in range(3)
        ]
        for tab in tabs:
            connected, _ = await tab.connect()
            assert connected
        before = live.broadcaster.computed
        messages = []
        for _ in range(3):
            for tab in tabs:
                messages.append(await tab.receive_json_from(timeout=10))
        computed = live.broadcaster.computed - before
        for tab in tabs:
            await tab.disconnect()
        return computed, messages

    computed, messages = async_to_sync(go)()
    assert len(messages) == 9
    # Three ticks serve the nine messages (tabs that joined after the first tick see one more):
    # one computation per tick, never one per tab.
    assert computed <= 5
    # A tick carries the page's fragments, not the snapshot they were rendered from.
    assert {"topic", "fragments", "gone"} <= set(messages[0]) and "queues" not in messages[0]
    assert 'data-queue="live-q"' in messages[0]["fragments"]["queues-table"]


def test_a_queue_topic_pushes_that_queues_fragments(staff_client: Client, engine: Engine) -> None:
    api.register_queue("detail-q", concurrency=3)

    async def go() -> dict[str, Any]:
        tab = WebsocketCommunicator(_application(), "/ws/live/?topic=queue:detail-q", headers=_cookie(staff_client))
        assert (await tab.connect())[0]
        message = await tab.receive_json_from(timeout=10)
        await tab.disconnect()
        return message

    message = async_to_sync(go)()
    assert set(message["fragments"]) == {"queue-stats", "queue-why", "queue-charts", "queue-keys"}
    assert "0 / 3" in message["fragments"]["queue-stats"]


@pytest.mark.parametrize("topic", ["nope", "flow:a%00b"])
def test_an_unknown_topic_is_accepted_then_closed_with_4400(staff_client: Client, topic: str) -> None:
    """Closed after the handshake, so the page's script sees 4400 (a refused handshake is an
    HTTP 403 that a browser reports only as code 1006). A NUL names no queue."""

    async def go() -> tuple[bool, Any]:
        tab = WebsocketCommunicator(_application(), f"/ws/live/?topic={topic}", headers=_cookie(staff_client))
        connected, _ = await tab.connect()
        closed = await tab.receive_output(timeout=10) if connected else None
        await tab.wait()
        return connected, closed

    assert async_to_sync(go)() == (True, {"type": "websocket.close", "code": 4400})


EXPIRED = {"type": "websocket.send", "text": '{"session": "expired"}'}


def _tick() -> Any:
    """One tick to the `workers` topic's tabs, as the broadcaster sends it."""
    return get_channel_layer().group_send(
        live.group_name("workers"), {"type": "dashboard.tick", "data": {"fragments": {}}}
    )


def _after_revoking(client: Client, revoke: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Open a tab, take its first tick, run `revoke` (in the database thread), send one more
    tick: what the tab gets for it (the farewell and the close, or the tick forwarded)."""
    # The broadcaster ticks once on the first subscription, then only when this test says so.
    monkeypatch.setattr(live.broadcaster, "interval_s", 3600.0)

    async def go() -> list[Any]:
        tab = WebsocketCommunicator(_application(), "/ws/live/?topic=workers", headers=_cookie(client))
        assert (await tab.connect())[0]
        assert "fragments" in await tab.receive_json_from(timeout=30)
        await database_sync_to_async(revoke)()
        await _tick()
        outputs = [await tab.receive_output(timeout=30)]
        if outputs[0] == EXPIRED:
            outputs.append(await tab.receive_output(timeout=30))
        await tab.disconnect()
        return outputs

    return async_to_sync(go)()


def _revoking(user: Any, **changes: Any) -> Callable[[], None]:
    def revoke() -> None:
        fresh = get_user_model().objects.get(pk=user.pk)
        for name, value in changes.items():
            setattr(fresh, name, value)
        fresh.save()

    return revoke


def test_the_socket_closes_with_4401_once_the_session_expired(
    staff_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = _after_revoking(staff_client, lambda: Session.objects.all().delete(), monkeypatch)
    assert outputs == [EXPIRED, {"type": "websocket.close", "code": 4401}]


def test_the_socket_closes_with_4403_once_the_user_is_no_longer_staff(
    staff_client: Client, staff: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = _after_revoking(staff_client, _revoking(staff, is_staff=False), monkeypatch)
    assert outputs == [{"type": "websocket.close", "code": 4403}]


def test_the_socket_closes_with_4401_once_the_user_is_deactivated(
    staff_client: Client, staff: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = _after_revoking(staff_client, _revoking(staff, is_active=False), monkeypatch)
    assert outputs == [EXPIRED, {"type": "websocket.close", "code": 4401}]


def test_the_socket_closes_with_4401_once_the_password_changed(
    staff_client: Client, staff: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def change_password() -> None:
        fresh = get_user_model().objects.get(pk=staff.pk)
        fresh.set_password("another")
        fresh.save()

    outputs = _after_revoking(staff_client, change_password, monkeypatch)
    assert outputs == [EXPIRED, {"type": "websocket.close", "code": 4401}]


def test_the_socket_closes_with_4401_once_the_user_is_deleted(
    staff_client: Client, staff: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = _after_revoking(staff_client, lambda: get_user_model().objects.filter(pk=staff.pk).delete(), monkeypatch)
    assert outputs == [EXPIRED, {"type": "websocket.close", "code": 4401}]


def test_a_secret_key_rotated_into_the_fallbacks_keeps_the_socket_open(
    staff_client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-check is Django's own (`get_user`): a session whose auth hash was made with a key
    now in `SECRET_KEY_FALLBACKS` still logs the user in, as it does over HTTP."""

    def rotate() -> None:
        settings.SECRET_KEY_FALLBACKS = [settings.SECRET_KEY]
        settings.SECRET_KEY = "a-rotated-secret-key-for-this-test-only-0123456789"

    outputs = _after_revoking(staff_client, rotate, monkeypatch)
    assert outputs == [{"type": "websocket.send", "text": '{"fragments": {}}'}]
