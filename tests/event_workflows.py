"""Workflows for the events' process test only (loaded through `DURABLE_FLOW_EXTRA_WORKFLOWS`
and by that test): a sender whose step sends the `tests/fanout` event, and the workflows that
event starts. The start of `tests.fanout.2` stalls (its quota's limit callable sleeps) once,
the first time, if `DURABLE_FLOW_FANOUT_STALL` names a marker file not written yet: the test
kills the worker then, in the middle of the fan-out."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import durable_flow
from durable_flow import step, workflow

EVENT = "tests/fanout"
FANOUT = 6
STALLED = "tests.fanout.2"


@step("tests.fanout.send")
def send(event_id: str) -> str:
    return durable_flow.send_event(EVENT, {"fanout": FANOUT}, id=event_id).pk


@workflow("tests.fanout.sender")
def sender(ctx: Any, event_id: str) -> str:
    return ctx.step(send, event_id)


def _limit(name: str) -> Any:
    def limit(key: str) -> int:
        marker = os.environ.get("DURABLE_FLOW_FANOUT_STALL")
        if name == STALLED and marker and not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            time.sleep(600)  # killed here
        return 100

    return limit


def _echo(ctx: Any, event: Any) -> Any:
    return event["id"]


for index in range(FANOUT):
    name = f"tests.fanout.{index}"
    workflow(name, trigger=EVENT, quota={"key": '"fanout:" + event.id', "limit": _limit(name)})(_echo)


@workflow("tests.events.await_paid")
def await_paid(ctx: Any, order: int) -> Any:
    """Waits for `tests/orders.paid` of its own order (the wait-versus-event race of the process test)."""
    return ctx.wait_for_event("tests/orders.paid", match="async.data.order == event", timeout=timedelta(hours=1))
