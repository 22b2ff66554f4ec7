"""Schedules in the JSON API (list, pause, resume: staff, CSRF or token, the `change_schedule`
permission, JSON 4xx) and in the metrics (ticks by outcome, paused, next tick and lag), after
real ticks on the engine's injected clock."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from durable_flow.contrib.metrics import DurableFlowCollector
from durable_flow.definitions.registry import WorkflowDefinition
from durable_flow.definitions.schedules import tick_run_id
from durable_flow.engine import Engine
from durable_flow.models import AccessToken, Schedule
from durable_flow.runtime.schedules import ScheduleTicker
from tests.conftest import MovableClock
from tests.support.clients import create_user, logged_in

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = datetime(2026, 1, 1, 10, 0, tzinfo=UTC)


def minute(n: int) -> datetime:
    return HOUR + timedelta(minutes=n)


@pytest.fixture
def at_start(clock: MovableClock) -> MovableClock:
    clock._now = HOUR - timedelta(seconds=30)
    return clock


@pytest.fixture
def ticked(manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]) -> ScheduleTicker:
    """`api-tick` (every minute, Paris) stored at 09:59:30 and its 10:00 tick started at 10:00:30."""
    declare("api-tick", schedule={"cron": "* * * * *", "timezone": "Europe/Paris", "max_catch_up": 4})
    ticker = ScheduleTicker(manual)
    ticker.tick()
    at_start.advance(minutes=1)
    ticker.tick()
    return ticker


def token_client(*permissions: str) -> Client:
    row = AccessToken(user=create_user("scripts", permissions=permissions), name="schedules test")
    token = row.set_new_token()
    row.save()
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def csrf_post(client: Client, url: str) -> Any:
    client.get(reverse("dashboard:schedules"))  # a page that sets the session's CSRF cookie
    return client.post(url, HTTP_X_CSRFTOKEN=client.cookies["csrftoken"].value)


def quota_full(
    engine: Engine, clock: MovableClock, declare: Callable[..., WorkflowDefinition], name: str
) -> ScheduleTicker:
    """`name` every minute with a start quota of 1, stored at 09:59:30; its 10:00 tick started
    at 10:00 (pending: it holds the quota) and its 10:01 tick refused at 10:01."""
    declare(name, schedule="* * * * *", quota={"key": lambda _: "one", "limit": 1})
    ticker = ScheduleTicker(engine)
    ticker.tick()
    for step in (30, 60):
        clock.advance(seconds=step)
        ticker.tick()
    return ticker


# -- the JSON API ---------------------------------------------------------------------------------
def test_the_list_gives_each_schedule_its_ticks_last_run_and_last_refusal(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]
) -> None:
    quota_full(manual, at_start, declare, "quota-api")

    body = token_client().get("/api/schedules/").json()

    assert body == {
        "schedules": [
            {
                "workflow": "quota-api",
                "cron": "* * * * *",
                "timezone": "UTC",
                "catch_up": "latest",
                "max_catch_up": 10,
                "declared": True,
                "paused": False,
                "next_tick_at": minute(2).isoformat(),
                "last_tick_at": minute(1).isoformat(),
                "last_run_id": tick_run_id("quota-api", minute(1)),
                "last_outcome": "refused",
                "last_refusal": {
                    "tick_at": minute(1).isoformat(),
                    "run_id": tick_run_id("quota-api", minute(1)),
                    "outcome": "refused",
                },
            }
        ]
    }


def test_a_refusal_stays_the_last_refusal_after_later_ticks_start(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]
) -> None:
    ticker = quota_full(manual, at_start, declare, "quota-later")
    manual.cancel(tick_run_id("quota-later", minute(0)))  # the quota frees
    at_start.advance(minutes=1)
    ticker.tick()  # 10:02 starts

    (listed,) = token_client().get("/api/schedules/").json()["schedules"]
    assert (listed["last_outcome"], listed["last_run_id"]) == ("started", tick_run_id("quota-later", minute(2)))
    assert listed["last_refusal"]["tick_at"] == minute(1).isoformat()


def test_pause_and_resume_round_trip_over_a_session_with_csrf(ticked: ScheduleTicker, at_start: MovableClock) -> None:
    user = create_user("ops", permissions=["change_schedule"])
    client = logged_in(user, csrf=True)

    paused = csrf_post(client, "/api/schedules/api-tick/pause/")
    assert paused.status_code == 200
    assert (paused.json()["paused"], paused.json()["next_tick_at"]) == (True, None)
    at_start.advance(minutes=3)  # 10:03:30
    assert ticked.tick() == []

    resumed = csrf_post(client, "/api/schedules/api-tick/resume/")
    assert resumed.status_code == 200
    assert resumed.json()["paused"] is False
    assert resumed.json()["next_tick_at"] == minute(4).isoformat()  # the paused ticks are not caught up
    assert resumed.json() == client.get("/api/schedules/").json()["schedules"][0]
    messages = list(LogEntry.objects.filter(user=user).values_list("change_message", flat=True))
    assert sorted(messages) == ["Paused from the JSON API", "Resumed from the JSON API"]


def test_a_token_pauses_without_csrf_and_an_unknown_schedule_is_a_json_404(ticked: ScheduleTicker) -> None:
    client = token_client("change_schedule")

    assert client.post("/api/schedules/api-tick/pause/").json()["paused"] is True
    missing = client.post("/api/schedules/no-such-schedule/resume/")
    assert missing.status_code == 404
    assert missing.json()["error"] == "ScheduleNotFound"
    too_long = client.post(f"/api/schedules/{'x' * 300}/pause/")
    assert too_long.status_code == 400 and too_long.json()["error"] == "InvalidInput"
    assert client.get("/api/schedules/api-tick/pause/").status_code == 405


def test_callers_without_staff_the_permission_or_csrf_are_refused(ticked: ScheduleTicker) -> None:
    url = "/api/schedules/api-tick/pause/"
    assert Client().get("/api/schedules/").status_code == 401
    assert Client().post(url).status_code == 401
    assert logged_in(create_user("plain", staff=False)).get("/api/schedules/").status_code == 403
    viewer = token_client()  # staff, without change_schedule: may list, not pause
    assert viewer.get("/api/schedules/").status_code == 200
    refused = viewer.post(url)
    assert refused.status_code == 403 and "change_schedule" in refused.json()["message"]
    no_csrf = logged_in(create_user("ops", permissions=["change_schedule"]), csrf=True).post(url)
    assert no_csrf.status_code == 403 and no_csrf.json()["error"] == "CsrfFailed"
    assert not Schedule.objects.get(pk="api-tick").paused


# -- the metrics ----------------------------------------------------------------------------------
def scrape(now: Callable[[], datetime]) -> dict[str, dict[str, float]]:
    """`{sample name: {workflow[/outcome]: value}}` of the schedule families, scraped at `now`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DurableFlowCollector(now=now))
    samples: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name.startswith("durable_flow_schedule_") and family.name != "durable_flow_schedule_to_start_seconds":
            for sample in family.samples:
                key = "/".join(sample.labels[name] for name in ("workflow", "outcome") if name in sample.labels)
                samples.setdefault(sample.name, {})[key] = sample.value
    return samples


def test_the_metrics_count_ticks_by_outcome_and_show_a_growing_lag_while_no_poller_runs(
    ticked: ScheduleTicker, at_start: MovableClock
) -> None:
    scraped = scrape(at_start)  # 10:00:30: the 10:00 tick started
    assert scraped["durable_flow_schedule_ticks_total"] == {"api-tick/started": 1}
    assert scraped["durable_flow_schedule_next_tick_seconds"] == {"api-tick": 30}
    assert scraped["durable_flow_schedule_lag_seconds"] == {"api-tick": 0}
    assert scraped["durable_flow_schedule_paused"] == {"api-tick": 0}

    at_start.advance(minutes=5)  # 10:05:30, no poller since 10:00:30: 10:01 to 10:05 are due
    down = scrape(at_start)
    assert down["durable_flow_schedule_lag_seconds"] == {"api-tick": 270}
    assert down["durable_flow_schedule_next_tick_seconds"] == {"api-tick": -270}

    assert ticked.tick() == [tick_run_id("api-tick", minute(5))]  # catch-up `latest`: 10:01 to 10:04 dropped
    back = scrape(at_start)
    assert back["durable_flow_schedule_ticks_total"] == {"api-tick/started": 2, "api-tick/skipped": 4}
    assert back["durable_flow_schedule_lag_seconds"] == {"api-tick": 0}

    Schedule.objects.filter(pk="api-tick").update(paused=True)
    at_start.advance(minutes=10)
    paused = scrape(at_start)
    assert paused["durable_flow_schedule_paused"] == {"api-tick": 1}
    assert "durable_flow_schedule_lag_seconds" not in paused  # a paused schedule is not late


def test_refused_ticks_are_counted_per_schedule(
    manual: Engine, at_start: MovableClock, declare: Callable[..., WorkflowDefinition]
) -> None:
    ticker = quota_full(manual, at_start, declare, "quota-metric")
    at_start.advance(minutes=1)
    ticker.tick()  # 10:02 is refused too

    ticks = scrape(at_start)["durable_flow_schedule_ticks_total"]
    assert ticks == {"quota-metric/started": 1, "quota-metric/refused": 2}


def test_the_tick_counts_reach_the_scrape_endpoint(ticked: ScheduleTicker, staff_client: Client) -> None:
    text = staff_client.get("/metrics/").content.decode()
    assert 'durable_flow_schedule_ticks_total{outcome="started",workflow="api-tick"} 1.0' in text
    assert 'durable_flow_schedule_paused{workflow="api-tick"} 0.0' in text
