"""The `rq` transport: turns and step attempts as RQ jobs on Redis, through django-rq.

Configuration::

    RQ_QUEUES = {"durable": {"URL": "redis://127.0.0.1:6379/0"}}
    DURABLE_FLOW = {"TRANSPORT": {"BACKEND": "rq", "QUEUE": "durable", "CONCURRENCY": 8}}

The options are declared (and explained) in `RQTransport.OPTIONS`.

Producing. The engine calls `enqueue_*` inside the transaction that records a dispatch, so a
job is enqueued on `transaction.on_commit`: it never names a checkpoint that was rolled back.
A job carries ids only (`run_id`, `step_key`, `attempt`); the database stays the single
source of truth. The job functions `run_turn_job`/`run_step_job` are module-level, so a
plain `manage.py rqworker` can run them too; `durable_worker` is the intended consumer.

Priority mapping. RQ queues are FIFO lists with no per-job priority, so `priority` selects
one of three tiered queues next to the configured one::

    priority > 0  ->  "<QUEUE>:high"
    priority == 0 ->  "<QUEUE>"          (workflow turns go here; a task's first turn goes on
                                          the tier of the task's priority)
    priority < 0  ->  "<QUEUE>:low"

A worker pops from the first non-empty list of `[high, normal, low]` in one atomic script
(`claims`): strict priority between tiers, FIFO within a tier.
Three tiers keep the set of queue names fixed (operators can list them in `RQ_QUEUES` for the
django-rq dashboard) and cover "urgent", "normal", "background". Ordering *within* a tier by
the exact value is admission's job; the broker only needs to let urgent work overtake the backlog.

Consuming. `RQTransport.source()` is an `RQTaskSource` (`source`) for the shared
worker runtime: jobs run on threads under the live concurrency limit, with RQ's bookkeeping kept
the way a `SimpleWorker` keeps it.

Eager steps (`EAGER_STEPS`, on by default). The first step a turn dispatches runs next on the
worker thread that ran the turn, with no RQ job, as Temporal's eager activity execution hands a
workflow task's activity straight back to its worker: a one-step workflow is one job, not two,
and a step starts without a second trip through Redis. The step is durable all the same: its
dispatch and its `running` attempt are written in the turn's transaction, stamped with this
worker, so a worker that dies or stops mid-step leaves it to the poller, which re-drives it as a
new attempt once the worker's heartbeat says so (`engine/inline_handoff.py`). What it costs: the
step is in none of RQ's registries, a stopping worker cannot hand it back as a job, and it runs
in the process that ran its turn. The other steps of a fan-out go out as jobs. Off, every step is
an RQ job. (A step granted a freed slot runs on the releasing thread either way.)
With `OPTIMISTIC_FIRST_STEP` (on by default with `EAGER_STEPS`) a run's first plain step, on its
turn job's first delivery, runs before anything is written and is recorded with its result in one
transaction (`engine/optimistic.py`); a re-delivered turn job (its `started_at` already set)
takes the locked path.

Durability. Exactly-once results do not depend on RQ: `Engine.record_result` is keyed by
run/step/attempt and ignores a duplicate or stale attempt, and `execute_step` skips an attempt
that is no longer the dispatched one, so a retried or duplicated job records nothing twice.
A worker killed with SIGKILL loses nothing: `execute_step` stamps the checkpoint with this
worker's id, the worker's heartbeat lapses, and the poller re-dispatches its steps as a new
attempt. A job popped but not yet started when the worker died is re-queued by the poller as
soon as that worker's heartbeat lapses (`reclaim_from`: the dead worker's entries leave RQ's
`StartedJobRegistry`, and its booked but unregistered pops leave the claim book, for the head
of their queue); RQ's own started-registry cleanup and the `REDISPATCH_AFTER_S` re-dispatch
remain as backstops. There is no RQ job timeout: a thread
cannot be killed safely mid-transaction, and step timeouts are the engine's (the attempt is re-dispatched).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from rq.executions import Execution, ExecutionRegistry
from rq.job import JobStatus, Retry, get_current_job
from rq.queue import Queue
from rq.registry import StartedJobRegistry

from durable_flow.config.options import Option, Validator, boolean, non_empty_str, number, optional
from durable_flow.config.validation import MAX_DURATION_MS
from durable_flow.engine import get_engine
from durable_flow.store import metric_counts
from durable_flow.transports.base import CONCURRENCY_OPTION, Transport
from durable_flow.transports.rq.claims import ClaimBook
from durable_flow.transports.rq.common import HIGH, LOW, NORMAL, current_runner
from durable_flow.transports.rq.source import RQTaskSource
from durable_flow.transports.runner import EngineRunner, TaskRunner

if TYPE_CHECKING:
    from redis import Redis

logger = logging.getLogger("durable_flow.transports.rq")

SETTING = 'DURABLE_FLOW["TRANSPORT"]'
#: RESULT_TTL / FAILURE_TTL: whole seconds up to ten years, -1 (forever) or None (RQ's).
_ttl: Validator = optional(number(-1, MAX_DURATION_MS // 1000, integer=True, unit="seconds, -1: forever"))


def tier_for(priority: int) -> str:
    """The tier a step of this priority is queued on."""
    if priority > 0:
        return HIGH
    if priority < 0:
        return LOW
    return NORMAL


def _run(job: Callable[[TaskRunner], str]) -> str:
    """Run `job` on the worker running it: `durable_worker`'s runtime, else (a plain `rqworker`)
    this process's engine with no worker id. A plain `rqworker` has no heartbeat to write its
    metric counts on, and runs each job in a forked process that exits after it: the job writes
    them itself, under the RQ worker's name (stable across its jobs, so one row per series)."""
    runner = current_runner()
    if runner is not None:
        return job(runner)
    current = get_current_job()
    if current is not None and current.worker_name:
        metric_counts.set_process(f"rq:{current.worker_name}")
    try:
        return job(EngineRunner(get_engine()))
    finally:
        metric_counts.flush_quietly()


def run_turn_job(run_id: str) -> str:
    """RQ job: replay the run's next turn. Returns the run's status afterwards."""
    return _run(lambda runner: runner.run_turn(run_id))


def run_step_job(run_id: str, step_key: str, attempt: int) -> str:
    """RQ job: run one attempt of a step and record its result (exactly once per attempt).

    The worker id is set by `durable_worker`, whose heartbeat lets the poller re-drive the
    step if the worker dies. Under a foreign RQ worker it is empty, so a lost step is
    re-driven after `REDISPATCH_AFTER_S` instead.
    """
    return _run(lambda runner: runner.run_step(run_id, step_key, attempt))


class RQTransport(Transport):
    """Producer side: an RQ job per workflow turn and per step attempt sent out (not a step run
    eagerly on its turn's thread), enqueued on commit."""

    name = "rq"
    OPTIONS: ClassVar[Mapping[str, Option]] = {
        "QUEUE": Option("The RQ_QUEUES entry whose connection, serializer and job class are used.", non_empty_str),
        "CONCURRENCY": CONCURRENCY_OPTION,
        "RESULT_TTL": Option("Seconds RQ keeps a finished job in its registry (-1: forever).", _ttl),
        "FAILURE_TTL": Option("Seconds RQ keeps a failed job in its registry (-1: forever).", _ttl),
        "EAGER_STEPS": Option(
            "Whether a step a turn dispatches runs next on the worker thread that ran the turn, with no "
            "RQ job (True, the default), or goes out as an RQ job like every other step (False).",
            boolean,
        ),
        "OPTIMISTIC_FIRST_STEP": Option(
            "Whether a run's first step, when it is a plain one (no queue, step concurrency, timeout or "
            "fan-out), runs before anything is written and is recorded with its result: one transaction "
            "a run fewer, the running step shown from its worker's heartbeat meanwhile, not from the run's "
            "rows (engine/optimistic.py). Needs EAGER_STEPS. Default: on with EAGER_STEPS.",
            boolean,
        ),
    }

    def __init__(
        self,
        queue: str = "durable",
        concurrency: object = 8,
        result_ttl: int | None = None,
        failure_ttl: int | None = None,
        eager_steps: bool = True,
        optimistic_first_step: bool | None = None,
    ) -> None:
        from django_rq.settings import QUEUES

        if queue not in QUEUES:
            known = ", ".join(sorted(QUEUES)) or "none"
            raise ImproperlyConfigured(
                f'{SETTING}["QUEUE"]: {queue!r} is not in settings.RQ_QUEUES (configured: {known})'
            )
        for key, ttl in (("RESULT_TTL", result_ttl), ("FAILURE_TTL", failure_ttl)):
            if problem := _ttl(ttl):
                raise ImproperlyConfigured(f'{SETTING}["{key}"]: {problem}')
        if optimistic_first_step and not eager_steps:
            raise ImproperlyConfigured(
                f'{SETTING}["OPTIMISTIC_FIRST_STEP"]: needs EAGER_STEPS (the first step runs on its turn\'s thread)'
            )
        if optimistic_first_step is None:
            optimistic_first_step = eager_steps  # on by default, wherever it can be
        self.check_concurrency(concurrency)  # validate now, not at worker start
        self.queue_name = queue
        self.concurrency = concurrency
        self.result_ttl = result_ttl
        self.failure_ttl = failure_ttl
        self.eager_steps = eager_steps
        self.optimistic_first_step = optimistic_first_step

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """The declared checks, plus what the constructor checks (QUEUE names an RQ_QUEUES
        entry, the TTLs); building opens no connection."""
        super().check_options(options)
        cls(**{key.lower(): value for key, value in options.items()})

    # -- queues ------------------------------------------------------------------------------
    @cached_property
    def tiers(self) -> dict[str, Queue]:
        """The three RQ queues, built lazily (no Redis connection at import or engine build).

        A tier listed in `RQ_QUEUES` is taken from there; otherwise it is a plain RQ queue on
        the base queue's connection, serializer, job class and default timeout (django-rq's
        queue class insists on an `RQ_QUEUES` entry).
        """
        import django_rq
        from django_rq.settings import QUEUES

        base = django_rq.get_queue(self.queue_name, commit_mode="auto")
        tiers = {NORMAL: base}
        for tier in (HIGH, LOW):
            name = f"{self.queue_name}:{tier}"
            if name in QUEUES:
                tiers[tier] = django_rq.get_queue(name, commit_mode="auto")
            else:
                tiers[tier] = Queue(
                    name,
                    connection=base.connection,
                    default_timeout=base._default_timeout,
                    job_class=base.job_class,
                    serializer=base.serializer,
                )
        return tiers

    @cached_property
    def _result_ttl(self) -> int | None:
        """RESULT_TTL, else the base queue's DEFAULT_RESULT_TTL / RQ's (None: RQ's default)."""
        if self.result_ttl is not None:
            return self.result_ttl
        from django_rq.queues import get_result_ttl

        return get_result_ttl(self.queue_name)

    @property
    def connection(self) -> Redis:
        return self.tiers[NORMAL].connection

    @cached_property
    def claims(self) -> ClaimBook:
        """Popped-but-unregistered jobs, and the doorbell idle workers wait on (`claims`)."""
        tier_keys = [self.tiers[tier].key for tier in (HIGH, NORMAL, LOW)]
        job_prefix = self.tiers[NORMAL].job_class.redis_job_namespace_prefix
        return ClaimBook(self.connection, self.queue_name, tier_keys, job_prefix)

    # -- producing ---------------------------------------------------------------------------
    def enqueue_turn(self, run_id: str) -> None:
        transaction.on_commit(partial(self._push, NORMAL, run_turn_job, (run_id,), f"turn {run_id}"))

    def enqueue_first_turn(self, run_id: str, priority: int) -> None:
        """A task's first turn goes on its priority's tier, as its step will: tasks that no queue
        holds back overtake the backlog by priority (tiers are coarse; admission orders within)."""
        transaction.on_commit(
            partial(self._push, tier_for(priority), run_turn_job, (run_id,), f"turn {run_id} (priority {priority})")
        )

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        transaction.on_commit(
            partial(
                self._push,
                tier_for(priority),
                run_step_job,
                (run_id, step_key, attempt),
                f"step {run_id}/{step_key} attempt {attempt} (priority {priority})",
            )
        )

    def _push(self, tier: str, func: Any, args: tuple[Any, ...], description: str) -> None:
        queue = self.tiers[tier]
        options: dict[str, Any] = {}
        if self._result_ttl is not None:
            options["result_ttl"] = self._result_ttl
        if self.failure_ttl is not None:
            options["failure_ttl"] = self.failure_ttl
        # No job timeout (timeout=-1): step timeouts are the engine's, and a worker thread
        # cannot be killed safely in the middle of a database transaction.
        # One MULTI: the job, then its bell (a worker woken by the bell finds the job).
        with self.connection.pipeline() as pipeline:
            queue.enqueue_call(
                func, args=args, timeout=-1, retry=Retry(max=3), description=description, pipeline=pipeline, **options
            )
            self.claims.ring(pipeline)
            pipeline.execute()

    def backlog(self) -> int:
        """Jobs waiting on the tiers' RQ queues (not popped by a worker yet)."""
        return sum(queue.count for queue in self.tiers.values())

    # -- recovery ----------------------------------------------------------------------------
    def reclaim_from(self, dead_workers: list[str]) -> int:
        """Put the jobs that dead workers had popped back at the head of their queues now.

        The poller calls this once a worker's heartbeat lapsed. Without it a popped job sits in
        RQ's `StartedJobRegistry` until its execution expires and (for a step not yet stamped
        with a worker) until `REDISPATCH_AFTER_S`, holding its queue slot all that time; a job
        it popped but had not registered yet is in the claim book (`claims`). Each
        registry entry is taken with its own `ZREM`, each booked one by a script that checks its
        owner, so of several pollers exactly one re-queues it. A re-run is harmless: a turn
        replays, and a stale step attempt is skipped by the engine.
        Returns how many jobs were re-queued.
        """
        dead = set(dead_workers)
        if not dead:
            return 0
        booked = reclaimed = self.claims.release_dead(dead)  # popped, killed before registering them
        connection = self.connection
        for queue in self.tiers.values():
            registry = StartedJobRegistry(queue.name, connection=connection, job_class=queue.job_class)
            entries = registry.get_job_and_execution_ids()
            if not entries:
                continue
            executions = [Execution(id=exec_id, job_id=job_id, connection=connection) for job_id, exec_id in entries]
            with connection.pipeline(transaction=False) as pipeline:
                for execution in executions:
                    pipeline.hget(execution.key, "worker_name")
                owners = pipeline.execute()
            for execution, owner in zip(executions, owners, strict=True):
                if owner is None or owner.decode() not in dead:
                    continue  # a live worker's, or expired: RQ's own cleanup takes the latter
                if not connection.zrem(registry.key, execution.composite_key):
                    continue  # another poller took it first
                with connection.pipeline() as pipeline:
                    pipeline.delete(execution.key)
                    ExecutionRegistry(job_id=execution.job_id, connection=connection).remove(execution, pipeline)
                    pipeline.hset(queue.job_class.key_for(execution.job_id), "status", JobStatus.QUEUED.value)
                    queue.push_job_id(execution.job_id, pipeline=pipeline, at_front=True)
                    self.claims.ring(pipeline)
                    pipeline.execute()
                reclaimed += 1
        if reclaimed:
            logger.warning("re-queued %d job(s) popped by dead worker(s), %d of them unregistered", reclaimed, booked)
        return reclaimed

    # -- consuming ---------------------------------------------------------------------------
    def source(self) -> RQTaskSource:
        """The consuming side, for `durable_worker`."""
        return RQTaskSource(self)
