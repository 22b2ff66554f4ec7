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
    priority == 0 ->  "<QUEUE>"          (workflow turns always go here)
    priority < 0  ->  "<QUEUE>:low"

A worker pops with `LMPOP`/`BLMPOP` over `[high, normal, low]`, which takes from the first
non-empty list in one atomic command: strict priority between tiers, FIFO within a tier.
Three tiers keep the set of queue names fixed (operators can list them in `RQ_QUEUES` for the
django-rq dashboard) and cover "urgent", "normal", "background". Ordering *within* a tier by
the exact value is admission's job; the broker only needs to let urgent work overtake the backlog.

Consuming. `RQTransport.source()` is an `RQTaskSource` for the shared `WorkerRuntime`: the
worker runs jobs on threads under the live concurrency limit, never forks (a fork costs more
than a typical step), and keeps RQ's bookkeeping the way a `SimpleWorker` would: the worker is
registered (and heartbeats) in RQ's worker registry, a claimed job gets an `Execution` in the
queue's `StartedJobRegistry`, and ends in the `FinishedJobRegistry` (with its outcome as the
job result) or the `FailedJobRegistry`. Claiming pops at most as many jobs as there are free
slots, so nothing waits in a local buffer.

Durability. Exactly-once results do not depend on RQ: `Engine.record_result` is keyed by
run/step/attempt and ignores a duplicate or stale attempt, and `execute_step` skips an attempt
that is no longer the dispatched one, so a retried or duplicated job records nothing twice.
A worker killed with SIGKILL loses nothing: `execute_step` stamps the checkpoint with this
worker's id, the worker's heartbeat lapses, and the poller re-dispatches its steps as a new
attempt. A job popped but not yet started when the worker died is re-queued by the poller as
soon as that worker's heartbeat lapses (`reclaim_from`: the dead worker's entries leave RQ's
`StartedJobRegistry` for the head of their queue); RQ's own started-registry cleanup and the
`REDISPATCH_AFTER_S` re-dispatch remain as backstops. There is no RQ job timeout: a thread
cannot be killed safely mid-transaction, and step timeouts are the engine's (the attempt is re-dispatched).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections.abc import Mapping
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus, Retry
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.utils import now as rq_now
from rq.worker import SimpleWorker

from durable_flow.options import Option, non_empty_str
from durable_flow.transports.base import CONCURRENCY_OPTION, Transport
from durable_flow.transports.runner import ClaimedTask, EngineRunner, TaskRunner, TaskSource

if TYPE_CHECKING:
    from redis import Redis

logger = logging.getLogger("durable_flow.transports.rq")

SETTING = 'DURABLE_FLOW["TRANSPORT"]'
HIGH, NORMAL, LOW = "high", "normal", "low"
#: How often a worker moves abandoned jobs out of RQ's started registries.
REGISTRY_CLEANUP_EVERY_S = 30.0

_current = threading.local()


def tier_for(priority: int) -> str:
    """The tier a step of this priority is queued on."""
    if priority > 0:
        return HIGH
    if priority < 0:
        return LOW
    return NORMAL


def _runner() -> TaskRunner:
    """The worker running this job: `durable_worker`'s, else (a plain `rqworker`) this
    process's engine with no worker id."""
    runner: TaskRunner | None = getattr(_current, "runner", None)
    if runner is None:
        from durable_flow.engine import get_engine

        runner = EngineRunner(get_engine())
    return runner


def run_turn_job(run_id: str) -> str:
    """RQ job: replay the run's next turn. Returns the run's status afterwards."""
    return _runner().run_turn(run_id)


def run_step_job(run_id: str, step_key: str, attempt: int) -> str:
    """RQ job: run one attempt of a step and record its result (exactly once per attempt).

    The worker id is set by `durable_worker`, whose heartbeat lets the poller re-drive the
    step if the worker dies. Under a foreign RQ worker it is empty, so a lost step is
    re-driven after `REDISPATCH_AFTER_S` instead.
    """
    return _runner().run_step(run_id, step_key, attempt)


JOB_KINDS = {
    f"{__name__}.run_turn_job": "turn",
    f"{__name__}.run_step_job": "step",
}


class RQTransport(Transport):
    """Producer side: one RQ job per workflow turn and per step attempt, enqueued on commit."""

    name = "rq"
    OPTIONS: ClassVar[Mapping[str, Option]] = {
        "QUEUE": Option("The RQ_QUEUES entry whose connection, serializer and job class are used.", non_empty_str),
        "CONCURRENCY": CONCURRENCY_OPTION,
        "RESULT_TTL": Option("Seconds RQ keeps a finished job in its registry (-1: forever)."),
        "FAILURE_TTL": Option("Seconds RQ keeps a failed job in its registry (-1: forever)."),
    }

    def __init__(
        self,
        queue: str = "durable",
        concurrency: object = 8,
        result_ttl: int | None = None,
        failure_ttl: int | None = None,
    ) -> None:
        from django_rq.settings import QUEUES

        if queue not in QUEUES:
            known = ", ".join(sorted(QUEUES)) or "none"
            raise ImproperlyConfigured(
                f'{SETTING}["QUEUE"]: {queue!r} is not in settings.RQ_QUEUES (configured: {known})'
            )
        for key, ttl in (("RESULT_TTL", result_ttl), ("FAILURE_TTL", failure_ttl)):
            if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < -1):
                raise ImproperlyConfigured(f'{SETTING}["{key}"]: must be an integer number of seconds, got {ttl!r}')
        self.check_concurrency(concurrency)  # validate now, not at worker start
        self.queue_name = queue
        self.concurrency = concurrency
        self.result_ttl = result_ttl
        self.failure_ttl = failure_ttl

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

    # -- producing ---------------------------------------------------------------------------
    def enqueue_turn(self, run_id: str) -> None:
        transaction.on_commit(partial(self._push, NORMAL, run_turn_job, (run_id,), f"turn {run_id}"))

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
        queue.enqueue_call(func, args=args, timeout=-1, retry=Retry(max=3), description=description, **options)

    # -- recovery ----------------------------------------------------------------------------
    def reclaim_from(self, dead_workers: list[str]) -> int:
        """Put the jobs that dead workers had popped back at the head of their queues now.

        The poller calls this once a worker's heartbeat lapsed. Without it a popped job sits in
        RQ's `StartedJobRegistry` until its execution expires and (for a step not yet stamped
        with a worker) until `REDISPATCH_AFTER_S`, holding its queue slot all that time. Each
        entry is taken with its own `ZREM`, so of several pollers exactly one re-queues it. A
        re-run is harmless: a turn replays, and a stale step attempt is skipped by the engine.
        Returns how many jobs were re-queued.
        """
        dead = set(dead_workers)
        if not dead:
            return 0
        reclaimed = 0
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
                    pipeline.execute()
                reclaimed += 1
        if reclaimed:
            logger.warning("re-queued %d job(s) popped by dead worker(s)", reclaimed)
        return reclaimed

    # -- consuming ---------------------------------------------------------------------------
    def source(self) -> RQTaskSource:
        """The consuming side, for `durable_worker`."""
        return RQTaskSource(self)


class RQTaskSource(TaskSource):
    """Consumer side: pop jobs high → normal → low, keep RQ's registries and worker record."""

    transport = "rq"

    def __init__(self, transport: RQTransport, execution_ttl_s: int | None = None) -> None:
        self.rq = transport
        self.ordered = [transport.tiers[HIGH], transport.tiers[NORMAL], transport.tiers[LOW]]
        self.queues = [queue.name for queue in self.ordered]
        self._by_key = {queue.key: queue for queue in self.ordered}
        self.connection = transport.connection
        self.execution_ttl_s = execution_ttl_s
        self.worker: SimpleWorker | None = None
        self._next_cleanup = 0.0

    # -- lifecycle (optional hooks of the runtime) ---------------------------------------------
    def open(self, runner: TaskRunner) -> None:
        """Register this process as an RQ worker, so `rqinfo` and django-rq list it."""
        if self.execution_ttl_s is None:
            # Like RQ's job_monitoring_interval + 60: an abandoned execution expires this
            # long after its worker's last heartbeat.
            self.execution_ttl_s = math.ceil(runner.heartbeat_ttl_s) + 60
        self.worker = SimpleWorker(
            self.ordered,
            name=runner.worker_id,
            connection=self.connection,
            job_class=self.ordered[1].job_class,
            serializer=self.ordered[1].serializer,
        )
        self.worker.register_birth()
        self.worker.set_state("idle")

    def close(self, worker_id: str) -> None:
        if self.worker is not None:
            self.worker.register_death()

    # -- claiming ------------------------------------------------------------------------------
    def claim(self, worker_id: str, limit: int, wait_s: float) -> list[ClaimedTask]:
        keys = [queue.key for queue in self.ordered]
        popped = self.connection.lmpop(len(keys), *keys, direction="LEFT", count=limit)
        if popped is None and wait_s > 0:
            popped = self.connection.blmpop(wait_s, len(keys), *keys, direction="LEFT", count=limit)
        if not popped:
            return []
        key, raw_ids = popped
        queue = self._by_key[key.decode() if isinstance(key, bytes) else key]
        ids = [raw.decode() if isinstance(raw, bytes) else raw for raw in raw_ids]
        jobs = [
            job
            for job in queue.job_class.fetch_many(ids, connection=self.connection, serializer=queue.serializer)
            if job is not None  # deleted or expired while queued: RQ skips these too
        ]
        tasks: list[ClaimedTask] = []
        assert self.execution_ttl_s is not None, "open() first"
        with self.connection.pipeline() as pipeline:
            for job in jobs:
                execution = Execution.create(job, self.execution_ttl_s, pipeline=pipeline, worker_name=worker_id)
                job.prepare_for_execution(worker_id, pipeline=pipeline)
                tasks.append(self._task(job, queue, execution))
            pipeline.execute()
        return tasks

    @staticmethod
    def _task(job: Job, queue: Queue, execution: Execution) -> ClaimedTask:
        kind = JOB_KINDS.get(job.func_name, "rq")
        handle = (job, queue, execution)
        if kind == "turn":
            return ClaimedTask(kind="turn", run_id=str(job.args[0]), handle=handle)
        if kind == "step":
            run_id, step_key, attempt = job.args
            return ClaimedTask(kind="step", run_id=run_id, step_key=step_key, attempt=int(attempt), handle=handle)
        return ClaimedTask(kind="rq", run_id="", handle=handle)

    # -- running -------------------------------------------------------------------------------
    def execute(self, runner: TaskRunner, task: ClaimedTask) -> bool:
        """Run the job through RQ's `Job.perform` (so `rq.get_current_job()` works in a step),
        with this worker as the runner in scope for the job function."""
        job: Job = task.handle[0]
        _current.runner = runner
        try:
            outcome = job.perform()
        finally:
            _current.runner = None
        task.outcome = str(outcome) if task.kind != "rq" else "completed"
        return task.outcome not in ("failed",)

    def done(self, worker_id: str, task: ClaimedTask) -> None:
        """Finished: the job lands in the FinishedJobRegistry with its outcome as result."""
        job, _queue, execution = task.handle
        job.ended_at = rq_now()
        result_ttl = job.get_result_ttl(self.worker.default_result_ttl if self.worker else 500)
        with self.connection.pipeline() as pipeline:
            if result_ttl != 0:
                job._handle_success(
                    result_ttl,
                    pipeline=pipeline,
                    worker_name=worker_id,
                    execution_id=execution.id,
                    execution_started_at=execution.created_at,
                    execution_ended_at=job.ended_at,
                )
            job.cleanup(result_ttl, pipeline=pipeline, remove_from_queue=False)
            execution.delete(job=job, pipeline=pipeline)
            if self.worker is not None:
                self.worker.increment_successful_job_count(pipeline=pipeline)
            pipeline.execute()

    def failed(self, worker_id: str, task: ClaimedTask, exc: BaseException) -> None:
        """The engine could not record the outcome (database down?): retry the job while it has
        retries left, else park it in the FailedJobRegistry where django-rq can requeue it."""
        job, queue, execution = task.handle
        job.ended_at = rq_now()
        exc_string = "".join(traceback.format_exception(exc))
        with self.connection.pipeline() as pipeline:
            execution.delete(job=job, pipeline=pipeline)
            if job.should_retry:
                job.retry(queue, pipeline)
            else:
                job.set_status(JobStatus.FAILED, pipeline=pipeline)
                job._handle_failure(
                    exc_string,
                    pipeline=pipeline,
                    worker_name=worker_id,
                    execution_id=execution.id,
                    execution_started_at=execution.created_at,
                    execution_ended_at=job.ended_at,
                )
            if self.worker is not None:
                self.worker.increment_failed_job_count(pipeline=pipeline)
            pipeline.execute()

    def hand_back(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        """Shutting down with work unfinished: put the jobs back at the front of their queues."""
        with self.connection.pipeline() as pipeline:
            for task in tasks:
                job, queue, execution = task.handle
                execution.delete(job=job, pipeline=pipeline)
                job.set_status(JobStatus.QUEUED, pipeline=pipeline)
                queue.push_job_id(job.id, pipeline=pipeline, at_front=True)
            pipeline.execute()

    def renew(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        """Every heartbeat: keep this worker and its executions alive in RQ, and now and then
        move executions abandoned by dead workers out of the started registries."""
        assert self.execution_ttl_s is not None
        with self.connection.pipeline() as pipeline:
            if self.worker is not None:
                self.worker.heartbeat(self.execution_ttl_s, pipeline=pipeline)
                self.worker.set_state("busy" if tasks else "idle", pipeline=pipeline)
            for task in tasks:
                _job, queue, execution = task.handle
                execution.heartbeat(queue.started_job_registry, self.execution_ttl_s, pipeline=pipeline)
            pipeline.execute()
        if time.monotonic() >= self._next_cleanup:
            self._next_cleanup = time.monotonic() + REGISTRY_CLEANUP_EVERY_S
            for queue in self.ordered:
                StartedJobRegistry(queue.name, connection=self.connection, job_class=queue.job_class).cleanup()
