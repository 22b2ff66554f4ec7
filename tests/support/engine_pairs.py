"""The two engine pairs the `engine` fixture runs a test on: `inline-local` (the `inline`
transport, `local` admission: all in this process) and `db-db` (the embedded default: `db`
admission, `db` transport).

On `db-db` nothing is short-circuited: the transport writes its task rows as in production, and
once the enqueueing transaction commits a real burst worker (`WorkerRuntime` on the transport's
own `DatabaseTaskSource`) claims, runs and deletes them in this process until none is left. So
a test's assertions after `start(...)`, `signal(...)`, `cancel(...)` or a poller tick hold as
they do inline. Time stays the test's: both admission backends and the engine read the
`MovableClock`, and due timers fire through the real `TimerPoller.tick`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import transaction

from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.runtime.controllers import build_controller
from durable_flow.runtime.worker import WorkerRuntime
from durable_flow.transports.db.transport import DatabaseTaskSource, DatabaseTransport

if TYPE_CHECKING:
    from tests.conftest import MovableClock

#: The pairs, as the ids of the `engine` fixture's parameters.
INLINE_LOCAL = "inline-local"
DB_DB = "db-db"
ENGINE_PAIRS = (INLINE_LOCAL, DB_DB)

#: The id of the burst workers (a real worker's is random: `new_worker_id`); one id, so a test
#: can name the worker its steps ran on (`worker_of`).
WORKER_ID = "db-db-worker"

#: Bursts one settle may run before it gives up (a task no burst takes would loop forever).
MAX_BURSTS = 20


class SettlingDatabaseTransport(DatabaseTransport):
    """The `db` transport whose tasks a burst worker of this process runs as soon as the
    enqueueing transaction commits (`settle`). Only the hook is added: the rows, the claim, the
    run and the delete are the transport's own."""

    def __init__(self) -> None:
        super().__init__()
        self._settling = threading.Lock()
        #: Bursts run so far (a test may check that the worker path ran).
        self.bursts = 0

    def enqueue_turn(self, run_id: str) -> None:
        super().enqueue_turn(run_id)
        transaction.on_commit(self.settle)

    def enqueue_first_turn(self, run_id: str, priority: int) -> None:
        super().enqueue_first_turn(run_id, priority)
        transaction.on_commit(self.settle)

    def enqueue_turns(self, run_ids: Sequence[str]) -> None:
        super().enqueue_turns(run_ids)
        transaction.on_commit(self.settle)

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        super().enqueue_step(run_id, step_key, attempt, priority)
        transaction.on_commit(self.settle)

    def settle(self) -> None:
        """Run burst workers until no task is claimable. A commit inside a burst (a worker
        thread's) finds the burst running and leaves its task to it; a commit by another thread
        while the last burst was ending is taken by the next one."""
        engine = self._engine
        if engine is None:
            return
        for _ in range(MAX_BURSTS):
            if not self._settling.acquire(blocking=False):
                return
            try:
                runtime = WorkerRuntime(
                    engine, self.source(), build_controller(1), worker_id=WORKER_ID, idle_wait_s=0.01
                )
                runtime.run(burst=True)
                self.bursts += 1
            finally:
                # The worker starts the grant timer, which reads the system clock: the test's
                # clock and poller grant instead.
                engine.grant_timer.stop()
                self._settling.release()
            if not DatabaseTaskSource._any_claimable(lapsed=False):
                return


def db_engine(clock: MovableClock, transport: Any = None) -> Engine:
    """An engine on the embedded default pair (`db` admission, `db` transport) on the test's
    clock, its tasks run by a burst worker on commit (or on `db` admission and `transport`);
    installed as this process's engine."""
    engine = Engine(
        admission=DatabaseAdmissionBackend(clock=lambda: clock.ms),
        transport=transport or SettlingDatabaseTransport(),
        settings=get_settings(),
        clock=clock,
    )
    set_engine(engine)
    return engine


def worker_of(engine: Engine) -> str:
    """The worker id the engine's steps are recorded with: `inline`'s, or the burst worker's."""
    return WORKER_ID if isinstance(engine.transport, SettlingDatabaseTransport) else "inline"
