"""What every part of the engine shares: its settings, backends and clock.

The engine's responsibilities live in mixins (`lifecycle`, `turns`, `dispatch`, `results`)
combined by `Engine` in `core`; this base declares the state they all read, so each module can
be read on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from durable_flow.store.statements import save_fields

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.config.settings import DurableFlowSettings
    from durable_flow.store.pausing import PausedQueues
    from durable_flow.transports.base import Transport


class EngineBase:
    """The state shared by the engine's parts (set by `Engine.__init__`)."""

    settings: DurableFlowSettings
    admission: AdmissionBackend
    transport: Transport
    clock: Callable[[], datetime]
    sleep: Callable[[float], None]
    paused_queues: PausedQueues

    def now(self) -> datetime:
        """The engine's clock (injectable for tests)."""
        return self.clock()

    def settle(self, cp: Any, status: str, output: Any = None, error: Any = None, fields: Iterable[str] = ()) -> None:
        """Write a checkpoint's final status and result (and `fields` the caller changed, in
        the same UPDATE)."""
        cp.status = status
        cp.output = output
        cp.error = error
        cp.wake_at = None
        cp.finished_at = self.now()
        save_fields(cp, ["status", "output", "error", "wake_at", "finished_at", *fields])
