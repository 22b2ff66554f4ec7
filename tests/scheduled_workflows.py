"""A scheduled workflow for the schedules' process test only: listed in `DURABLE_FLOW["WORKFLOWS"]`
by the processes that test starts (`DURABLE_FLOW_EXTRA_WORKFLOWS`), so no other test's poller
starts it."""

from __future__ import annotations

from typing import Any

from durable_flow import step, workflow


@step("tests.scheduled.echo")
def echo(value: Any) -> Any:
    return value


@workflow("tests.every-second", schedule={"cron": "* * * * * *", "catch_up": "all", "max_catch_up": 100})
def every_second(ctx: Any, input: Any) -> Any:
    return ctx.step(echo, ctx.run_id)
