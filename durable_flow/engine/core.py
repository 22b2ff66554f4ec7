"""`Engine`, which holds the engine's parts and wires them, and this process's engine.

Every state change happens in a database transaction that first locks the run's row
(`locking`), so a turn and a result landing for the same run never interleave. Transports are
told what to run inside that transaction (the `db` transport writes its task rows there; the
others enqueue on commit), so a crash can never leave a checkpoint that says "dispatched" with
no task, or a task whose checkpoint was rolled back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from durable_flow.admission.base import AdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.config.settings import DurableFlowSettings, build_backend, get_settings
from durable_flow.engine.admit import Admitter
from durable_flow.engine.base import TransportPort
from durable_flow.engine.calls import TurnCalls
from durable_flow.engine.dispatch import Dispatcher
from durable_flow.engine.handoff import Grants, GrantTimer
from durable_flow.engine.lifecycle import Lifecycle
from durable_flow.engine.optimistic import FirstTurns
from durable_flow.engine.release_order import Releases
from durable_flow.engine.results import Results
from durable_flow.engine.start_window import StartWindow
from durable_flow.engine.turns import Turns
from durable_flow.engine.wake import Waker
from durable_flow.models import StepCheckpoint, WorkflowRun
from durable_flow.store.pausing import PausedQueues
from durable_flow.store.queues import write_queues

if TYPE_CHECKING:
    from durable_flow.definitions.quotas import QuotaSpec
    from durable_flow.definitions.registry import WorkflowDefinition
    from durable_flow.engine.start_gate import StartGate
    from durable_flow.store.queries import AttemptStart


class Engine:
    """One process's engine: settings, the admission backend, the transport, and the parts
    built on them (see `durable_flow.engine`). Its methods are the operations other code calls
    (transports, workers, the poller, the API), each handed to the part that owns it."""

    dispatcher: Dispatcher
    grants: Grants
    releases: Releases
    admitter: Admitter
    start_window: StartWindow
    waker: Waker
    lifecycle: Lifecycle
    turns: Turns
    results: Results
    first_turns: FirstTurns

    def __init__(
        self,
        admission: AdmissionBackend,
        transport: TransportPort,
        settings: DurableFlowSettings | None = None,
        clock: Callable[[], datetime] = timezone.now,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`clock` and `sleep` are injectable so tests can drive time (`sleep` is how a worker
        waits for a rate window to have room for a step's start)."""
        self.settings = settings or get_settings()
        self.transport = transport
        self.clock = clock
        self.sleep = sleep
        self.paused_queues = PausedQueues(self.settings.poller_interval_ms / 1000)
        self.admission = admission  # builds the parts
        for config in self.settings.queues:
            self.admission.register(config)
        transport.bind(self)

    @property
    def admission(self) -> AdmissionBackend:
        """The admission backend; whichever is set learns the paused queues from this engine."""
        return self._admission

    @admission.setter
    def admission(self, backend: AdmissionBackend) -> None:
        """Set the backend and build the parts around it (tests swap it on a built engine; the
        grant timer keeps running if it ran)."""
        self._admission = backend
        backend.watch_pauses(self.paused_queues.names)
        timer_ran = "grants" in vars(self) and self.grants.timer.running
        if timer_ran:
            self.grants.timer.stop()
        self._build(backend)
        if timer_ran:
            self.grants.timer.start()

    def _build(self, admission: AdmissionBackend) -> None:
        """Build the parts in dependency order: each is given what it calls, and none calls
        back up this list."""
        settings, transport, clock = self.settings, self.transport, self.clock
        self.dispatcher = Dispatcher(settings, admission, transport, clock)
        self.grants = Grants(admission, self.paused_queues, self.dispatcher)
        self.releases = Releases(admission, self.grants)
        self.admitter = Admitter(admission, self.paused_queues, self.grants, self.releases, clock)
        self.start_window = StartWindow(admission, clock, self.sleep)
        self.waker = Waker(transport, clock)
        self.lifecycle = Lifecycle(settings, admission, transport, clock, self.releases, self.waker)
        calls = TurnCalls(clock, self.dispatcher, self.admitter, self.lifecycle)
        self.turns = Turns(settings, calls, self.lifecycle, self.waker)
        self.results = Results(
            settings, admission, clock, self.start_window, self.releases, self.lifecycle, self.turns, self.waker
        )
        self.first_turns = FirstTurns(settings, admission, clock, self.dispatcher, self.turns)

    def now(self) -> datetime:
        """The engine's clock (injectable for tests)."""
        return self.clock()

    @property
    def grant_timer(self) -> GrantTimer:
        """Grants a queue's room the instant its rate window reopens (workers and the poller
        start it)."""
        return self.grants.timer

    # Runs (`lifecycle`, `turns`).
    def start(
        self,
        workflow: WorkflowDefinition | str,
        input: Any = None,
        run_id: str | None = None,
        tags: Iterable[str] = (),
        quota: QuotaSpec | Mapping[str, Any] | None = None,
        gate: StartGate | None = None,
        priority: int = 0,
    ) -> WorkflowRun:
        """Create a run and queue its first turn (`Lifecycle.start`)."""
        return self.lifecycle.start(workflow, input, run_id, tags, quota, gate, priority)

    def cancel(self, run_id: str) -> WorkflowRun:
        """Cancel a run and its children (`Lifecycle.cancel`)."""
        return self.lifecycle.cancel(run_id)

    def send_signal(self, run_id: str, name: str, payload: Any = None) -> None:
        """Deliver a signal (`Lifecycle.send_signal`)."""
        self.lifecycle.send_signal(run_id, name, payload)

    def deliver_event(self, run_id: str, key: str, incoming: dict[str, Any]) -> bool:
        """Resume the run's event wait `key` with `incoming` (`Lifecycle.deliver_event`)."""
        return self.lifecycle.deliver_event(run_id, key, incoming)

    def wake(self, run: WorkflowRun | str) -> bool:
        """Queue a turn for a parked run now (`Waker.wake`)."""
        return self.waker.wake(run)

    def run_turn(
        self, run_id: str, *, in_settling_transaction: Callable[[], object] | None = None
    ) -> WorkflowRun | None:
        """Replay the run's workflow until it finishes or must wait (`Turns.run_turn`)."""
        return self.turns.run_turn(run_id, in_settling_transaction=in_settling_transaction)

    def run_first_turn(
        self,
        run_id: str,
        worker_id: str,
        *,
        on_step: Callable[[str], object] | None = None,
        in_settling_transaction: Callable[[], object] | None = None,
    ) -> str | None:
        """Take a run's first turn optimistically (`FirstTurns.run_first_turn`)."""
        return self.first_turns.run_first_turn(
            run_id, worker_id, on_step=on_step, in_settling_transaction=in_settling_transaction
        )

    # Step attempts (`results`, `dispatch`).
    def execute_step(
        self,
        run_id: str,
        key: str,
        attempt: int,
        worker_id: str = "",
        *,
        in_settling_transaction: Callable[[], object] | None = None,
        dispatched: StepCheckpoint | None = None,
    ) -> str:
        """Run one attempt of a dispatched step and record its result (`Results.execute_step`)."""
        return self.results.execute_step(
            run_id, key, attempt, worker_id, in_settling_transaction=in_settling_transaction, dispatched=dispatched
        )

    def record_result(
        self,
        run_id: str,
        key: str,
        attempt: int,
        *,
        output: Any = None,
        error: dict[str, Any] | None = None,
        cancelled: bool = False,
        in_settling_transaction: Callable[[], object] | None = None,
    ) -> None:
        """Checkpoint a step attempt's result exactly once (`Results.record_result`)."""
        self.results.record_result(
            run_id,
            key,
            attempt,
            output=output,
            error=error,
            cancelled=cancelled,
            in_settling_transaction=in_settling_transaction,
        )

    def redispatch_pending(
        self,
        run_id: str,
        older_than_s: float = 0.0,
        keys: Iterable[str] | None = None,
        seen: Mapping[str, AttemptStart] | None = None,
    ) -> int:
        """Re-send the run's in-flight steps (`Dispatcher.redispatch_pending`); with `seen`, only
        those still at the start judged lost."""
        return self.dispatcher.redispatch_pending(run_id, older_than_s, keys, seen)

    # Slots (`handoff`, `release_order`).
    def grant(self, queue: str) -> int:
        """Grant whatever room `queue` has now and dispatch the granted steps (`Grants.grant`)."""
        return self.grants.grant(queue)

    def reoffer_waiting(self, queue: str) -> int:
        """The poller's safety net for `queue` (`Grants.reoffer_waiting`)."""
        return self.grants.reoffer_waiting(queue)

    def release_ticket(self, queue: str, ticket: str) -> None:
        """Free a ticket's slot (or place in line) and hand the room on (`Grants.release_ticket`)."""
        self.grants.release_ticket(queue, ticket)

    def release_strays(self, queue: str) -> int:
        """Free the backend slots no checkpoint holds (`Grants.release_strays`)."""
        return self.grants.release_strays(queue)

    def release_stray(self, queue: str, ticket: str) -> bool:
        """Free one backend slot its checkpoint does not hold (`Grants.release_stray`)."""
        return self.grants.release_stray(queue, ticket)

    def release_settled(self, queue: str, ticket: str, *, guarded: bool = False) -> None:
        """Free the ticket of a call this transaction settles (`Releases.release_settled`)."""
        self.releases.release_settled(queue, ticket, guarded=guarded)

    # Queues.
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
