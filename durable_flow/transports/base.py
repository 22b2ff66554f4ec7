"""The transport interface: two kinds of work, both named by ids (the payload stays in the
database, the single source of truth).

The engine calls `enqueue_*` inside the transaction that records the dispatch; a transport
that talks to an outside broker must enqueue on commit (`transaction.on_commit`) so a job
never refers to a checkpoint that was rolled back. Admission has already happened by then:
the engine asks the admission backend before it dispatches to any transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from durable_flow.engine import Engine


@runtime_checkable
class Transport(Protocol):
    """Where turns and step attempts are sent to run."""

    name: str

    def bind(self, engine: Engine) -> None:
        """Called once by the engine that owns this transport."""

    def enqueue_turn(self, run_id: str) -> None:
        """Run the workflow's next turn (`engine.run_turn(run_id)`) somewhere."""

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        """Run attempt `attempt` of a step (`engine.execute_step(...)`) somewhere;
        higher `priority` first where the broker can order work."""
