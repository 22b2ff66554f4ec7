"""Schedules: a workflow started once per tick of a cron expression, across the whole fleet.

    @workflow("nightly-report", schedule={"cron": "0 3 * * *", "timezone": "Europe/Paris"})
    def nightly_report(ctx, input): ...

`schedule=` is a cron string (UTC, catch-up `latest`) or a dict: `cron` (five fields, or six
with seconds last, as `croniter` reads them), `timezone` (an IANA name, default `UTC`: the
ticks follow its wall clock through daylight-saving changes), `catch_up` (what the poller does
with ticks missed while no poller ran: `skip` them, run only the `latest`, or run `all` of them
oldest first, at most `max_catch_up`), `max_catch_up` (default 10) and `input` (the JSON input
of every scheduled run, default None).

The cron expression is read by `croniter` (maintained under pallets-eco, already a dependency
of `rq`'s scheduler): it validates expressions, and it steps through a timezone-aware datetime
by wall-clock time, so a tick at 02:30 on the night clocks spring forward falls at 03:00. A
wall-clock time is one tick: in the hour that repeats when clocks go back, ticks run on its
first pass only (`_repeated`), so an every-minute schedule in such a zone pauses for that hour;
declare `UTC` for evenly spaced ticks. `cronsim` reads the same syntax but would be
one more dependency for the same answer.

This module holds the declaration (`ScheduleSpec`, parsed at registration) and the pure tick
arithmetic (`next_tick`, `due_ticks`), which takes the time it is asked about and does no I/O;
`durable_flow.runtime.schedules` claims and starts the ticks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from durable_flow.config.limits import RUN_ID_LENGTH
from durable_flow.config.validation import number_problem
from durable_flow.exceptions import RegistrationError

CatchUp = Literal["skip", "latest", "all"]
CATCH_UP_POLICIES: tuple[CatchUp, ...] = ("skip", "latest", "all")
DEFAULT_CATCH_UP: CatchUp = "latest"
DEFAULT_MAX_CATCH_UP = 10
#: The most missed ticks `catch_up="all"` may run when a poller comes back: each is a run
#: started in one poller pass, so the bound keeps a pass short after a long outage.
MAX_CATCH_UP = 1000
FIELDS = {"cron", "timezone", "catch_up", "max_catch_up", "input"}

HINT = (
    'hint: schedule={"cron": "*/5 * * * *", "timezone": "Europe/Paris", "catch_up": "skip" | "latest" | "all", '
    '"max_catch_up": 10}; see docs/schedules.md'
)


class ScheduleError(RegistrationError):
    """A `schedule=` that does not parse: `check_id` names the rule it breaks (`E010` to `E013`,
    listed with the system checks in docs/settings.md), and the message ends with a hint."""

    def __init__(self, message: str, check_id: str) -> None:
        super().__init__(f"{message} [durable_flow.{check_id}] ({HINT})")
        self.check_id = check_id


@dataclass(frozen=True)
class ScheduleSpec:
    """A parsed `schedule=`: when ticks fall (`cron` in `timezone`) and what a poller that
    finds several ticks past does (`catch_up`, at most `max_catch_up` runs for `all`)."""

    cron: str
    timezone: str = "UTC"
    catch_up: CatchUp = DEFAULT_CATCH_UP
    max_catch_up: int = DEFAULT_MAX_CATCH_UP
    input: Any = None

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)


def parse_schedule(workflow: str, value: object) -> ScheduleSpec | None:
    """Parse `@workflow(..., schedule=...)` once, at registration. Every error is a
    `ScheduleError` naming the workflow, the field, the check id and a hint:
    `E010` a cron expression croniter refuses, `E011` an unknown timezone, `E012` a bad
    `catch_up` or `max_catch_up`, `E013` any other malformed declaration."""
    if value is None:
        return None
    where = f"workflow {workflow!r}: schedule"
    if isinstance(value, str):
        value = {"cron": value}
    if not isinstance(value, Mapping):
        raise ScheduleError(f"{where} must be a cron string or a dict, got {type(value).__name__}", "E013")
    unknown = sorted(set(map(str, value)) - FIELDS)
    if unknown:
        raise ScheduleError(f"{where}: unknown field(s) {', '.join(unknown)}", "E013")
    cron = value.get("cron")
    if not isinstance(cron, str) or not croniter.is_valid(cron):
        raise ScheduleError(f"{where} cron {cron!r} is not a valid cron expression", "E010")
    zone = value.get("timezone", "UTC")
    if not isinstance(zone, str) or not _known_zone(zone):
        raise ScheduleError(f"{where} timezone {zone!r} is not a known IANA timezone", "E011")
    catch_up = value.get("catch_up", DEFAULT_CATCH_UP)
    if catch_up not in CATCH_UP_POLICIES:
        raise ScheduleError(f"{where} catch_up must be one of {', '.join(CATCH_UP_POLICIES)}, got {catch_up!r}", "E012")
    bound = value.get("max_catch_up", DEFAULT_MAX_CATCH_UP)
    if problem := number_problem(bound, minimum=1, maximum=MAX_CATCH_UP, integer=True):
        raise ScheduleError(f"{where} max_catch_up {problem}", "E012")
    return ScheduleSpec(cron=cron, timezone=zone, catch_up=catch_up, max_catch_up=bound, input=value.get("input"))


def _known_zone(name: str) -> bool:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return False
    return True


def next_tick(spec: ScheduleSpec, after: datetime) -> datetime:
    """The first tick strictly after `after`, in UTC. For example `"0 * * * *"` after 10:00
    is 11:00, after 10:59:59 it is 11:00 too."""
    walk = croniter(spec.cron, after.astimezone(spec.zone))
    while _repeated(tick := walk.get_next(datetime), spec.zone):
        pass
    return tick.astimezone(UTC)


def _repeated(tick: datetime, zone: ZoneInfo) -> bool:
    """Whether `tick` (local, as croniter gives it) is the second pass of a wall-clock time, in
    the hour that repeats when clocks go back. Each wall-clock time is one tick: `30 2 * * *` in
    Paris runs at 02:30 summer time that night, not again at 02:30 winter time an hour later."""
    # Through UTC: the `fold` of croniter's own datetimes is not to be trusted.
    return tick.astimezone(UTC).astimezone(zone).fold == 1


def due_ticks(spec: ScheduleSpec, next_at: datetime, now: datetime) -> tuple[list[datetime], datetime]:
    """The ticks to run now, oldest first, and the schedule's next tick after `now`, for a
    schedule whose stored next tick is `next_at` (every tick from `next_at` to `now` is due).

    A due tick is *missed* when a later tick is due too (no poller ran at its time). `skip`
    runs a due tick only if none was missed; `latest` runs the most recent due tick; `all` runs
    every due tick, at most the `max_catch_up` most recent. For example every minute, next tick
    10:00, now 10:03:30: `skip` runs nothing, `latest` runs 10:03, `all` runs 10:00 to 10:03;
    each then waits for 10:04. Now 10:00:30: each runs 10:00.

    The due ticks are walked back from `now`, so a poller back after a long outage pays for at
    most `max_catch_up` ticks, not for every tick it missed."""
    if now < next_at:
        return [], next_at
    following = next_tick(spec, now)
    keep = spec.max_catch_up if spec.catch_up == "all" else 1
    walk = croniter(spec.cron, following.astimezone(spec.zone))
    due: list[datetime] = []
    while len(due) < keep:
        local = walk.get_prev(datetime)
        tick = local.astimezone(UTC)
        if tick < next_at:
            break
        if not _repeated(local, spec.zone):
            due.append(tick)
    due.reverse()
    if spec.catch_up == "skip" and due != [next_at]:
        return [], following  # later ticks than the stored one are due: it was missed
    return due, following


def due_count(spec: ScheduleSpec, next_at: datetime, now: datetime, limit: int = MAX_CATCH_UP) -> int:
    """How many ticks are due, from `next_at` (a tick) to `now`, counting at most `limit`: the
    ticks a pass runs plus those its catch-up policy drops. For example every minute, next tick
    10:00, now 10:03:30: 4 (10:00 to 10:03); now 9:59: 0."""
    count, tick = 0, next_at
    while tick <= now and count < limit:
        count += 1
        tick = next_tick(spec, tick)
    return count


def tick_run_id(workflow: str, tick: datetime) -> str:
    """The run id of `workflow`'s tick at `tick`: `"nightly-report@2026-03-29T01:00:00Z"`. A
    name too long for the column is cut and followed by a digest of the whole name, so two
    schedules never share a tick's id."""
    stamp = f"@{tick.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"
    if len(workflow) + len(stamp) <= RUN_ID_LENGTH:
        return f"{workflow}{stamp}"
    digest = hashlib.sha256(workflow.encode()).hexdigest()[:16]
    return f"{workflow[: RUN_ID_LENGTH - len(stamp) - 17]}~{digest}{stamp}"
