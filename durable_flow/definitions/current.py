"""Where a step runs: `current_step()` inside a step function tells it which run, call and
attempt it is, and gives it an idempotency key for the external calls it makes.

A step may run more than once (a retry after a failure, a re-dispatch after a timeout or a lost
worker, an operator's `retry`), so a step that charges a card or sends an email should pass
`current_step().idempotency_key` to the provider: the key is the same for every attempt of one
call of one run, and different for every other call and every other run (a `rerun` is a new run,
so a new key).

The engine sets the value in a `contextvars.ContextVar` around the one line that calls the step
function (`engine/results.py`), in whichever thread or process executes the attempt, so it is
right on every transport. An `async def` step runs under asgiref's `async_to_sync`, which copies
the context into the event loop: it sees the same value.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from durable_flow.exceptions import DurableFlowError


class NotInStep(DurableFlowError):
    """`current_step()` was called outside a step function (in a workflow function, a view, a
    test): there is no attempt to describe."""


@dataclass(frozen=True)
class StepInfo:
    """The step attempt executing now: `run_id`, the call's `key` in that run (stable across
    replays and attempts), the 1-based `attempt`, and `idempotency_key` (`"<run_id>/<key>"`)."""

    run_id: str
    key: str
    attempt: int
    idempotency_key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "idempotency_key", f"{self.run_id}/{self.key}")


_current: ContextVar[StepInfo | None] = ContextVar("durable_flow_current_step", default=None)


@contextmanager
def running_step(run_id: str, key: str, attempt: int) -> Iterator[StepInfo]:
    """Mark the block as executing attempt `attempt` of call `key` of run `run_id`."""
    info = StepInfo(run_id=run_id, key=key, attempt=attempt)
    token = _current.set(info)
    try:
        yield info
    finally:
        _current.reset(token)


def current_step() -> StepInfo:
    """The step attempt executing now; `NotInStep` outside a step function.

    Raising rather than returning None makes a step that depends on the key fail loudly when
    it is called directly (say, from a unit test) instead of sending a request keyed `None`.
    Use `step_or_none()` where being outside a step is normal.
    """
    info = _current.get()
    if info is None:
        raise NotInStep("current_step() is only available while a step function runs on a worker")
    return info


def step_or_none() -> StepInfo | None:
    """The step attempt executing now, or None outside a step function."""
    return _current.get()
