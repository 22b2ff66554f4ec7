"""What the engine's parts share that is not a part: the clock's type, what they ask of a
transport, and how a checkpoint is settled. (The run and step status groups they test are in
`durable_flow.models.runs`, beside the statuses.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Protocol

from durable_flow.store.statements import save_fields

#: The engine's clock: each part that reads the time is given it (tests drive time with it).
Clock = Callable[[], datetime]


class TaskQueue(Protocol):
    """What the engine's parts ask of a transport: to queue a turn or a step attempt, inside
    the transaction that records it (`transports.base.Transport` implements it). Declared here
    so the parts need nothing of the transports, which sit above the engine."""

    def enqueue_turn(self, run_id: str) -> None:
        """Queue the run's next turn."""

    def enqueue_first_turn(self, run_id: str, priority: int) -> None:
        """Queue a new run's first turn at `priority`."""

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        """Queue attempt `attempt` of the run's step `step_key`."""

    def enqueue_step_of_queue(self, queue: str, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        """`enqueue_step` for a step of flow-control queue `queue` (where the transport places
        work by queue)."""


class TransportPort(TaskQueue, Protocol):
    """The transport as the engine holds it: what it queues, and `bind`, which hands it the
    engine once (`transports.base.Transport` implements it; the engine imports nothing of the
    transports, which sit above it)."""

    def bind(self, engine: Any) -> None:
        """Remember the engine this transport serves."""


def settle(
    cp: Any, status: str, at: datetime, output: Any = None, error: Any = None, fields: Iterable[str] = ()
) -> None:
    """Write a checkpoint's final status and result, finished `at` (and `fields` the caller
    changed, in the same UPDATE)."""
    cp.status = status
    cp.output = output
    cp.error = error
    cp.wake_at = None
    cp.finished_at = at
    cp.wait_cause = ""  # settled: waiting for nothing (a queue wait's detail stays with its attempt)
    save_fields(cp, ["status", "output", "error", "wake_at", "finished_at", "wait_cause", *fields])
