"""The contract between a transport's consuming side and the worker that serves it.

A transport hands out work as `ClaimedTask`s from its `TaskSource`; the worker claims them and
runs each through a `TaskRunner`. Transports depend on this module, never on
`durable_flow.runtime`: the worker runtime (`WorkerRuntime`) is a `TaskRunner`, and a job run
outside `durable_worker` (a plain `manage.py rqworker`) gets an `EngineRunner` with no worker id.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from durable_flow.engine.core import Engine

#: The `in_settling_transaction=` argument of the run methods: a callable the engine calls inside
#: the transaction that settles the task (records the turn, or the step's result), after the run's
#: row is locked, so whatever it writes commits or rolls back with the outcome. The `db` source
#: deletes its task row there: no task is left behind a recorded outcome, and none is lost
#: before one. `None`: nothing to add.
SettlingHook = Callable[[], object] | None


@dataclass
class ClaimedTask:
    """A unit of work a source handed to this worker: a turn or a step attempt."""

    kind: str
    run_id: str
    step_key: str = ""
    attempt: int = 0
    handle: Any = field(default=None, repr=False)
    #: What the engine said: `completed`, `failed`, `skipped`, ... (set by the runner).
    outcome: str = ""
    #: The source knows it never handed this turn out before (not re-queued from a dead or
    #: stopping worker, not retried): a fact about the delivery, for the worker to use as its
    #: source's capabilities allow (`SourceCapabilities.optimistic_first_step`). Never on a step.
    first_delivery: bool = False


class TaskRunner(ABC):
    """The worker a source serves, as the source sees it: who it is, and how it runs work.

    Subclasses implement `run_turn`, `run_step` and `heartbeat_ttl_s`; `run` dispatches a
    claimed task (`run_task`) to the right one.
    """

    #: Stamped on the steps this worker executes, so the poller re-drives them if its heartbeat
    #: lapses; empty for a worker without a heartbeat (its lost steps wait REDISPATCH_AFTER_S).
    worker_id: str = ""

    @property
    @abstractmethod
    def heartbeat_ttl_s(self) -> float:
        """How long one heartbeat vouches for this worker (a source sizes its leases on it)."""

    @abstractmethod
    def run_turn(self, run_id: str, *, in_settling_transaction: SettlingHook = None) -> str:
        """Replay the run's next turn; the run's status afterwards, or `missing`. `in_settling_transaction` runs
        inside the turn's transaction (the `db` source deletes its task row there)."""

    @abstractmethod
    def run_step(
        self, run_id: str, step_key: str, attempt: int, *, in_settling_transaction: SettlingHook = None
    ) -> str:
        """Run one attempt of a step as this worker and record its result exactly once; the
        outcome (`completed`, `failed`, `skipped`, ...). `in_settling_transaction` runs inside the transaction
        that records the result."""

    def run_task(self, task: ClaimedTask, *, in_settling_transaction: SettlingHook = None) -> bool:
        """Run a claimed turn or step and set its outcome; True unless the step failed."""
        if task.kind == "turn":
            task.outcome = self.run_turn(task.run_id, in_settling_transaction=in_settling_transaction)
            return True
        task.outcome = self.run_step(
            task.run_id, task.step_key, task.attempt, in_settling_transaction=in_settling_transaction
        )
        return task.outcome != "failed"


class EngineRunner(TaskRunner):
    """Runs tasks through an engine, as worker `worker_id`."""

    def __init__(self, engine: Engine, worker_id: str = "") -> None:
        self.engine = engine
        self.worker_id = worker_id

    @property
    def heartbeat_ttl_s(self) -> float:
        return self.engine.settings.heartbeat_ttl_s

    def run_turn(self, run_id: str, *, in_settling_transaction: SettlingHook = None) -> str:
        run = self.engine.run_turn(run_id, in_settling_transaction=in_settling_transaction)
        return run.status if run is not None else "missing"

    def run_step(
        self, run_id: str, step_key: str, attempt: int, *, in_settling_transaction: SettlingHook = None
    ) -> str:
        return self.engine.execute_step(
            run_id, step_key, attempt, worker_id=self.worker_id, in_settling_transaction=in_settling_transaction
        )


@dataclass(frozen=True)
class SourceCapabilities:
    """What a source lets the worker do past it: the fast paths the worker runtime consults.

    A source declares them (`TaskSource.capabilities`); the engine and the runtime decide when
    to take each. All off by default, so a source opts in to each.
    """

    #: Whether the step a turn dispatches may run next on the turn's worker thread instead of
    #: going out through this transport (`engine/inline_handoff.py`): the `db` source always,
    #: the `rq` source with `EAGER_STEPS` (its users may want every step as a job, in RQ's
    #: registries and handed back at shutdown).
    turn_steps_inline: bool = False
    #: Whether a run's first turn, on its first delivery (`ClaimedTask.first_delivery`), may run
    #: its first step before writing anything (`engine/optimistic.py`): the `db` source with
    #: `OPTIMISTIC_FIRST_STEP`, the `rq` source with `OPTIMISTIC_FIRST_STEP` (and `EAGER_STEPS`).
    #: Taken only with `turn_steps_inline`.
    optimistic_first_step: bool = False
    #: Whether a task sent through this transport may be taken by another worker process, so a
    #: worker that runs two steps while another worker sits idle sends the step its result
    #: grants through it rather than running it next itself (`WorkerRuntime._spreading`), and
    #: the idle process takes it (see `TaskSource.sent_elsewhere`).
    spreads_handoffs: bool = False


NO_CAPABILITIES = SourceCapabilities()


class TaskSource(ABC):
    """The consuming side of a transport, served by a worker (`WorkerRuntime`).

    Subclasses implement `claim`, `done`, `hand_back` and `renew`; `open`, `close`, `execute`,
    `failed` and `sent_elsewhere` have defaults that suit a source with nothing to register or
    report, and `capabilities` declares which of the engine's fast paths it allows.
    """

    transport: str = ""
    queues: list[str] = []
    #: The engine's fast paths this source lets the worker take (none by default).
    capabilities: SourceCapabilities = NO_CAPABILITIES

    def sent_elsewhere(self) -> AbstractContextManager[None]:
        """Around the work whose dispatches are meant for another process (a handoff this
        worker declined): a source whose idle claimers this process's own commits wake (`db`)
        leaves them asleep, so its claimers and the other processes' find the task at their
        next poll alike. Nothing by default (a broker's waiting consumers take it in turn)."""
        return nullcontext()

    @abstractmethod
    def claim(self, worker_id: str, limit: int, wait_s: float) -> list[ClaimedTask]:
        """Take up to `limit` tasks, waiting up to `wait_s` for the first one."""

    @abstractmethod
    def done(self, worker_id: str, task: ClaimedTask) -> None:
        """The task ran to completion: forget it."""

    @abstractmethod
    def hand_back(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        """Return unfinished tasks so another worker can take them now."""

    @abstractmethod
    def renew(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        """Extend this worker's hold on the tasks it is running (called every heartbeat)."""

    # -- optional, with defaults -------------------------------------------------------------
    def open(self, runner: TaskRunner) -> None:
        """The worker starts (e.g. register it with the broker). Default: nothing."""
        return None

    def close(self, worker_id: str) -> None:
        """The worker stops. Default: nothing."""
        return None

    def outage_seen(self) -> None:
        """A claim failed for an outage, or succeeded again after one. Default: nothing (the
        `db` source takes no lapsed lease, the `rq` source retries no expired execution, for a
        while: none could be renewed meanwhile)."""
        return None

    def execute(self, runner: TaskRunner, task: ClaimedTask) -> bool:
        """Run one claimed task; True unless the step failed. Default: `runner.run_task(task)`."""
        return runner.run_task(task)

    def failed(self, worker_id: str, task: ClaimedTask, exc: BaseException) -> None:
        """The engine could not record the task's outcome. Default: nothing, so the task stays
        leased and is claimed again when its lease lapses (the step's result is idempotent)."""
        return None
