"""The consuming side of the `rq` transport: what `durable_worker` serves when
`DURABLE_FLOW["TRANSPORT"]["BACKEND"]` is `rq` (the producing side is the package's `__init__`).

The worker runs jobs on threads under the live concurrency limit, never forks (a fork costs
more than a typical step), and keeps RQ's bookkeeping the way a `SimpleWorker` would: the
worker is registered (and heartbeats) in RQ's worker registry, a claimed job gets an
`Execution` in the queue's `StartedJobRegistry`, and ends in the `FinishedJobRegistry` (with its
outcome as the job result) or the `FailedJobRegistry`. Claiming pops at most as many jobs as
there are free slots, so nothing waits in a local buffer.

A pop is booked for this worker in the same atomic script, and struck from the book in the MULTI
that registers the jobs in the started registry, so a worker killed in between loses nothing
(`claims`); an idle worker blocks on the doorbell, not on the tier lists.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.utils import now as rq_now
from rq.worker import SimpleWorker

from durable_flow.transports.rq.claims import ClaimBook, Popped
from durable_flow.transports.rq.common import HIGH, JOB_KINDS, LOW, NORMAL, running_as
from durable_flow.transports.runner import ClaimedTask, SourceCapabilities, TaskRunner, TaskSource

if TYPE_CHECKING:
    from redis import Redis

#: How often a worker moves abandoned jobs out of RQ's started registries.
REGISTRY_CLEANUP_EVERY_S = 30.0


class RQProducer(Protocol):
    """What a source reads of its producer (`rq.RQTransport`): the tiers, their connection and
    claim book, and the options that decide where a turn's steps run."""

    @property
    def tiers(self) -> dict[str, Queue]: ...

    @property
    def connection(self) -> Redis: ...

    @property
    def claims(self) -> ClaimBook: ...

    eager_steps: bool
    optimistic_first_step: bool


class RQTaskSource(TaskSource):
    """Consumer side: pop jobs high → normal → low, keep RQ's registries and worker record."""

    transport = "rq"

    def __init__(
        self,
        transport: RQProducer,
        execution_ttl_s: int | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rq = transport
        self._monotonic = monotonic
        self.capabilities = SourceCapabilities(
            turn_steps_inline=transport.eager_steps,
            optimistic_first_step=transport.optimistic_first_step,
            spreads_handoffs=True,
        )
        self.ordered = [transport.tiers[HIGH], transport.tiers[NORMAL], transport.tiers[LOW]]
        self.queues = [queue.name for queue in self.ordered]
        self._by_key = {queue.key: queue for queue in self.ordered}
        self.connection = transport.connection
        self.execution_ttl_s = execution_ttl_s
        self.worker: SimpleWorker | None = None
        self._next_cleanup = 0.0
        self.claims = transport.claims
        #: A pop whose registration failed (Redis cut off in between): (tier key, ids), given
        #: back before the next pop. Only the worker loop claims, so no lock.
        self._unregistered: tuple[str, list[str]] | None = None

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
        if self.connection.exists(self.worker.key) and not self.connection.hexists(self.worker.key, "death"):
            # A crashed process of this name (a worker's name outlives its processes, and this
            # one took it only once that process's heartbeat lapsed): its record is stale.
            self.worker.register_death()
        self.worker.register_birth()
        self.worker.set_state("idle")
        self.outage_seen()  # this process cannot know how long Redis was away before it started

    def outage_seen(self) -> None:
        """The worker starts, or its claims fail or succeed again (an outage it rides out): move
        no expired execution out of RQ's started registries for one execution TTL. While Redis
        was away no worker could extend its executions, so an expired one may be a live worker's
        whose job still runs, and RQ's cleanup would retry the job (a second run beside the
        first); a live worker extends its executions within a heartbeat of Redis's return."""
        ttl = self.execution_ttl_s if self.execution_ttl_s is not None else REGISTRY_CLEANUP_EVERY_S
        self._next_cleanup = self._monotonic() + ttl

    def close(self, worker_id: str) -> None:
        if self._unregistered is not None:  # else the poller gives them back once this worker is dead
            tier_key, ids = self._unregistered
            self.claims.release_own(worker_id, tier_key, ids)
            self._unregistered = None
        if self.worker is not None:
            self.worker.register_death()

    # -- claiming ------------------------------------------------------------------------------
    def claim(self, worker_id: str, limit: int, wait_s: float) -> list[ClaimedTask]:
        if self._unregistered is not None:
            tier_key, ids = self._unregistered
            self.claims.release_own(worker_id, tier_key, ids)  # raises while Redis is still away
            self._unregistered = None
        popped = self.claims.pop(worker_id, limit)
        if popped is None and wait_s > 0 and self.claims.wait(wait_s):
            popped = self.claims.pop(worker_id, limit, bells_taken=1)
        if popped is None:
            return []
        try:
            return self._register(worker_id, popped)
        except BaseException:
            self._unregistered = (popped.tier_key, popped.ids)
            raise

    def _register(self, worker_id: str, popped: Popped) -> list[ClaimedTask]:
        """Give popped jobs their `Execution`s in the started registry, and strike them from
        the claim book in the same MULTI."""
        queue = self._by_key[popped.tier_key]
        jobs = []
        for job_id, data in zip(popped.ids, popped.jobs, strict=True):
            if not data:
                continue  # deleted or expired while queued: RQ skips these too
            job = queue.job_class(job_id, connection=self.connection, serializer=queue.serializer)
            job.restore(data)
            jobs.append(job)
        tasks: list[ClaimedTask] = []
        assert self.execution_ttl_s is not None, "open() first"
        with self.connection.pipeline() as pipeline:
            for job in jobs:
                # `started_at` is written by `prepare_for_execution`: already set on a job
                # re-queued from a dead or stopping worker, or retried after a failure.
                first_delivery = job.started_at is None
                execution = Execution.create(job, self.execution_ttl_s, pipeline=pipeline, worker_name=worker_id)
                job.prepare_for_execution(worker_id, pipeline=pipeline)
                tasks.append(self._task(job, queue, execution, first_delivery))
            self.claims.strike(popped.ids, pipeline)
            pipeline.execute()
        return tasks

    @staticmethod
    def _task(job: Job, queue: Queue, execution: Execution, first_delivery: bool = False) -> ClaimedTask:
        kind = JOB_KINDS.get(job.func_name, "rq")
        handle = (job, queue, execution)
        if kind == "turn":
            return ClaimedTask(kind="turn", run_id=str(job.args[0]), handle=handle, first_delivery=first_delivery)
        if kind == "step":
            run_id, step_key, attempt = job.args
            return ClaimedTask(kind="step", run_id=run_id, step_key=step_key, attempt=int(attempt), handle=handle)
        return ClaimedTask(kind="rq", run_id="", handle=handle)

    # -- running -------------------------------------------------------------------------------
    def execute(self, runner: TaskRunner, task: ClaimedTask) -> bool:
        """Run the job through RQ's `Job.perform` (so `rq.get_current_job()` works in a step),
        with this worker as the runner in scope for the job function."""
        job: Job = task.handle[0]
        with running_as(runner):
            outcome = job.perform()
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
                self.claims.ring(pipeline)
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
        now = self._monotonic()
        if now >= self._next_cleanup:
            self._next_cleanup = now + REGISTRY_CLEANUP_EVERY_S
            for queue in self.ordered:
                StartedJobRegistry(queue.name, connection=self.connection, job_class=queue.job_class).cleanup()
