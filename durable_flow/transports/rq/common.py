"""What the `rq` transport's producer and job functions (this package's `__init__`) and its
consumer (`source`) share: the priority tiers, the job paths, and the runner a job runs through.

It imports neither side, so the consumer never imports the producer's module.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from durable_flow.transports.runner import TaskRunner

HIGH, NORMAL, LOW = "high", "normal", "low"

JOB_KINDS = {
    "durable_flow.transports.rq.run_turn_job": "turn",
    "durable_flow.transports.rq.run_step_job": "step",
}
"""The kind of work behind each job function, by the path RQ stores in every queued job: those
paths are data, so `rq.run_turn_job` and `rq.run_step_job` stay where they are."""

_current = threading.local()


@contextmanager
def running_as(runner: TaskRunner) -> Iterator[None]:
    """The job functions called in this block (on this thread) run through `runner`."""
    _current.runner = runner
    try:
        yield
    finally:
        _current.runner = None


def current_runner() -> TaskRunner | None:
    """The runner `running_as` set on this thread, None outside it (a plain `rqworker`)."""
    return getattr(_current, "runner", None)
