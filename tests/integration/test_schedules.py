"""Schedules: one run per cron tick across pollers, the catch-up policies, the start gates, pause.

Time is the engine's injected clock: the race walks an hour of ticks (one a minute) in
half-minute steps, two pollers ticking at once at every step, each down for part of the hour and
both down together for a few minutes, after which the declared catch-up policy decides what runs.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from durable_flow.definitions import registry
from durable_flow.definitions.registry import WorkflowDefinition
from durable_flow.definitions.schedules import tick_run_id
from durable_flow.engine import Engine
from durable_flow.models import Schedule, ScheduleOutcome, StartRefusal, WorkflowRun
from durable_flow.operations.schedules import pause_schedule, resume_schedule
from durable_flow.runtime.schedules import ScheduleTicker
from tests.conftest import MovableClock

pytestmark = pytest.mark.django_db(transaction=True)

START = datetime(2026, 1, 1, 9, 59, 30, tzinfo=UTC)
HOUR = datetime(2026, 1, 1, 10, 0, tzinfo=UTC)


@pytest.fixture
def at_start(clock: MovableClock) -> MovableClock:
    clock._now = START
    return clock


def minute(n: int) -> datetime:
    return HOUR + timedelta(minutes=n)


def _race(engine: Engine, clock: MovableClock, down: Callable[[str, datetime], bool]) -> list[str]:
    """Walk 10:00 to 11:00 in half-minute steps; at each step the pollers that are up tick at
    once. Every run id each pass reports starting, in one list."""
    pollers = {"a": ScheduleTicker(engine), "b": ScheduleTicker(engine)}
    started: list[str] = []
    errors: list[BaseException] = []
    steps = 2 * 61 + 1
    barrier = threading.Barrier(len(pollers) + 1)

    def run(name: str) -> None:
        try:
            for _ in range(steps):
                barrier.wait(timeout=60)
                try:
                    if not down(name, clock()):
                        started.extend(pollers[name].tick())
                except Exception as exc:  # noqa: BLE001  (reported by the test thread)
                    errors.append(exc)
                barrier.wait(timeout=60)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(name,)) for name in pollers]
    for thread in threads:
        thread.start()
    for _ in range(steps):
        barrier.wait(timeout=60)  # the pollers tick
        barrier.wait(timeout=60)  # both are done
        clock.advance(seconds=30)
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return started


def _down(name: str, now: datetime) -> bool:
    """Poller b is down from 10:20 to 10:28 and from 10:40, a from 10:30; both come back at
    10:45:30 (ticks 10:40 to 10:45 pass with no poller up)."""
    if name == "b":
        return minute(20) <= now < minute(28) or minute(40) <= now < minute(45) + timedelta(seconds=30)
    return minute(30) <= now < minute(45) + timedelta(seconds=30)


@pytest.mark.parametrize(
    ("catch_up", "missed_not_run"),
    [
        ("skip", range(40, 46)),  # every tick no poller saw on time
        ("latest", range(40, 45)),  # 10:45 runs, the latest due when the pollers came back
        ("all", range(40, 43)),  # 10:43 to 10:45 run: the bound is 3
    ],
)
def test_two_pollers_start_each_tick_once_over_an_hour_and_apply_the_catch_up_policy(
    manual: Engine,
    at_start: MovableClock,
    declare: Callable[..., WorkflowDefinition],
    catch_up: str,
    missed_not_run: range,
) -> None:
    declare("every-minute", schedule={"cron": "* * * * *", "catch_up": catch_up, "max_catch_up": 3})
    ScheduleTicker(manual).tick()  # the row is created at 09:59:30: the first tick is 10:00

    started = _race(manual, at_start, _down)

    expected = [tick_run_id("every-minute", minute(n)) for n in range(61) if n not in missed_not_run]
    assert len(started) == len(set(started)), "a tick was started by both pollers"
    assert sorted(started) == sorted(expected)
    assert sorted(WorkflowRun.objects.filter(workflow="every-minute").values_list("id", flat=True)) == sorted(expected)


def test_a_tick_refused_by_the_start_quota_is_recorded_and_not_retried(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare("quota-tick", schedule="* * * * *", quota={"key": lambda _: "one", "limit": 1})
    ticker = ScheduleTicker(manual)
    ticker.tick()
    at_start.advance(seconds=30)
    assert ticker.tick() == [tick_run_id("quota-tick", minute(0))]  # stays pending: the quota is full
    at_start.advance(minutes=1)

    assert ticker.tick() == []
    assert ticker.tick() == []  # the same tick, asked again: spent

    row = Schedule.objects.get(workflow="quota-tick")
    assert row.last_outcome == ScheduleOutcome.REFUSED
    assert row.last_tick_at == minute(1)
    assert row.next_tick_at == minute(2)
    assert StartRefusal.objects.filter(workflow="quota-tick").count() == 1
    assert WorkflowRun.objects.filter(workflow="quota-tick").count() == 1


def test_a_singleton_schedule_skips_a_tick_while_its_run_is_in_progress(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare("single-tick", schedule="* * * * *", singleton={"key": lambda _: "only", "mode": "skip"})
    ticker = ScheduleTicker(manual)
    ticker.tick()
    at_start.advance(seconds=30)
    ticker.tick()
    at_start.advance(minutes=1)
    ticker.tick()

    assert Schedule.objects.get(workflow="single-tick").last_outcome == ScheduleOutcome.GATED
    assert list(WorkflowRun.objects.filter(workflow="single-tick").values_list("id", flat=True)) == [
        tick_run_id("single-tick", minute(0))
    ]


def test_a_paused_schedule_starts_nothing_and_resumes_at_its_next_tick(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare("paused-tick", schedule={"cron": "* * * * *", "catch_up": "all", "max_catch_up": 100})
    ticker = ScheduleTicker(manual)
    ticker.tick()
    pause_schedule("paused-tick")
    at_start.advance(minutes=10)
    assert ticker.tick() == []

    resume_schedule("paused-tick")  # at 10:09:30
    assert ticker.tick() == []  # the ten ticks of the pause are not caught up
    at_start.advance(seconds=30)
    assert ticker.tick() == [tick_run_id("paused-tick", minute(10))]


def test_a_changed_cron_starts_its_ticks_over(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]
) -> None:
    declare("changed-tick", schedule="0 * * * *")
    ScheduleTicker(manual).tick()
    assert Schedule.objects.get(workflow="changed-tick").next_tick_at == minute(0)
    registry._workflows.pop("changed-tick")
    declare("changed-tick", schedule="*/15 * * * *")
    at_start.advance(minutes=5)  # 10:04:30

    ScheduleTicker(manual).tick()

    row = Schedule.objects.get(workflow="changed-tick")
    assert (row.cron, row.next_tick_at) == ("*/15 * * * *", minute(15))
    assert not WorkflowRun.objects.filter(workflow="changed-tick").exists()


# -- the dashboard and the admin ---------------------------------------------------------------
def _csrf_post(client: Client, url: str, data: dict[str, Any] | None = None) -> Any:
    client.get(reverse("dashboard:schedules"))
    return client.post(url, {**(data or {}), "csrfmiddlewaretoken": client.cookies["csrftoken"].value})


def test_the_schedules_page_shows_next_and_last_ticks_and_pauses_and_resumes(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition], staff_client: Client
) -> None:
    declare("page-tick", schedule={"cron": "*/5 * * * *", "timezone": "Europe/Paris"})
    ticker = ScheduleTicker(manual)
    ticker.tick()
    at_start.advance(seconds=30)
    ticker.tick()  # starts 10:00

    page = staff_client.get(reverse("dashboard:schedules")).content.decode()
    assert "page-tick" in page and "Europe/Paris" in page
    assert "2026-01-01 10:05:00" in page  # next tick
    assert "2026-01-01 10:00:00" in page  # last tick
    assert reverse("dashboard:run", args=[tick_run_id("page-tick", minute(0))]) in page

    response = _csrf_post(staff_client, reverse("dashboard:schedule-pause", args=["page-tick"]))
    assert response.status_code == 303
    assert Schedule.objects.get(workflow="page-tick").paused
    at_start.advance(minutes=5)
    assert ticker.tick() == []

    _csrf_post(staff_client, reverse("dashboard:schedule-resume", args=["page-tick"]))
    assert not Schedule.objects.get(workflow="page-tick").paused
    assert Schedule.objects.get(workflow="page-tick").next_tick_at == minute(10)


def test_pausing_needs_a_post_with_csrf_and_an_existing_schedule(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition], staff_client: Client
) -> None:
    declare("csrf-tick", schedule="* * * * *")
    ScheduleTicker(manual).tick()
    url = reverse("dashboard:schedule-pause", args=["csrf-tick"])

    assert staff_client.get(url).status_code == 405
    assert staff_client.post(url).status_code == 403  # no CSRF token
    assert _csrf_post(staff_client, reverse("dashboard:schedule-pause", args=["nothing"])).status_code == 404
    assert not Schedule.objects.get(workflow="csrf-tick").paused


def test_the_admin_pauses_and_resumes_selected_schedules(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition], staff_client: Client
) -> None:
    declare("admin-tick", schedule="* * * * *")
    ScheduleTicker(manual).tick()
    url = reverse("admin:durable_flow_schedule_changelist")
    staff_client.get(url)
    token = staff_client.cookies["csrftoken"].value

    for action, paused in (("pause_selected", True), ("resume_selected", False)):
        response = staff_client.post(
            url, {"action": action, "_selected_action": ["admin-tick"], "csrfmiddlewaretoken": token}
        )
        assert response.status_code == 302
        assert Schedule.objects.get(workflow="admin-tick").paused is paused


def test_the_schedules_topic_renders_each_tick_and_its_forms_are_fitted_by_the_page(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition], staff_client: Client
) -> None:
    from durable_flow_dashboard.live import canonical_topic, render_topic

    declare("live-tick", schedule="* * * * *")
    ticker = ScheduleTicker(manual)
    ticker.tick()
    assert canonical_topic("schedules") == "schedules"
    before = render_topic({}, "schedules")
    assert before is not None and "2026-01-01 10:00:00" in before["schedules-table"]  # next tick
    at_start.advance(seconds=30)
    ticker.tick()  # starts 10:00
    after = render_topic({}, "schedules")
    assert after is not None
    assert '<td class="last" data-label="last tick">2026-01-01 10:00:00</td>' in after["schedules-table"]
    assert "2026-01-01 10:01:00" in after["schedules-table"]
    # The fragment has no user: no CSRF token, and its button names the permission it needs.
    assert "csrfmiddlewaretoken" not in after["schedules-table"]
    assert 'data-needs-perm="durable_flow.change_schedule"' in after["schedules-table"]
    assert " disabled" not in after["schedules-table"]
    # The page has the token (for the script, and in its own forms) and says the user's permission.
    page = staff_client.get(reverse("dashboard:schedules")).content.decode()
    assert 'data-live-topic="schedules"' in page and 'data-live="schedules-table"' in page
    assert re.search(r'<meta name="csrf-token" content="[^"]+">', page)
    assert 'data-perms="durable_flow.change_schedule"' in page
    assert 'name="csrfmiddlewaretoken"' in page


def test_the_schedules_page_says_a_user_without_the_permission_lacks_it(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]
) -> None:
    from django.contrib.auth import get_user_model

    declare("no-perm-tick", schedule="* * * * *")
    ScheduleTicker(manual).tick()
    viewer = Client()
    viewer.force_login(get_user_model().objects.create_user("viewer", password="pw", is_staff=True))
    page = viewer.get(reverse("dashboard:schedules")).content.decode()
    assert "data-perms=" not in page
    assert re.search(r'data-needs-perm="durable_flow.change_schedule" disabled', page)
