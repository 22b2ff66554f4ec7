"""The transport interface: two kinds of work, both named by ids (the payload stays in the
database, the single source of truth).

The engine calls `enqueue_*` inside the transaction that records the dispatch; a transport
that talks to an outside broker must enqueue on commit (`transaction.on_commit`) so a job
never refers to a checkpoint that was rolled back. Admission has already happened by then:
the engine asks the admission backend before it dispatches to any transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from durable_flow.config.concurrency import parse_worker_concurrency
from durable_flow.config.options import Configurable, Option

if TYPE_CHECKING:
    from durable_flow.engine.core import Engine
    from durable_flow.transports.runner import TaskSource

CONCURRENCY_OPTION = Option("Worker threads: a positive integer, 'adaptive' or an adaptive spec dict.")


class Transport(Configurable, ABC):
    """Where turns and step attempts are sent to run.

    Subclasses implement `enqueue_turn` and `enqueue_step`; the optional methods have working
    defaults for a transport that runs work in-process (`inline`).
    """

    SETTING: ClassVar[str] = 'DURABLE_FLOW["TRANSPORT"]'
    name: ClassVar[str] = ""
    #: The CONCURRENCY spec `durable_worker` uses when not given `--concurrency`.
    concurrency: object = 1
    _engine: Engine | None = None

    def bind(self, engine: Engine) -> None:
        """Called once by the engine that owns this transport."""
        self._engine = engine

    @abstractmethod
    def enqueue_turn(self, run_id: str) -> None:
        """Run the workflow's next turn (`engine.run_turn(run_id)`) somewhere."""

    @abstractmethod
    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        """Run attempt `attempt` of a step (`engine.execute_step(...)`) somewhere;
        higher `priority` first where the broker can order work."""

    # -- optional, with defaults -------------------------------------------------------------
    def enqueue_step_of_queue(self, queue: str, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        """`enqueue_step` for a step of flow-control queue `queue` ("" for none), for a transport
        that places work by queue (`rq`'s `ROUTES`); the default ignores the queue."""
        self.enqueue_step(run_id, step_key, attempt, priority)

    def enqueue_first_turn(self, run_id: str, priority: int) -> None:
        """Queue a new run's first turn at `priority` (a task's, `durable_flow.contrib.tasks`): higher
        first where the transport orders turns (`db`); the default queues it as any turn."""
        self.enqueue_turn(run_id)

    def enqueue_turns(self, run_ids: Sequence[str]) -> None:
        """Queue a turn for each run (bulk operations); a transport that can batch overrides it."""
        for run_id in run_ids:
            self.enqueue_turn(run_id)

    def source(self) -> TaskSource | None:
        """The consuming side `durable_worker` serves, or None (the default) for a transport
        that runs its work in-process."""
        return None

    def backlog(self) -> int | None:
        """Tasks sent to this transport that no worker has claimed yet (a metric), or None (the
        default) for a transport that runs its work in-process and has no backlog to count."""
        return None

    def reclaim_from(self, dead_workers: list[str]) -> int:
        """Make tasks claimed by these dead workers claimable now (poller upkeep); returns how
        many. Default: nothing to do (a broker without leases, or in-process work)."""
        return 0

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """The declared checks, plus CONCURRENCY's forms (validated here, not at worker start)."""
        super().check_options(options)
        if "CONCURRENCY" in options:
            cls.check_concurrency(options["CONCURRENCY"])

    @classmethod
    def deployment_problems(cls, options: Mapping[str, Any], declared_queues: list[str]) -> list[tuple[str, str]]:
        """What `manage.py check` reports beyond a refused option, as (check id, message), given
        the flow-control queues `DURABLE_FLOW["QUEUES"]` declares; reads settings only, connects to
        nothing. Default: nothing."""
        return []

    @classmethod
    def check_concurrency(cls, spec: object) -> None:
        """`ImproperlyConfigured` unless `spec` is a CONCURRENCY the worker can run with. The
        form is `durable_flow.config.concurrency`'s; a transport only carries the value."""
        parse_worker_concurrency(spec, setting=f'{cls.SETTING}["CONCURRENCY"]')

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Any:
        """Check every option (CONCURRENCY included), then build."""
        cls.check_options(options)
        return super().from_options(options)
