"""Schedule declarations and their tick arithmetic: refused with an id and a hint when they do
not parse, and ticks that follow the declared timezone's wall clock."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from durable_flow.config.limits import RUN_ID_LENGTH
from durable_flow.definitions.registry import workflow
from durable_flow.definitions.schedules import (
    ScheduleError,
    ScheduleSpec,
    due_count,
    due_ticks,
    next_tick,
    parse_schedule,
    tick_run_id,
)
from durable_flow.exceptions import RegistrationError


@pytest.mark.parametrize(
    ("schedule", "check_id", "says"),
    [
        ("61 * * * *", "E010", "'61 * * * *' is not a valid cron expression"),
        ({"cron": "every minute"}, "E010", "not a valid cron expression"),
        ({"timezone": "UTC"}, "E010", "cron None is not a valid cron expression"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "E011", "'Mars/Olympus' is not a known IANA timezone"),
        ({"cron": "* * * * *", "catch_up": "sometimes"}, "E012", "catch_up must be one of skip, latest, all"),
        ({"cron": "* * * * *", "catch_up": "all", "max_catch_up": 0}, "E012", "max_catch_up must be"),
        ({"cron": "* * * * *", "max_catch_up": 10_001}, "E012", "max_catch_up must be"),
        ({"cron": "* * * * *", "max_catch_up": True}, "E012", "max_catch_up"),
        ({"cron": "* * * * *", "every": 5}, "E013", "unknown field(s) every"),
        (60, "E013", "must be a cron string or a dict"),
    ],
)
def test_a_bad_schedule_is_refused_at_declaration_with_its_id_and_a_hint(
    schedule: Any, check_id: str, says: str
) -> None:
    with pytest.raises(ScheduleError) as caught:
        workflow("bad-schedule", schedule=schedule)

    assert caught.value.check_id == check_id
    message = str(caught.value)
    assert "workflow 'bad-schedule': schedule" in message
    assert says in message
    assert f"[durable_flow.{check_id}]" in message and "hint:" in message
    assert isinstance(caught.value, RegistrationError)


def test_a_built_in_workflow_cannot_be_scheduled() -> None:
    with pytest.raises(ScheduleError, match="a built-in workflow cannot be scheduled"):
        workflow("internal-schedule", schedule="* * * * *", internal=True)


def test_a_cron_string_means_utc_and_the_latest_missed_tick() -> None:
    assert parse_schedule("w", "*/5 * * * *") == ScheduleSpec(cron="*/5 * * * *", timezone="UTC", catch_up="latest")


def test_ticks_follow_the_timezone_wall_clock_across_daylight_saving() -> None:
    spec = ScheduleSpec(cron="30 9 * * *", timezone="Europe/Paris")
    # Paris is UTC+1 in winter, UTC+2 from 29 March 2026.
    assert next_tick(spec, datetime(2026, 3, 28, 12, tzinfo=UTC)) == datetime(2026, 3, 29, 7, 30, tzinfo=UTC)
    assert next_tick(spec, datetime(2026, 3, 27, 12, tzinfo=UTC)) == datetime(2026, 3, 28, 8, 30, tzinfo=UTC)


def test_a_tick_in_the_hour_clocks_skip_falls_at_the_first_time_after_it() -> None:
    spec = ScheduleSpec(cron="30 2 * * *", timezone="Europe/Paris")
    # 02:30 does not exist on 29 March 2026 in Paris: 03:00 summer time (01:00 UTC).
    assert next_tick(spec, datetime(2026, 3, 28, 12, tzinfo=UTC)) == datetime(2026, 3, 29, 1, tzinfo=UTC)


def test_a_wall_clock_time_in_the_hour_that_repeats_is_one_tick() -> None:
    daily = ScheduleSpec(cron="30 2 * * *", timezone="Europe/Paris")
    # 02:30 happens twice on 25 October 2026 (00:30 and 01:30 UTC): the first only runs.
    assert next_tick(daily, datetime(2026, 10, 24, 12, tzinfo=UTC)) == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    assert next_tick(daily, datetime(2026, 10, 25, 0, 30, tzinfo=UTC)) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)

    every_20 = ScheduleSpec(cron="*/20 * * * *", timezone="Europe/Paris", catch_up="all", max_catch_up=100)
    utc = [datetime(2026, 10, 25, 0, m, tzinfo=UTC) for m in (0, 20, 40)] + [datetime(2026, 10, 25, 2, tzinfo=UTC)]
    assert next_tick(every_20, utc[2]) == utc[3]  # 01:00 to 01:40 UTC repeat 02:00 to 02:40
    assert due_ticks(every_20, utc[0], utc[3]) == (utc, datetime(2026, 10, 25, 2, 20, tzinfo=UTC))


EVERY_MINUTE = "* * * * *"
T0 = datetime(2026, 1, 1, 10, 0, tzinfo=UTC)


def at(minute: int, second: int = 0) -> datetime:
    return T0.replace(minute=minute, second=second)


@pytest.mark.parametrize(
    ("catch_up", "due"),
    [("skip", []), ("latest", [at(3)]), ("all", [at(1), at(2), at(3)])],
)
def test_missed_ticks_follow_the_catch_up_policy(catch_up: Any, due: list[datetime]) -> None:
    spec = ScheduleSpec(cron=EVERY_MINUTE, catch_up=catch_up, max_catch_up=3)
    assert due_ticks(spec, at(0), at(3, 30)) == (due, at(4))


@pytest.mark.parametrize("catch_up", ["skip", "latest", "all"])
def test_a_tick_on_time_runs_under_every_policy(catch_up: Any) -> None:
    spec = ScheduleSpec(cron=EVERY_MINUTE, catch_up=catch_up)
    assert due_ticks(spec, at(0), at(0, 30)) == ([at(0)], at(1))
    assert due_ticks(spec, at(1), at(0, 59)) == ([], at(1))


def test_due_count_counts_the_ticks_due_up_to_its_limit() -> None:
    """What a pass runs plus what its catch-up policy drops (the `skipped` ticks of the metrics)."""
    spec = ScheduleSpec(cron=EVERY_MINUTE)
    assert due_count(spec, at(0), at(3, 30)) == 4  # 10:00 to 10:03
    assert due_count(spec, at(0), at(0)) == 1
    assert due_count(spec, at(1), at(0, 59)) == 0
    assert due_count(spec, at(0), at(59), limit=10) == 10  # a long outage costs at most `limit` steps


def test_a_long_name_gets_a_distinct_run_id_that_fits() -> None:
    a, b = "x" * 199 + "a", "x" * 199 + "b"
    ids = {tick_run_id(a, T0), tick_run_id(b, T0)}
    assert len(ids) == 2 and all(len(run_id) <= RUN_ID_LENGTH for run_id in ids)
    assert tick_run_id("nightly", T0) == "nightly@2026-01-01T10:00:00Z"
