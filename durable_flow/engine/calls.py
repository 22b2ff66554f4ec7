"""What a replaying workflow's calls reach in the engine (`turn.TurnEngine`, seen by `ctx`).

`ctx.step` builds a step's checkpoint, asks for its admission and dispatches it; `ctx.sleep`,
`ctx.wait_for_signal` and `ctx.wait_for_event` write a checkpoint, settle it, consume a signal
and look back for an event; `ctx.child`
starts a child run. Each goes to the part that owns it. A turn's replay is given this; the
optimistic first turn's probe is given its own (`optimistic._Probe`), which writes nothing.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from durable_flow.definitions.events import Condition
from durable_flow.definitions.registry import StepDefinition, WorkflowDefinition
from durable_flow.engine.base import settle
from durable_flow.engine.turn import StepOptions
from durable_flow.models import StepCheckpoint, WorkflowRun

if TYPE_CHECKING:
    from durable_flow.engine.admit import Admitter
    from durable_flow.engine.base import Clock
    from durable_flow.engine.dispatch import Dispatcher
    from durable_flow.engine.lifecycle import Lifecycle


class TurnCalls:
    """The engine as a turn's `ctx` sees it: its calls, each delegated to its owner."""

    def __init__(self, clock: Clock, dispatcher: Dispatcher, admitter: Admitter, lifecycle: Lifecycle) -> None:
        self.clock = clock
        self.dispatcher = dispatcher
        self.admitter = admitter
        self.lifecycle = lifecycle

    def now(self) -> datetime:
        return self.clock()

    def create_checkpoint(self, run: WorkflowRun, **fields: Any) -> StepCheckpoint:
        return self.dispatcher.create_checkpoint(run, **fields)

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
        return self.dispatcher.create_step_checkpoint(
            run, key=key, sequence=sequence, step=step, input=input, options=options, group=group
        )

    def admit(self, cp: StepCheckpoint, options: StepOptions | None = None) -> bool:
        return self.admitter.admit(cp, options)

    def give_up(self, cp: StepCheckpoint) -> bool:
        return self.admitter.give_up(cp)

    def dispatch(self, cp: StepCheckpoint, *, timeout_redispatch: bool = False, from_turn: bool = False) -> None:
        self.dispatcher.dispatch(cp, timeout_redispatch=timeout_redispatch, from_turn=from_turn)

    def settle(self, cp: StepCheckpoint, status: str, output: Any = None, error: Any = None) -> None:
        settle(cp, status, self.clock(), output=output, error=error)

    def consume_signal(self, run: WorkflowRun, name: str, key: str) -> Any:
        return self.lifecycle.consume_signal(run, name, key)

    def find_event(self, name: str, match: Condition | None, began: datetime, event: Any) -> Any:
        return self.lifecycle.find_event(name, match, began, event)

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
        return self.lifecycle.start_child(
            parent, key=key, sequence=sequence, definition=definition, input=input, group=group
        )
