"""What a turn's `ctx` and the engine agree on: the small engine interface the context calls,
the `PENDING` sentinel, per-call options, and the ways a turn unwinds (`Unwind`).

The context (`context`) sees the engine only through this module's `TurnEngine`, never through
`Engine` and its parts, so the engine's internals can change without the context importing their
private names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from durable_flow.definitions.events import Condition
from durable_flow.definitions.registry import StepDefinition, WorkflowDefinition
from durable_flow.exceptions import DurableFlowError
from durable_flow.models import StepCheckpoint, WorkflowRun

PENDING: Any = object()
"""A call has no result yet (a step in flight, a signal not sent): the turn must suspend."""


class Unwind(BaseException):
    """How the engine unwinds user code (a turn's `Suspend`, the engine's own failure): a
    `BaseException`, so a workflow's `except Exception` cannot swallow it, and never taken for
    the code's own failure (`engine/user_code.py`)."""


class Suspend(Unwind):
    """Unwinds the workflow function when it must wait."""


class EngineUnavailable(Unwind):
    """The engine's own work inside a `ctx` call failed (database, admission backend, broker).

    Not the workflow's fault, so it must neither fail the run nor be caught by the workflow's
    `except Exception`: the turn is rolled back and retried. The original error is `__cause__`.
    """


class InlineTurnFailed(Unwind):
    """A run's inline turn (taken in the transaction that recorded a step's result) failed
    with `EngineUnavailable` (its `__cause__`). The transaction is rolled back whole and the
    result recorded again with the turn queued instead (`Results.record_result`).

    An `Unwind`, like `EngineUnavailable`: nothing between the turn and the result's
    transaction may take it for an error of its own."""


@contextmanager
def engine_call() -> Iterator[None]:
    """Let the workflow's own errors through; turn the engine's failures into `EngineUnavailable`."""
    try:
        yield
    except DurableFlowError:
        raise
    except Exception as exc:
        raise EngineUnavailable(f"{type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class StepOptions:
    """Per-call options of `ctx.step`."""

    queue: str = ""
    priority: int = 0
    fairness_key: str = ""
    retries: int | None = None
    timeout: timedelta | None = None
    #: How long the call may wait for admission (None: its queue's `start_timeout_s`, if any),
    #: and what it does then ("fail" or "skip"; None: its queue's, else "fail").
    start_timeout: timedelta | None = None
    on_start_timeout: str | None = None


class TurnEngine(Protocol):
    """The engine as a turn's context sees it (implemented by `durable_flow.engine.calls.TurnCalls`)."""

    def now(self) -> datetime:
        """The engine's clock."""

    def create_checkpoint(self, run: WorkflowRun, **fields: Any) -> StepCheckpoint:
        """Write a checkpoint for a call that needs no admission (sleep, signal)."""

    def create_step_checkpoint(
        self,
        run: WorkflowRun,
        *,
        key: str,
        sequence: int,
        step: StepDefinition[Any],
        input: Any,
        options: StepOptions,
        group: str,
    ) -> StepCheckpoint:
        """Build (unsaved) a step call's checkpoint."""

    def admit(self, cp: StepCheckpoint, options: StepOptions | None = None) -> bool:
        """Ask the step's queue for a slot: True when admitted, False when parked in its line
        (with a deadline, when `options` or its queue give a start timeout)."""

    def give_up(self, cp: StepCheckpoint) -> bool:
        """A parked call's start timeout ran out: withdraw and settle it; True when it failed,
        False when it was skipped."""

    def dispatch(self, cp: StepCheckpoint, *, timeout_redispatch: bool = False, from_turn: bool = False) -> None:
        """Send a new attempt of the step out (`from_turn`: a turn's call just admitted, which a
        worker running the turn may take itself)."""

    def settle(self, cp: StepCheckpoint, status: str, output: Any = None, error: Any = None) -> None:
        """Write a checkpoint's final status and result."""

    def consume_signal(self, run: WorkflowRun, name: str, key: str) -> Any:
        """The oldest unconsumed signal `name`, or `PENDING`."""

    def find_event(self, name: str, match: Condition | None, began: datetime, event: Any) -> Any:
        """A new event wait's look-back: the first matching event since `began`, or `PENDING`."""

    def start_child(
        self,
        parent: WorkflowRun,
        *,
        key: str,
        sequence: int,
        definition: WorkflowDefinition,
        input: Any,
        group: str,
    ) -> StepCheckpoint:
        """Start a child run and write the parent's checkpoint for it."""
