"""`Engine`, the facade over the engine's parts, and this process's engine.

Every state change happens in a database transaction that first locks the run's row
(`locking`), so a turn and a result landing for the same run never interleave. Transports are
told what to run inside that transaction (the `db` transport writes its task rows there; the
others enqueue on commit), so a crash can never leave a checkpoint that says "dispatched" with
no task, or a task whose checkpoint was rolled back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from django.utils import timezone

from durable_flow.admission.base import AdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.config.settings import DurableFlowSettings, build_backend, get_settings
from durable_flow.engine.dispatch import DispatchMixin
from durable_flow.engine.handoff import GrantTimer, HandoffMixin
from durable_flow.engine.lifecycle import LifecycleMixin
from durable_flow.engine.optimistic import OptimisticMixin, ProbeGate
from durable_flow.engine.release_order import ReleaseOrderMixin
from durable_flow.engine.results import ResultsMixin
from durable_flow.engine.start_margins import StartMargins
from durable_flow.engine.turns import TurnsMixin
from durable_flow.store.outage import Outage
from durable_flow.store.pausing import PausedQueues
from durable_flow.store.queues import write_queues

if TYPE_CHECKING:
    from durable_flow.transports.base import Transport

logger = logging.getLogger("durable_flow.engine")


class Engine(LifecycleMixin, TurnsMixin, OptimisticMixin, DispatchMixin, HandoffMixin, ResultsMixin, ReleaseOrderMixin):
    """One process's engine: settings, the admission backend and the transport.

    Its operations live in the mixins, one module per responsibility: `lifecycle` (start,
    finish, cancel, signals), `turns` (replay, inline continuation, wake), `dispatch`
    (checkpoints, admission, dispatch), `handoff` (grants to parked waiters, the start
    window), `results` (step attempts and results) and `optimistic` (a first step recorded
    with its result).
    """

    def __init__(
        self,
        admission: AdmissionBackend,
        transport: Transport,
        settings: DurableFlowSettings | None = None,
        clock: Callable[[], datetime] = timezone.now,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`clock` and `sleep` are injectable so tests can drive time (`sleep` is how a worker
        waits for a rate window to have room for a step's start)."""
        self.settings = settings or get_settings()
        self.admission = admission
        self.transport = transport
        self.clock = clock
        self.sleep = sleep
        self.paused_queues = PausedQueues(self.settings.poller_interval_ms / 1000)
        self.grant_timer = GrantTimer(self.grant)
        self.release_outage = Outage("admission: releasing settled steps' slots", logger)
        self.start_outage = Outage("admission: counting a step's start", logger)
        self.start_margins = StartMargins()
        self.probe_gate = ProbeGate()
        for config in self.settings.queues:
            self.admission.register(config)
        transport.bind(self)

    @property  # type: ignore[override]
    def admission(self) -> AdmissionBackend:
        """The admission backend; whichever is set learns the paused queues from this engine."""
        return self._admission

    @admission.setter
    def admission(self, backend: AdmissionBackend) -> None:
        self._admission = backend
        backend.watch_pauses(self._paused_names)

    def _paused_names(self) -> frozenset[str]:
        return self.paused_queues.names()

    def register_queue(self, config: QueueConfig) -> QueueConfig:
        """Add or replace a queue on this process's backend and persist it for the others."""
        self.admission.register(config)
        write_queues([config])
        return config

    def persist_queues(self) -> None:
        """Write the settings' queues to `FlowQueue` (at migrate and at worker/poller start)."""
        write_queues(self.settings.queues)


_engine: Engine | None = None
_engine_lock = threading.Lock()


def get_engine() -> Engine:
    """This process's engine, built from settings on first use."""
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                settings = get_settings()
                _engine = Engine(
                    admission=build_backend(settings.admission),
                    transport=build_backend(settings.transport),
                    settings=settings,
                )
    return _engine


def set_engine(engine: Engine | None) -> None:
    """Replace (or with None, forget) this process's engine; used by tests."""
    global _engine
    _engine = engine
