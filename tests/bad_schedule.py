"""A workflow whose schedule names a timezone that does not exist, for the schedules' process
test of `manage.py check` (loaded only through `DURABLE_FLOW_EXTRA_WORKFLOWS`)."""

from __future__ import annotations

from typing import Any

from durable_flow import workflow


@workflow("tests.bad-schedule", schedule={"cron": "0 3 * * *", "timezone": "Europe/Atlantis"})
def bad_schedule(ctx: Any, input: Any) -> None:
    return None
